"""The vLLM generation backend: vLLM's async engine (continuous batching) behind `RolloutBackend`.

Token ids in, sampled token ids and their logprobs out. Weights are replaced in place through a
worker extension (`vllm_worker_ext.WeightReloadExtension`) called with `collective_rpc`.

vLLM starts its engine core and worker in child processes: on the CPU forked where `vllm_start` finds it safe
(a process with no other thread, a worker bound to one CPU: the rollout server), else spawned, so any script
that builds this backend needs an `if __name__ == "__main__":` guard.
"""

from __future__ import annotations

import logging
import os
import platform
from collections.abc import Iterable
from typing import Any

import psutil
import torch
from vllm import SamplingParams
from vllm import __version__ as VLLM_VERSION
from vllm import envs as vllm_envs
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.inputs import TokensPrompt
from vllm.platforms import current_platform
from vllm.sampling_params import RequestOutputKind
from vllm.usage.usage_lib import UsageContext
from vllm.v1.engine.async_llm import AsyncLLM
from vllm.v1.metrics.loggers import PrometheusStatLogger, StatLoggerBase

from services.engines import engine_metrics
from services.engines.base import BACKENDS, Generation, RolloutBackend, SamplingSpec
from services.engines.vllm_args import engine_kwargs
from services.engines.vllm_start import FORKED_ENV, START_METHOD_ENV, cpu_start_method, other_threads
from services.engines.vllm_weights import pack_tensor

log = logging.getLogger(__name__)

WORKER_EXTENSION = "services.engines.vllm_worker_ext.WeightReloadExtension"

_FINISH = {"stop": "stop", "length": "length", "abort": "abort", "repetition": "abort"}
"""vLLM finish reasons -> ours; "error" (a retryable engine-side failure) raises instead."""


class EngineStatsLogger(StatLoggerBase):
    """vLLM stat logger (one per engine, called in this process after each engine step) that feeds
    `engine_metrics`. It reads `SchedulerStats` / `IterationStats`, which vLLM does not promise to
    keep stable: the vLLM integration test checks the metrics move."""

    def __init__(self, vllm_config: Any, engine_index: int = 0):
        self.engine_index = engine_index

    def record(self, scheduler_stats: Any, iteration_stats: Any, mm_cache_stats: Any = None, engine_idx: int = 0):
        if scheduler_stats is not None:
            engine_metrics.record_step(
                running=scheduler_stats.num_running_reqs,
                waiting=scheduler_stats.num_waiting_reqs + scheduler_stats.num_skipped_waiting_reqs,
                kv_cache_usage=scheduler_stats.kv_cache_usage,
                prefix_queries=scheduler_stats.prefix_cache_stats.queries,
                prefix_hits=scheduler_stats.prefix_cache_stats.hits,
            )
        if iteration_stats is not None:
            engine_metrics.record_preemptions(iteration_stats.num_preempted_reqs)

    def log_engine_initialized(self) -> None:
        pass


class SilentPrometheusStatLogger(PrometheusStatLogger):
    """Takes the place of vLLM's Prometheus stat logger, which vLLM adds unless it is given one of its
    subclasses: registers no metric and records nothing (so `PrometheusStatLogger.__init__` never runs)."""

    def __init__(self, vllm_config: Any, engine_indexes: list[int] | None = None):
        self.engine_indexes = engine_indexes or [0]

    def record(self, scheduler_stats: Any, iteration_stats: Any, mm_cache_stats: Any = None, engine_idx: int = 0):
        pass

    def record_admission_rejection(self, reason: str) -> None:
        pass

    def record_sleep_state(self, sleep: int = 0, level: int = 0) -> None:
        pass

    def log(self) -> None:
        pass

    def log_engine_initialized(self) -> None:
        pass


def stat_loggers(vllm_metrics: bool) -> list[type[StatLoggerBase]]:
    """The engine's stat logger factories: ours, and without `vllm_metrics` the silent stand-in for vLLM's."""
    return [EngineStatsLogger] if vllm_metrics else [EngineStatsLogger, SilentPrometheusStatLogger]


def engine_environment(deterministic: bool, on_cpu: bool) -> dict[str, str]:
    """vLLM settings the run's config implies. `deterministic` on a GPU: batch-invariant kernels, so a request's
    tokens do not depend on which others share its batch (vLLM's CPU kernels compute each row alone already:
    a seeded request gave the same logprobs, bit for bit, alone and in batches of 8 here)."""
    return {"VLLM_BATCH_INVARIANT": "1"} if deterministic and not on_cpu else {}


