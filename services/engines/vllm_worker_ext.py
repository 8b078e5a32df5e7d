"""Methods mixed into every vLLM worker (`worker_extension_cls`); the engine calls them through
`collective_rpc`. They run inside the worker process, where `self` is vLLM's worker.

Kept in its own module so the worker process imports only this and vLLM, not the backend. Importing it
registers the weight-transfer engines (`vllm_spool_engine`, `vllm_nccl_engine`); those and this module share
their helpers through `vllm_weights`, which imports none of them (no import cycle among the vLLM modules).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch

from services.engines.vllm_idle import shorten_spin_from_env
from services.engines.vllm_start import bind_forked_worker
from services.engines.vllm_weights import refresh_output_heads, unpack_tensor

shorten_spin_from_env()  # vLLM imports this module in the worker before it makes the worker's message queues
bind_forked_worker()  # and before the worker binds its threads (init_device) or computes


class WeightReloadExtension:
    """Worker extension: in-place weight reload by Hugging Face parameter names."""

    def reload_named_tensors(self, packed: Sequence[Sequence[Any]]) -> dict[str, Any]:
        """Loads `[pack_tensor(hf_name, tensor), ...]` into the running model, then refreshes the
        packed output heads.

        Not named `update_weights`: that is the worker's own weight-transfer method.
        """
        pairs: Iterable[tuple[str, torch.Tensor]] = (
            (str(name), unpack_tensor(dtype, shape, raw)) for name, dtype, shape, raw in packed
        )
        # reload_weights (not model.load_weights): it re-runs per-layer post-load processing, which
        # the CPU backend needs because it repacks linear weights into kernel layouts after loading.
        self.reload_weights(weights_iterator=pairs)  # type: ignore[attr-defined]
        heads = refresh_output_heads(self.model_runner.get_model())  # type: ignore[attr-defined]
        return {"refreshed_heads": heads}

    def reload_spool_timed(self, buckets: Sequence[dict]) -> float:
        """vLLM's own `reload_weights` over the tensors of spooled buckets (`SpooledBucket.to_info`),
        timed inside the worker: the reference bench/weight_sync.py compares a push against."""
        import time

        from services.weightsync.spool import mapped_bucket
        from services.weightsync.wire import TensorSpec

        def pairs():
            for b in buckets:
                specs = [TensorSpec(*spec) for spec in zip(b["names"], b["dtype_names"], b["shapes"], b["sizes"])]
                with mapped_bucket(b["path"], b["offset"], specs) as tensors:
                    yield from tensors

        start = time.perf_counter()
        self.reload_weights(weights_iterator=pairs())  # type: ignore[attr-defined]
        refresh_output_heads(self.model_runner.get_model())  # type: ignore[attr-defined]
        return time.perf_counter() - start


def _register_weight_transfer_engine() -> None:
    from services.engines import vllm_nccl_engine, vllm_spool_engine

    vllm_spool_engine.register()
    vllm_nccl_engine.register()


_register_weight_transfer_engine()  # in the worker, before it builds its weight-transfer engine
