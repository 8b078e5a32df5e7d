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


def parallelize(
    model: nn.Module,
    device: torch.device,
    *,
    mixed_precision_bf16: bool = False,
    activation_checkpointing: bool = False,
    compile_layers: bool = False,
) -> nn.Module:
    """Applies the levers to `model` in place and returns it sharded on `device`. `compile_layers` also
    compiles the fused logprob head's elementwise kernels."""
    for layer in fsdp.decoder_layers(model):
        if activation_checkpointing:
            checkpoint_activations(layer)
        if compile_layers:
            # per layer, not the whole model: FSDP's hooks between layers stay outside the compiled graphs,
            # and identical layers reuse one compiled graph
            layer.compile()
    if compile_layers:
        compile_head(model)
    return fsdp.shard_model(model, device, mixed_precision_bf16=mixed_precision_bf16)


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
