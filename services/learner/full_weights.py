"""The model's full (unsharded) weights out of its FSDP shards, by the model's own (Hugging Face) names: all at
once on CPU (`full_state_dict`: full checkpoints, the Hugging Face export) or tensor by tensor as a weight push
reads them (`streamed_weights`; `walk_for_push` on the ranks that do not send). Collective: every rank makes the
same calls in the same order."""

from __future__ import annotations

import torch
from torch import nn


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The unsharded weights on CPU, by the model's own (Hugging Face) names. Collective: every rank
    calls it; rank 0 gets the tensors, the others an empty dict."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def streamed_weights(model: nn.Module, dtype: torch.dtype):
    """The model's full weights as a `weightsync.buckets.TensorWeights` sent as `dtype`: names and global shapes
    from the sharded state dict (no communication), each tensor gathered (`full_tensor`, a collective) when
    its bucket is built. A float tensor is yielded as stored (the specs say `dtype`: it is cast where its
    bucket is packed, no cast and allocation a tensor here); any other is cast here. Where no tensor needs
    a gather or a cast (one process), the set's tensors are its `stable_tensors`. Every rank must walk each
    pass in the same order: rank 0 sends it, the others walk it with `walk_for_push`."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from services.weightsync.buckets import TensorWeights
    from services.weightsync.wire import TensorSpec

    sharded = get_model_state_dict(model, options=StateDictOptions(full_state_dict=False))
    size = torch.empty(0, dtype=dtype).element_size()
    specs = [
        TensorSpec(name, str(dtype).removeprefix("torch."), tuple(t.shape), t.numel() * size)
        for name, t in sharded.items()
    ]

    local = _local_views(sharded)

    def gathered():
        for name, t in sharded.items():
            full = local.get(name)
            if full is None:
                full = _whole(t)
            # kept on the learner's device: the gRPC producer copies each tensor to its host bucket, the
            # nccl one packs device buckets
            yield name, _as_sent(full.detach(), dtype)

    stable = list(local.values()) if len(local) == len(sharded) else None
    if stable is not None and any(_as_sent(t, dtype) is not t for t in stable):
        stable = None
    return TensorWeights(specs, gathered, stable)


def _as_sent(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`t` as a source yields it for a set sent as `dtype`: a float tensor as stored, any other cast."""
    return t if t.is_floating_point() or t.dtype == dtype else t.to(dtype)


def _whole(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's full value: gathered over its mesh, or, on a mesh of one process, its local tensor
    as it is (a gather there costs a collective call and a copy per tensor for nothing)."""
    if not hasattr(t, "full_tensor"):
        return t
    if t.device_mesh.size() == 1:
        local = t.to_local()
        if local.shape == t.shape:
            return local
    return t.full_tensor()


def _local_views(sharded: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The tensors of `sharded` that need no gather, found once per weight set rather than on every
    pass: plain tensors, and DTensors on a mesh of one process whose local tensor is the whole (their
    local tensor, read without `to_local`'s autograd call: tens of microseconds a tensor, which on a
    0.5B model's 290 tensors outweighed the transfer). Each mesh's size is asked once."""
    sizes: dict[int, int] = {}
    out = {}
    for name, t in sharded.items():
        if not hasattr(t, "full_tensor"):
            out[name] = t
            continue
        mesh = t.device_mesh
        if id(mesh) not in sizes:
            sizes[id(mesh)] = mesh.size()
        local = getattr(t, "_local_tensor", None)
        if sizes[id(mesh)] == 1 and local is not None and local.shape == t.shape:
            out[name] = local
    return out


def walk_for_push(weights) -> None:
    """A non-sending rank's part of a push: the same gathers as rank 0, in the same order."""
    for _ in weights.named_tensors():
        pass
