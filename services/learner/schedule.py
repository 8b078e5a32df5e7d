"""The optimizer and its learning-rate schedule: AdamW; linear warm-up, then constant or cosine decay over the
run's steps."""

from __future__ import annotations

import math

import torch

from services.common.config import AlgorithmConfig


def build_optimizer(model: torch.nn.Module, lr: float, weight_decay: float, fused: bool = False) -> torch.optim.AdamW:
    """AdamW over the (sharded) parameters; `fused`: torch's single-kernel implementation instead of foreach."""
    return torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay, fused=fused or None)


def lr_factor(step: int, algo: AlgorithmConfig, total_steps: int) -> float:
    """Multiplier of the base learning rate at 0-based optimizer step `step` (one per learner step).

    Warm-up: (step + 1) / warmup, so the first step already moves. Cosine: from 1 at the end of warm-up
    to min_lr_ratio at `total_steps`."""
    warmup = algo.lr_warmup_steps
    if step < warmup:
        return (step + 1) / warmup
    if algo.lr_schedule == "constant":
        return 1.0
    progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
    return algo.min_lr_ratio + (1.0 - algo.min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def build_scheduler(
    optimizer: torch.optim.Optimizer, algo: AlgorithmConfig, total_steps: int
) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, algo, total_steps))


def restore_scheduler(scheduler: torch.optim.lr_scheduler.LambdaLR, state: dict, base_lr: float) -> None:
    """Loads the position from a checkpoint; the base rate comes from the current config."""
    scheduler.load_state_dict(state)
    scheduler.base_lrs = [base_lr for _ in scheduler.base_lrs]
    for group, base, fn in zip(scheduler.optimizer.param_groups, scheduler.base_lrs, scheduler.lr_lambdas):
        group["lr"] = base * fn(scheduler.last_epoch)
    scheduler._last_lr = [g["lr"] for g in scheduler.optimizer.param_groups]
