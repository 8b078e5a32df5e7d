"""Scale code beside the model (torchtitan's parallelize): activation checkpointing, then compile, then
FSDP, in that order, applied per decoder layer, so `model.py` stays single-device code. None of these
renames a parameter: checkpoints and weight pushes keep the Hugging Face names."""

from __future__ import annotations

import functools

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from services.learner import fsdp
from services.learner.model import compile_head

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
) -> nn.Module:
    """Applies the levers to `model` in place and returns it sharded on `device`. `compile_layers` also
    compiles the fused logprob head's elementwise kernels; `wrap`: FSDP's units (`fsdp.shard_model`);
    `compile_scope`: `layers`, each decoder layer its own compiled graph (FSDP's per-layer hooks stay outside
    the graphs, and identical layers reuse one), or `decoder`, the whole decoder stack (embeddings, rotary
    tables, every layer, final norm) one graph, so kernels fuse across layer boundaries; needs `root` units."""
    if compile_scope not in COMPILE_SCOPES:
        raise ValueError(f"unknown compile scope {compile_scope!r}: one of {COMPILE_SCOPES}")
    whole = compile_layers and compile_scope == "decoder"
    if whole and fsdp.resolve_wrap(wrap) != "root":
        raise ValueError("learner.compile_scope 'decoder' needs one FSDP unit (learner.fsdp_wrap root)")
    for layer in fsdp.decoder_layers(model):
        if activation_checkpointing:
            checkpoint_activations(layer)
        if compile_layers and not whole:
            layer.compile()
    if whole:
        model.base_model.compile()
    if compile_layers:
        compile_head(model)
    return fsdp.shard_model(model, device, mixed_precision_bf16=mixed_precision_bf16, wrap=wrap)


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
