"""One policy update per call: trajectories in, metrics out. Collective: every rank constructs the trainer
and calls each public method with the same arguments (same trajectories, same order)."""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

import torch

from services.common.config import TrainConfig
from services.common.trajectory import Trajectory
from services.learner import checkpoint, fsdp
from services.learner.advantages import build_estimator
from services.learner.batch import TrainBatch, collate
from services.learner.losses import k3_kl, policy_loss
from services.learner.model import DTYPES, load_model, token_logprobs, token_logprobs_and_entropy


_SUMS = ("mismatch_kl", "entropy", "loss", "clip_frac", "approx_kl", "ratio_mean", "update_tokens")


@dataclass
class _Micro:
    batch: TrainBatch
    advantages: torch.Tensor
    old_logprobs: Optional[torch.Tensor] = None


class PolicyTrainer:
    """FSDP-sharded policy, AdamW, and the PPO/GRPO update. `step` counts completed `train_step` calls;
    `policy_version` is the version of the weights the model holds, set by the caller. Checkpoints carry both."""

    latest_checkpoint = staticmethod(checkpoint.latest_checkpoint)

    def __init__(self, config: TrainConfig, model_path: str):
        self.config = config
        self.device = fsdp.resolve_device(config.learner.device)
        self.rank, self.world_size = fsdp.init_distributed(self.device)
        torch.manual_seed(config.seed)
        mixed = config.model.dtype != "float32" and self.device.type == "cuda"
        self.model = load_model(model_path, "float32" if mixed else config.model.dtype)
        self.pad_id = int(self.model.config.pad_token_id or 0)
        fsdp.shard_model(self.model, self.device, mixed_precision_bf16=mixed)
        algo = config.algorithm
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=algo.lr, weight_decay=algo.weight_decay)
        self.estimator = build_estimator(algo)
        if self.estimator.needs_values:
            raise NotImplementedError(f"advantage {algo.advantage!r} needs a critic, which the learner lacks")
        self.step = 0
        self.policy_version = 0

    def _local_micro_batches(self, batch: TrainBatch, advantages: torch.Tensor) -> list[_Micro]:
        """This rank's share of the sequences in micro-batches, topped up with empty (mask 0) micro-batches
        so that every rank runs the same number of forward/backward passes (FSDP's collectives)."""
        size = self.config.algorithm.micro_batch_size
        shares = torch.arange(batch.size).tensor_split(self.world_size)
        n_micro = math.ceil(len(shares[0]) / size)
        mine = shares[self.rank]
        out = []
        for chunk in mine.split(size):
            mb = batch.select(chunk).trim()
            out.append(_Micro(mb.to(self.device), advantages[chunk, :mb.input_ids.shape[1]].to(self.device)))
        while len(out) < n_micro:
            mb = batch.select(slice(0, 1)).trim()
            mb.response_mask = torch.zeros_like(mb.response_mask)
            out.append(_Micro(mb.to(self.device), torch.zeros_like(mb.response_mask).to(self.device)))
        return out

    def train_step(self, trajectories: Sequence[Trajectory]) -> dict[str, float]:
        algo, reward = self.config.algorithm, self.config.reward
        batch = collate(trajectories, self.pad_id, allocation=reward.allocation, gamma=reward.gamma)
        advantages = self.estimator.compute(batch.token_rewards, batch.response_mask, batch.group_index,
                                            gamma=reward.gamma)
        num_tokens = batch.response_mask.sum().item()
        num_seqs = (batch.response_mask.sum(-1) > 0).sum().item()
        micro = self._local_micro_batches(batch, advantages)

        sums = {key: torch.zeros((), dtype=torch.float64, device=self.device) for key in _SUMS}
        with torch.no_grad():
            for m in micro:
                lp, ent = token_logprobs_and_entropy(self.model, m.batch.input_ids, m.batch.attention_mask)
                m.old_logprobs = lp
                mask = m.batch.response_mask
                sums["mismatch_kl"] += (k3_kl(lp, m.batch.rollout_logprobs) * mask).sum()
                sums["entropy"] += (ent * mask).sum()

        grad_norms, skipped = [], 0
        for _ in range(algo.ppo_epochs):
            self.optimizer.zero_grad(set_to_none=True)
            for m in micro:
                lp = token_logprobs(self.model, m.batch.input_ids, m.batch.attention_mask)
                loss, stats = policy_loss(lp, m.old_logprobs, m.advantages, m.batch.response_mask,
                                          algo.clip_ratio_low, algo.clip_ratio_high, algo.loss_agg_mode,
                                          num_tokens=max(num_tokens, 1.0), num_seqs=max(num_seqs, 1.0))
                # FSDP averages gradients over ranks; the partial losses already sum to the batch loss.
                (loss * self.world_size).backward()
                n = m.batch.response_mask.sum()
                sums["loss"] += loss.detach()
                for key in ("clip_frac", "approx_kl", "ratio_mean"):
                    sums[key] += stats[key] * n
                sums["update_tokens"] += n
            norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), algo.grad_clip)
            norm = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
            grad_norms.append(norm)
            if math.isfinite(norm):
                self.optimizer.step()
            else:
                skipped += 1
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        totals = fsdp.all_reduce_sum(torch.stack([sums[key] for key in _SUMS])).tolist()
        return self._metrics(batch, dict(zip(_SUMS, totals)), grad_norms, skipped)

    def _metrics(self, batch: TrainBatch, s: dict[str, float], grad_norms: list[float], skipped: int
                 ) -> dict[str, float]:
        epochs = self.config.algorithm.ppo_epochs
        tokens = max(batch.response_mask.sum().item(), 1.0)
        update_tokens = max(s["update_tokens"], 1.0)
        versions = batch.policy_versions[batch.response_mask > 0]
        return {
            "loss": s["loss"] / epochs,
            "pg_loss": s["loss"] / epochs,
            "clip_frac": s["clip_frac"] / update_tokens,
            "approx_kl": s["approx_kl"] / update_tokens,
            "ratio_mean": s["ratio_mean"] / update_tokens,
            "grad_norm": grad_norms[-1],
            "skipped_updates": float(skipped),
            "mismatch_kl": s["mismatch_kl"] / tokens,
            "entropy": s["entropy"] / tokens,
            "reward_mean": batch.rewards.mean().item(),
            "success_rate": batch.success.mean().item(),
            "response_len_mean": batch.response_mask.sum(-1).mean().item(),
            "num_trajectories": float(batch.size),
            "num_tokens": batch.response_mask.sum().item(),
            "policy_version_min": float(versions.min()) if versions.numel() else 0.0,
            "policy_version_max": float(versions.max()) if versions.numel() else 0.0,
        }

    def named_weights_for_push(self) -> list[tuple[str, torch.Tensor]]:
        """Full weights by Hugging Face name, on CPU, in the configured model dtype. Collective; rank 0 gets
        the list, the other ranks an empty one."""
        dtype = DTYPES[self.config.model.dtype]
        return [(name, t.to(dtype)) for name, t in fsdp.full_state_dict(self.model).items()]

    def save_checkpoint(self, directory: str | Path, extra: Optional[dict[str, Any]] = None) -> Path:
        """Collective. Writes `<directory>/step_<step>` and keeps the newest `keep_checkpoints` there.
        `extra` (JSON-serialisable, e.g. stream offsets) comes back from `load_checkpoint`."""
        path = checkpoint.checkpoint_path(directory, self.step)
        meta = {"step": self.step, "policy_version": self.policy_version, "extra": extra or {}}
        checkpoint.save(path, self.model, self.optimizer, meta, keep=self.config.learner.keep_checkpoints)
        return path

    def load_checkpoint(self, path: Path) -> dict[str, Any]:
        """Collective. Restores weights, optimizer state, RNG and `policy_version`; returns `extra`.
        Learning rate and weight decay come from the current config, not the checkpoint."""
        meta = checkpoint.load(path, self.model, self.optimizer)
        for group in self.optimizer.param_groups:
            group["lr"] = self.config.algorithm.lr
            group["weight_decay"] = self.config.algorithm.weight_decay
        self.step, self.policy_version = int(meta["step"]), int(meta["policy_version"])
        return meta["extra"]
