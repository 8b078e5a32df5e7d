"""The critic for GAE: a separate value model (the policy's trunk and initial weights, a scalar head),
FSDP-sharded, with its own AdamW and learning-rate schedule, trained on the clipped value loss."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from services.common.config import TrainConfig
from services.learner import collectives
from services.learner.losses import value_loss
from services.learner.model import load_value_model, token_values
from services.learner.parallelize import parallelize
from services.learner.schedule import build_optimizer, build_scheduler
from services.learner.sequence_parallel import SequenceGroup


class Critic:
    def __init__(
        self,
        config: TrainConfig,
        model_path: str,
        device: torch.device,
        dtype: str,
        mixed: bool,
        sequence_group: SequenceGroup | None = None,
    ):
        algo = config.algorithm
        self.config = config
        self.pack = config.learner.pack_sequences
        self.model = load_value_model(model_path, dtype, config.learner.attention, split=sequence_group is not None)
        parallelize(
            self.model,
            device,
            mixed_precision_bf16=mixed,
            activation_checkpointing=config.learner.activation_checkpointing,
            compile_layers=config.learner.compile,
            wrap=config.learner.fsdp_wrap,
            compile_scope=config.learner.compile_scope,
            sequence_group=sequence_group,
        )
        self.optimizer = build_optimizer(self.model, algo.critic_lr, algo.weight_decay, config.learner.fused_optimizer)
        self.scheduler = build_scheduler(self.optimizer, algo, config.learner.steps)

    @torch.no_grad()
    def values(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return token_values(self.model, input_ids, attention_mask, self.pack)

    def update(
        self, minis: Sequence[tuple[Sequence[Any], dict[str, float]]], sums: dict[str, torch.Tensor]
    ) -> list[float]:
        """`ppo_epochs` passes over the mini-batches, each (micro-batches with .batch, .values, .returns; its
        num_tokens and num_seqs) one optimizer step; accumulates vf_loss and per-token stats into `sums`;
        returns the gradient norm of each optimizer step. The schedule advances once."""
        algo, world = self.config.algorithm, collectives.world_size()
        norms = []
        for _ in range(algo.ppo_epochs):
            for micro, norm in minis:
                self.optimizer.zero_grad(set_to_none=True)
                for m in micro:
                    mask = m.batch.response_mask
                    v = token_values(self.model, m.batch.input_ids, m.batch.attention_mask, self.pack)
                    loss, stats = value_loss(v, m.values, m.returns, mask, algo.value_clip, algo.loss_agg_mode, **norm)
                    (loss * world).backward()
                    n = mask.sum()
                    sums["vf_loss"] += loss.detach()
                    sums["vf_clip_frac"] += stats["vf_clip_frac"] * n
                total = torch.nn.utils.clip_grad_norm_(self.model.parameters(), algo.grad_clip)
                total = float(total.full_tensor() if hasattr(total, "full_tensor") else total)
                norms.append(total)
                if math.isfinite(total):
                    self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        return norms
