"""Scale code beside the model (torchtitan's parallelize): activation checkpointing, then compile, then
FSDP2 sharding (`shard_model`, its units chosen by `resolve_wrap`), in that order, applied per decoder layer,
so `model.py` stays single-device code. None of these renames a parameter: checkpoints and weight pushes keep
the Hugging Face names."""

from __future__ import annotations

import functools

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from services.learner import sequence_parallel
from services.learner.collectives import world_size
from services.learner.model import TOKEN_STATS_METHOD, compile_head
from services.learner.sequence_parallel import SequenceGroup

COMPILE_SCOPES = ("layers", "decoder")


def parallelize(
    model: nn.Module,
    device: torch.device,
    *,
    mixed_precision_bf16: bool = False,
    activation_checkpointing: bool = False,
    compile_layers: bool = False,
    wrap: str = "layers",
    compile_scope: str = "layers",
    sequence_group: SequenceGroup | None = None,
) -> nn.Module:
    """Applies the levers to `model` in place and returns it sharded on `device`. `compile_layers` also
    compiles the fused logprob head's elementwise kernels; `wrap`: FSDP's units (`shard_model`);
    `compile_scope`: `layers`, each decoder layer its own compiled graph (FSDP's per-layer hooks stay outside
    the graphs, and identical layers reuse one), or `decoder`, the whole decoder stack (embeddings, rotary
    tables, every layer, final norm) one graph, so kernels fuse across layer boundaries; needs `root` units.
    `sequence_group`: the processes that split each packed row with this one (`sequence_parallel`; the model must
    have been loaded with its attention). FSDP shards over every process either way, so its gradient reduction
    sums the group's parts of each gradient."""
    if compile_scope not in COMPILE_SCOPES:
        raise ValueError(f"unknown compile scope {compile_scope!r}: one of {COMPILE_SCOPES}")
    whole = compile_layers and compile_scope == "decoder"
    if whole and resolve_wrap(wrap) != "root":
        raise ValueError("learner.compile_scope 'decoder' needs one FSDP unit (learner.fsdp_wrap root)")
    for layer in decoder_layers(model):
        if activation_checkpointing:
            checkpoint_activations(layer)
        if compile_layers and not whole:
            layer.compile()
    if whole:
        model.base_model.compile()
    if compile_layers:
        compile_head(model)
    sequence_parallel.attach(model, sequence_group)
    return shard_model(model, device, mixed_precision_bf16=mixed_precision_bf16, wrap=wrap)


def checkpoint_activations(layer: nn.Module) -> None:
    """The layer keeps only its inputs for the backward pass and recomputes its activations there.
    Patched on the instance's `forward` (not a wrapper module) so parameter names do not change; FSDP's
    hooks run around it, so the recompute sees the layer's gathered parameters."""
    original = layer.forward

    @functools.wraps(original)
    def forward(*args, **kwargs):
        if not torch.is_grad_enabled():
            return original(*args, **kwargs)
        return checkpoint(original, *args, use_reentrant=False, **kwargs)

    layer.forward = forward


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks, found through Hugging Face's `_no_split_modules`."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    layers = [m for m in model.modules() if type(m).__name__ in names]
    if not layers:
        raise ValueError(f"{type(model).__name__}: no decoder layers found (no _no_split_modules)")
    return layers


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
