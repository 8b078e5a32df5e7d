#!/usr/bin/env bash
# The learner's throughput levers one at a time on one GPU (issue 11's off/on table): bench/learner_step.py
# on the Qwen2.5-0.5B shape, 64 x 2048 tokens, GRPO, each row a separate process. Results in ${OUT:-bench-out}/.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-bench-out}
mkdir -p "$out"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/gpus.txt"
run() {  # name, micro-batch, overrides...
  local name=$1 mb=$2; shift 2
  local sets=(); for s in "$@"; do sets+=(--set "$s"); done
  CUDA_VISIBLE_DEVICES=0 timeout 300 python3 bench/learner_step.py --micro-batch "$mb" "${sets[@]}" \
    --out "$out/lever_$name.json" > "$out/lever_$name.log" 2>&1 || tail -5 "$out/lever_$name.log"
}
run dense_mb4 4 learner.logprob_chunk_tokens=0
run chunked_mb4 4 learner.logprob_chunk_tokens=4096
run dense_mb8 8 learner.logprob_chunk_tokens=0
run chunked_mb8 8 learner.logprob_chunk_tokens=4096
run chunked_ac_mb16 16 learner.logprob_chunk_tokens=4096 learner.activation_checkpointing=true
run chunked_compile_mb8 8 learner.logprob_chunk_tokens=4096 learner.compile=true
python3 - "$out" <<'PY'
import json, pathlib, sys
for f in sorted(pathlib.Path(sys.argv[1]).glob("lever_*.json")):
    r = json.loads(f.read_text())
    print(f"{f.stem:28s} {r['gpu']:22s} step {r['step_seconds_median']:.3f}s {r['tokens_per_second']:8.0f} tok/s "
          f"MFU {100 * r['mfu']:.1f}%  mem {max(r['max_memory_gib_per_rank']):.1f} GiB")
PY
