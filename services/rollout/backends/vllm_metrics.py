"""The vLLM engine series the dashboards and docs rely on. vLLM's own Prometheus stat logger defines
them (the backend turns vLLM's statistics on); they carry vLLM's labels `model_name` and `engine`, and
are served by the rollout's metrics endpoint beside `omrl_rollout_*`.

Listed here, without importing vLLM, so that the dashboard tests know them; the vLLM integration
test checks that a real engine exports every one."""

ENGINE_SERIES = {
    "vllm:kv_cache_usage_perc": "KV-cache blocks in use, 0..1 (1 = full)",
    "vllm:num_requests_running": "requests in the engine's running batch",
    "vllm:num_requests_waiting": "requests queued for a place in the batch (KV cache or max_num_seqs full)",
    "vllm:prefix_cache_queries_total": "prompt tokens looked up in the prefix cache (counter)",
    "vllm:prefix_cache_hits_total": "of those, tokens found cached (counter)",
    "vllm:num_preemptions_total": "requests preempted for lack of KV-cache blocks (counter)",
}
