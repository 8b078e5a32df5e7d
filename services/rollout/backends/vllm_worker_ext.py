"""Methods mixed into every vLLM worker (`worker_extension_cls`); the engine calls them through
`collective_rpc`. They run inside the worker process, where `self` is vLLM's worker.

Kept in its own module so the worker process imports only this and vLLM, not the backend.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch

from services.rollout.backends.vllm_idle import shorten_spin_from_env

shorten_spin_from_env()  # vLLM imports this module in the worker before it makes the worker's message queues


def refresh_output_heads(model: torch.nn.Module, probe_rows: int = 4, atol: float = 1e-4) -> list[str]:
    """Re-derives the packed GEMM of every embedding-method layer used as a linear (the lm_head) from
    its current `weight`, then checks that the packed path computes `x @ weight.T`.

    vLLM's CPU backend computes lm_head logits with a packed copy of the weight (`cpu_linear`), made
    once in `process_weights_after_loading`. When the head is tied to the embedding, `reload_weights`
    only processes `embed_tokens` and the head keeps the old packed copy: the engine then samples from
    the old head without any error. Re-running the processing (it keeps the weight, packs a fresh copy)
    is cheap and idempotent, so it is done for every such layer, tied or not.
    """
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

    refreshed = []
    for name, module in model.named_modules():
        method = getattr(module, "quant_method", None)
        if not isinstance(method, UnquantizedEmbeddingMethod) or not hasattr(module, "cpu_linear"):
            continue
        method.process_weights_after_loading(module)
        weight = module.weight
        if weight.numel() == 0 or weight.is_meta:
            raise RuntimeError(f"{name}: output head has no weight after reload")
        gen = torch.Generator(device="cpu").manual_seed(0)
        x = torch.randn(probe_rows, weight.shape[1], generator=gen, dtype=torch.float32).to(weight.dtype)
        with torch.no_grad():
            packed = method.apply(module, x).float()
            plain = torch.nn.functional.linear(x, weight).float()
        err = (packed - plain).abs().max().item()
        tol = atol if weight.dtype == torch.float32 else 1e-2 * max(1.0, plain.abs().max().item())
        if not err <= tol:
            raise RuntimeError(f"{name}: packed output head differs from its weight by {err:.3g} after reload")
        refreshed.append(name)
    return refreshed


def pack_tensor(name: str, t: torch.Tensor) -> tuple[str, str, list[int], bytes]:
    """(name, dtype, shape, raw bytes): what crosses `collective_rpc`. Its msgpack decoder has no
    type hints for RPC arguments, so a torch.Tensor sent as is arrives as a plain list."""
    t = t.detach().to("cpu").contiguous()
    raw = t.reshape(-1).view(torch.uint8).numpy().tobytes()
    return name, str(t.dtype).removeprefix("torch."), list(t.shape), raw


def unpack_tensor(dtype: str, shape: Sequence[int], raw: bytes) -> torch.Tensor:
    flat = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    return flat.view(getattr(torch, dtype)).reshape(tuple(shape))


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

        from services.common.weight_spool import mapped_bucket
        from services.common.weights import TensorSpec

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
    from services.rollout.backends import vllm_dist_engine, vllm_spool_engine

    vllm_spool_engine.register()
    vllm_dist_engine.register()


_register_weight_transfer_engine()  # in the worker, before it builds its weight-transfer engine
