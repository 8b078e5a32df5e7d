"""Process group, FSDP2 sharding and full state dicts. The only module of the learner that knows about
distribution; without torchrun everything runs as a world of one."""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist
from torch import nn


def resolve_device(name: str = "auto") -> torch.device:
    """`auto` picks CUDA when present; on CUDA each process takes the GPU of its LOCAL_RANK."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
        return device
    return torch.device(name)


def init_distributed(device: torch.device | str) -> tuple[int, int]:
    """Joins the torchrun world (RANK/WORLD_SIZE/MASTER_* env vars), or else makes a world of one on an
    in-process store. gloo on CPU, nccl on CUDA. Idempotent; returns (rank, world_size)."""
    if not dist.is_initialized():
        device = torch.device(device)
        cuda = device.type == "cuda"
        kw: dict[str, Any] = {"backend": "nccl" if cuda else "gloo", "device_id": device if cuda else None}
        if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
            dist.init_process_group(**kw)
        else:
            dist.init_process_group(**kw, store=dist.HashStore(), rank=0, world_size=1)
    return dist.get_rank(), dist.get_world_size()


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def is_rank0() -> bool:
    return rank() == 0


def barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def broadcast_object(obj: Any, src: int = 0) -> Any:
    """Every rank gets rank `src`'s object (picklable)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def all_gather_object(obj: Any) -> list[Any]:
    """Every rank's object, in rank order, on every rank."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def all_reduce_sum(tensor: torch.Tensor) -> torch.Tensor:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks, found through Hugging Face's `_no_split_modules`."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    layers = [m for m in model.modules() if type(m).__name__ in names]
    if not layers:
        raise ValueError(f"{type(model).__name__}: no decoder layers found (no _no_split_modules)")
    return layers


TOKEN_STATS_METHOD = "token_stats"
"""The policy's extra FSDP forward method (`services.learner.model` attaches it); named here so that sharding
a plain model imports nothing of the learner's model code (bench/weight_sync_gpu.py runs without it)."""


WRAPS = ("auto", "layers", "root")
ONE_UNIT = "_omrl_one_fsdp_unit"


def resolve_wrap(wrap: str = "auto") -> str:
    """`auto`: `root` on one process (sharding per layer saves no memory there), `layers` otherwise."""
    if wrap not in WRAPS:
        raise ValueError(f"unknown FSDP wrap {wrap!r}: one of {WRAPS}")
    if wrap == "auto":
        return "root" if world_size() == 1 else "layers"
    return wrap


def shard_model(
    model: nn.Module, device: torch.device, mixed_precision_bf16: bool = False, wrap: str = "layers"
) -> nn.Module:
    """FSDP2. `wrap` (`resolve_wrap`): `layers`, `fully_shard` on each decoder layer, then on the root
    (embeddings and head), each layer gathered before it runs and freed after it; `root`, one unit for the
    whole model, gathered once a forward pass and kept until its backward pass is done (no per-layer hooks,
    one all-gather and bf16 cast of the weights a micro-batch instead of two a layer; `set_last_micro_batch`).
    Moves the model to `device`; bf16 compute with fp32 gradient reduction only on CUDA and when asked."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method

    mesh = init_device_mesh(device.type, (world_size(),))
    mp = MixedPrecisionPolicy()
    if mixed_precision_bf16 and device.type == "cuda":
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    model.to(device)
    if resolve_wrap(wrap) == "root":
        fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=False)
        setattr(model, ONE_UNIT, True)
    else:
        for layer in decoder_layers(model):
            fully_shard(layer, mesh=mesh, mp_policy=mp)
        fully_shard(model, mesh=mesh, mp_policy=mp)
    if hasattr(model, TOKEN_STATS_METHOD):  # it runs the root's layers and head outside `forward`
        register_fsdp_forward_method(model, TOKEN_STATS_METHOD)
    return model


def set_last_micro_batch(model: nn.Module, last: bool) -> None:
    """Called before each micro-batch's backward pass. With one FSDP unit (`root`) on one process, the gathered
    bf16 weights stay from one micro-batch's backward pass to the next one's forward pass instead of being freed,
    gathered and cast again, and the gradient accumulates unsharded and is reduced once, after the last
    micro-batch: there the unsharded weights and gradient are what the unit holds anyway. Per-layer units and
    several processes free and reduce after every micro-batch (keeping would hold the whole model's weights and
    gradients on every rank)."""
    if not getattr(model, ONE_UNIT, False) or world_size() != 1:
        return
    model.set_reshard_after_backward(last)
    model.set_requires_gradient_sync(last)


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The unsharded weights on CPU, by the model's own (Hugging Face) names. Collective: every rank
    calls it; rank 0 gets the tensors, the others an empty dict."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def streamed_weights(model: nn.Module, dtype: torch.dtype):
    """The model's full weights as a `weight_buckets.TensorWeights` sent as `dtype`: names and global shapes
    from the sharded state dict (no communication), each tensor gathered (`full_tensor`, a collective) when
    its bucket is built. A float tensor is yielded as stored (the specs say `dtype`: it is cast where its
    bucket is packed, no cast and allocation a tensor here); any other is cast here. Where no tensor needs
    a gather or a cast (one process), the set's tensors are its `stable_tensors`. Every rank must walk each
    pass in the same order: rank 0 sends it, the others walk it with `walk_for_push`."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from services.common.weight_buckets import TensorWeights
    from services.common.weights import TensorSpec

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
