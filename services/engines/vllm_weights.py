"""Weight helpers every vLLM module of the backend shares (the backend in the server process, the worker
extension and the weight-transfer engines in the workers): the re-derivation of packed output heads after a
reload, and a tensor's form across `collective_rpc`. A leaf module: it imports no other vLLM module of ours,
so `vllm`, `vllm_worker_ext`, `vllm_spool_engine` and `vllm_nccl_engine` import it without a cycle."""

from __future__ import annotations

from collections.abc import Sequence

import torch


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