@BACKENDS.register("vllm")
class VllmBackend(RolloutBackend):
    """One vLLM `AsyncLLM` engine. Build it, `await start()` inside the event loop that will call
    `generate`, and `await shutdown()` in that same loop.

    `logprobs_mode="processed_logprobs"` returns each token's logprob under the distribution it was
    actually sampled from (after temperature/top-k/top-p): the behaviour policy the learner corrects
    against. `gpus` is vLLM's tensor-parallel size (GPU only). `engine_args` are further
    `AsyncEngineArgs` (`vllm_args` says which keys are refused and which override the backend's
    defaults). On CPU the KV cache is `gpu_memory_utilization` of RAM (at most max_num_seqs full
    sequences) unless `engine_args` sets `kv_cache_memory_bytes` (the legacy `VLLM_CPU_KVCACHE_SPACE`, in
    GiB, overrides both).

    vLLM's statistics are on: `EngineStatsLogger` feeds `omrl_rollout_engine_*` (KV-cache use, running
    and waiting requests, prefix-cache queries and hits, preemptions), and with `vllm_metrics` vLLM's own
    Prometheus stat logger registers its `vllm:*` metrics; both live in this process's default registry,
    which the rollout's metrics endpoint serves.
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
        gpus: int = 1,
        logprobs_mode: str = "processed_logprobs",
        engine_args: dict[str, Any] | None = None,
        vllm_metrics: bool = True,
        weight_staging: str = "file",
        deterministic: bool = False,
    ):
        self.model = str(model)
        self.dtype = dtype
        self.max_model_len = max_model_len
        self.logprobs_mode = logprobs_mode
        self.gpus = gpus
        self.engine_args = dict(engine_args or {})
        self.vllm_metrics = vllm_metrics
        self.weight_staging = weight_staging
        self.environment = engine_environment(deterministic, current_platform.is_cpu())
        kwargs = engine_kwargs(
            model=self.model,
            dtype=dtype,
            max_model_len=max_model_len,
            gpu_memory_utilization=gpu_memory_utilization,
            max_num_seqs=max_num_seqs,
            enforce_eager=enforce_eager,
            seed=seed,
            gpus=gpus,
            on_cpu=current_platform.is_cpu(),
            ram_bytes=psutil.virtual_memory().total,
            worker_extension=WORKER_EXTENSION,
            logprobs_mode=logprobs_mode,
            engine_args=self.engine_args,
        )
        # nested configs are converted here; vLLM checks the rest (ranges, combinations) in start()
        self._engine_args = AsyncEngineArgs(**kwargs)
        self._engine: AsyncLLM | None = None
        self._nccl_group: str | None = None  # the learner's process group the workers are in
        self.start_method: str | None = None  # `fork` where this backend chose it, else vLLM's choice

    async def start(self) -> None:
        if self._engine is not None:
            return
        # Starting the engine edits this process's environment for its workers (LD_PRELOAD of
        # torch's libgomp, VLLM_WORKER_MULTIPROC_METHOD=spawn, ...); the workers are running once
        # this returns, so put it back rather than leak it into processes this one starts later.
        saved = dict(os.environ)
        vllm_envs.disable_envs_cache()  # another engine's cache must not hide what this start sets
        os.environ.update(self.environment)
        saved.update(self.environment)  # this process's input and output processing reads them too
        try:
            config = self._engine_args.create_engine_config(UsageContext.ENGINE_CONTEXT)
            threads = other_threads()
            requested = saved.get(START_METHOD_ENV, "")
            bind = saved.get("VLLM_CPU_OMP_THREADS_BIND", "")
            self.start_method = cpu_start_method(
                current_platform.is_cpu(), threads, requested, platform.machine(), bind
            )
            log.info("vLLM engine processes: %s (other threads here: %s)", self.start_method or "vLLM's", threads)
            if self.start_method is not None:
                os.environ[START_METHOD_ENV] = self.start_method  # the CPU config set `spawn`
                os.environ[FORKED_ENV] = "1" if self.start_method == "fork" else "0"
            self._engine = AsyncLLM.from_vllm_config(
                config,
                stat_loggers=stat_loggers(self.vllm_metrics),
                enable_log_requests=self._engine_args.enable_log_requests,
                disable_log_stats=self._engine_args.disable_log_stats,
            )
        finally:
            os.environ.clear()
            os.environ.update(saved)
        # vLLM reads its `VLLM_*` settings from os.environ at every use (several times per request in this
        # process: input and output processing) until its envs cache is on; its engine core and workers, and
        # its own API server once started, turn it on. This process sets none of them from here on.
        vllm_envs.enable_envs_cache()

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
            logprobs=sampling.top_logprobs,  # 0: the sampled token's own logprob only
            detokenize=False,
            output_kind=RequestOutputKind.FINAL_ONLY,
            skip_clone=True,  # built for this request alone: vLLM's deep copy of it (~0.3 ms) is not needed
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
        top = (
            [{int(t): float(lp.logprob) for t, lp in entry.items()} for entry in entries]
            if sampling.top_logprobs
            else []
        )
        return Generation(
            token_ids=token_ids, logprobs=logprobs, finish_reason=_FINISH.get(reason, "abort"), top_logprobs=top
        )

    async def load_weights(self, named_tensors: Iterable[tuple[str, Any]]) -> None:
        with torch.no_grad():
            packed = [pack_tensor(name, t) for name, t in named_tensors]
        if not packed:
            return
        await self.engine.collective_rpc("reload_named_tensors", args=(packed,))
        # Cached KV blocks were computed by the old weights: drop them so no prompt reuses them.
        if not await self.engine.reset_prefix_cache():
            raise RuntimeError("could not reset vLLM's prefix cache after loading weights (requests still running?)")

    async def load_weight_spool(self, spool, version: int) -> None:
        """Through vLLM's weight-transfer API: one `update_weights` per spooled bucket, which the
        worker's `omrl_spool` engine maps from the file and loads (layerwise reload, then the packed
        output heads are refreshed in `finish_weight_update`)."""
        from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

        await self.engine.start_weight_update()
        for bucket in spool.buckets:
            await self.engine.update_weights(WeightTransferUpdateRequest(update_info=bucket.to_info(spool.path)))
        await self.engine.finish_weight_update(weight_version=str(version))
        if not await self.engine.reset_prefix_cache():
            raise RuntimeError("could not reset vLLM's prefix cache after loading weights (requests still running?)")

    async def begin_nccl_push(self, rendezvous: dict, *, total_bytes: int = 0, tensors: int = 0) -> None:
        """vLLM's `init_weight_transfer_engine` joins the group (the `omrl_nccl` engine in every worker),
        then `start_weight_update` opens the session that receives into the spool, or with
        `weight_staging: memory` into the first worker's host arena (the model is untouched until the
        staged set is loaded)."""
        from vllm.distributed.weight_transfer.base import WeightTransferInitRequest

        from services.weightsync.nccl.staging import HostArena

        if self._nccl_group != rendezvous["group"]:
            if self._nccl_group is not None:
                await self.engine.shutdown_weight_transfer_engine()
            self._nccl_group = None
            await self.engine.init_weight_transfer_engine(WeightTransferInitRequest(init_info=dict(rendezvous)))
            self._nccl_group = rendezvous["group"]
        await self.engine.start_weight_update()
        opened = {"kind": "open", "path": "", "offset": 0, "names": [], "dtype_names": [], "shapes": [], "sizes": []}
        opened.update(staging=self.weight_staging, staging_bytes=HostArena.span(total_bytes, tensors))
        await self.receive_nccl_bucket(opened)

    async def receive_nccl_bucket(self, info: dict) -> None:
        from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

        await self.engine.update_weights(WeightTransferUpdateRequest(update_info=info))

    async def flush_nccl_bucket(self, digest: str = "") -> None:
        flush = {"kind": "flush", "path": "", "offset": 0, "names": [], "dtype_names": [], "shapes": [], "sizes": []}
        flush["previous_digest"] = digest
        await self.receive_nccl_bucket(flush)

    async def end_nccl_push(self, ok: bool) -> None:
        try:
            await self.engine.finish_weight_update()
        except Exception:  # noqa: BLE001 - a failed receive already closed the worker's session
            if ok:
                raise
        if not ok and self._nccl_group is not None:
            self._nccl_group = None
            await self.engine.shutdown_weight_transfer_engine()

    async def check_alive(self) -> None:
        # EngineDeadError once the engine core process is gone or its output loop has failed
        await self.engine.check_health()

    async def shutdown(self) -> None:
        engine, self._engine = self._engine, None
        if engine is not None:
            engine.shutdown()
            vllm_envs.disable_envs_cache()  # an engine started later in this process reads the settings afresh

    def describe(self) -> dict[str, Any]:
        return {
            "backend": self.name,
            "model": self.model,
            "dtype": self.dtype,
            "max_model_len": self.max_model_len,
            "logprobs_mode": self.logprobs_mode,
            "gpus": self.gpus,
            "engine_args": self.engine_args,
            "vllm_version": VLLM_VERSION,
        }
