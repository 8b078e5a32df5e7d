"""One policy update per call: trajectories in, metrics out. Collective: every rank constructs the trainer
and calls each public method with the same arguments (same trajectories, same order).

A step: collate the global batch; score it without gradients on this rank's share (old and reference
logprobs, critic values), gather those to every rank; KL penalty into the rewards (optional); advantages
on the whole batch; then `ppo_epochs` passes of the policy (and critic). A pass takes one optimizer step per
mini-batch (`ppo_mini_batch_size` consecutive sequences of the batch, in order; the whole batch by default),
its gradient accumulated over this rank's micro-batches of that mini-batch, its loss normalised by the
mini-batch's own token and sequence counts. The learning-rate schedule advances once per step.

With `learner.sequence_parallel` N > 1 the batch is split over the data ranks (world / N) instead of every
process; the N processes of a data rank run the same micro-batches, each a 1/N slice of every packed row, and
hold the same per-token values after each forward pass (`sequence_parallel`), so the batch-level sums and
gathers reduce over the data ranks only."""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from services.common.config import TrainConfig
from services.common.trajectory import Trajectory
from services.learner import checkpoint, collectives, full_weights, sequence_parallel
from services.learner.advantages import build_estimator
from services.learner.advantages.base import AdvantageInputs
from services.learner.batch import TrainBatch, baseline_scores, collate, split_baselines, turns_of
from services.learner.critic import Critic
from services.learner.determinism import use_deterministic_kernels
from services.learner.episodes import StepTokens
from services.learner.kl import build_kl_controller, kl_estimate
from services.learner.levers import longest_row
from services.learner.levers import resolve_for_device as resolve_levers
from services.learner.losses import aggregate, k3_kl, masked_mean
from services.learner.model import DTYPES, load_model, token_logprobs, token_logprobs_and_entropy
from services.learner.packing import token_budget_chunks
from services.learner.parallelize import parallelize, set_last_micro_batch
from services.learner.policy_losses import build_policy_loss
from services.learner.policy_losses.base import POLICY_STATS, PolicyLossInputs
from services.learner.prefix import Prefix, decoder_tokens, group_ordered, shared_prefixes
from services.learner.reference import ReferencePolicy
from services.learner.rollout_correction import SUMS as CORRECTION_SUMS
from services.learner.rollout_correction import RolloutCorrection
from services.learner.schedule import build_optimizer, build_scheduler, restore_scheduler

# per-token sums (divided by the token count in the metrics) and loss sums (already normalised)
_TOKEN_SUMS = (
    "mismatch_kl",
    "entropy",
    *POLICY_STATS,
    *CORRECTION_SUMS,
    "update_tokens",
    "kl_ref",
    "vf_clip_frac",
)
_LOSS_SUMS = ("loss", "pg_loss", "entropy_loss", "kl_loss", "vf_loss")
_SUMS = _TOKEN_SUMS + _LOSS_SUMS


class NonFiniteUpdate(FloatingPointError):
    """The first update of a step met a non-finite loss gradient; nothing was applied."""


@dataclass
class _Micro:
    batch: TrainBatch
    rows: torch.Tensor | None  # its rows in the global batch; None for a filler (all-masked) micro-batch
    old_logprobs: torch.Tensor | None = None
    ref_logprobs: torch.Tensor | None = None
    values: torch.Tensor | None = None
    is_weights: torch.Tensor | None = None
    loss_mask: torch.Tensor | None = None  # response mask less the rollout correction's rejections (None: none)
    advantages: torch.Tensor | None = None
    returns: torch.Tensor | None = None
    prefixes: list[Prefix] | None = None  # shared prompts of its rows (`learner.share_prefix`)


@dataclass
class _Mini:
    micro: list[_Micro]  # this rank's micro-batches of the mini-batch
    norm: dict[str, float]  # its global num_tokens, num_seqs and loss_scale_factor, the loss divisors
    policy_norm: dict[str, float] | None = None  # the policy's, when the rollout correction rejected tokens


class PolicyTrainer:
    """FSDP-sharded policy, AdamW with its schedule, and the PPO/GRPO-family update; a critic when the
    estimator needs values, a frozen reference when a KL term is on. `step` counts completed `train_step`
    calls; `policy_version` is the version of the weights the model holds, set by the caller.
    Checkpoints carry all of it."""

    latest_checkpoint = staticmethod(checkpoint.latest_checkpoint)

    def __init__(self, config: TrainConfig, model_path: str):
        self.device = collectives.resolve_device(config.learner.device)
        self.rank, self.world_size = collectives.init_distributed(self.device)
        config = self.config = resolve_levers(config, self.device, model_path, self.world_size)
        sp = config.learner.sequence_parallel
        if sp > 1:
            from transformers import AutoConfig

            sequence_parallel.check_world(self.world_size, sp)
            sequence_parallel.check_model(AutoConfig.from_pretrained(model_path), sp)
        self.mesh = sequence_parallel.build_mesh(self.device.type, self.world_size, self.rank, sp)
        """Data ranks split the batch; each is a group of `sequence_parallel` processes that split its rows."""
        group = self.mesh.sequence
        torch.manual_seed(config.seed)
        if config.deterministic:
            use_deterministic_kernels(self.device.type)
        algo = config.algorithm
        mixed = config.model.dtype != "float32" and self.device.type == "cuda"
        load_dtype = "float32" if mixed else config.model.dtype
        self.model_path = model_path
        self.max_row_tokens = longest_row(config, self.device, model_path, self.world_size)
        """The longest trajectory this GPU's memory trains (None: no estimate, on CPU); longer ones are poison."""
        self.pack = config.learner.pack_sequences
        learner = config.learner
        self.model = load_model(
            model_path,
            load_dtype,
            learner.attention,
            learner.logprob_head,
            learner.head_kernel,
            learner.head_keep_logits,
            split=group is not None,
        )
        self.pad_id = int(self.model.config.pad_token_id or 0)
        parallelize(
            self.model,
            self.device,
            mixed_precision_bf16=mixed,
            activation_checkpointing=config.learner.activation_checkpointing,
            compile_layers=config.learner.compile,
            wrap=config.learner.fsdp_wrap,
            compile_scope=config.learner.compile_scope,
            sequence_group=group,
        )
        self.optimizer = build_optimizer(self.model, algo.lr, algo.weight_decay, config.learner.fused_optimizer)
        self.scheduler = build_scheduler(self.optimizer, algo, config.learner.steps)
        self.estimator = build_estimator(algo)
        self.policy_loss = build_policy_loss(algo)
        self.correction = RolloutCorrection.from_config(algo)
        self.critic = None
        if self.estimator.needs_values:
            self.critic = Critic(config, model_path, self.device, load_dtype, mixed, sequence_group=group)
        self.reference = None
        if algo.use_kl_in_reward or algo.use_kl_loss:
            self.reference = ReferencePolicy(
                model_path,
                load_dtype,
                self.device,
                mixed,
                config.learner.logprob_chunk_tokens,
                pack=self.pack,
                attention=config.learner.attention,
                head=config.learner.logprob_head,
                wrap=config.learner.fsdp_wrap,
                head_kernel=config.learner.head_kernel,
                sequence_group=group,
            )
        self.kl_ctrl = build_kl_controller(algo.kl_ctrl, algo.kl_coef, algo.kl_target, algo.kl_horizon)
        self.step = 0
        self.policy_version = 0
        self.keeps_tokens = config.logging.episodes_per_step != 0
        self.step_tokens: StepTokens | None = None
        """The last update's per-token values, for the recorded episodes (`logging.episodes_per_step`)."""

    # -- batch layout ----------------------------------------------------------------------
    def _mini_batches(self, batch: TrainBatch) -> list[_Mini]:
        """Consecutive mini-batches of `ppo_mini_batch_size` sequences (0 or more than the batch: one)."""
        size = self.config.algorithm.ppo_mini_batch_size or batch.size
        scale = self.config.algorithm.loss_scale_factor
        out = []
        for rows in torch.arange(batch.size).split(max(size, 1)):
            mask = batch.response_mask[rows]
            norm = {"num_tokens": max(mask.sum().item(), 1.0), "num_seqs": max((mask.sum(-1) > 0).sum().item(), 1.0)}
            norm["loss_scale_factor"] = scale or max(mask.sum(-1).max().item(), 1.0)
            out.append(_Mini(self._local_micro_batches(batch, rows), norm))
        return out

    def _reject_from_divisors(self, minis: list[_Mini]) -> None:
        """With the rollout correction rejecting tokens, the policy's divisors count the kept tokens and
        sequences only (verl's modified response mask); the critic keeps `norm`. Collective."""
        counts = torch.zeros(len(minis), 2, dtype=torch.float64, device=self.device)
        for i, mini in enumerate(minis):
            for m in mini.micro:
                counts[i, 0] += m.loss_mask.sum()
                counts[i, 1] += (m.loss_mask.sum(-1) > 0).sum()
        for mini, (tokens, seqs) in zip(minis, self._reduce(counts).tolist()):
            mini.policy_norm = {**mini.norm, "num_tokens": max(tokens, 1.0), "num_seqs": max(seqs, 1.0)}

    def _local_micro_batches(self, batch: TrainBatch, rows: torch.Tensor) -> list[_Micro]:
        """This data rank's share of `rows` in micro-batches, topped up with empty (mask 0) micro-batches
        so that every rank runs the same number of forward/backward passes (FSDP's collectives)."""
        shares = rows.tensor_split(self.mesh.dp_size)
        chunks = [self._micro_rows(batch, share) for share in shares]
        n_micro = max(len(c) for c in chunks)
        # a share may be empty (a mini-batch smaller than the data ranks): then this rank runs fillers only
        mine = chunks[self.mesh.dp_rank]
        out = [self._micro(batch.select(chunk).trim().to(self.device), chunk) for chunk in mine]
        while len(out) < n_micro:
            mb = batch.select(slice(0, 1)).trim()
            mb.response_mask = torch.zeros_like(mb.response_mask)
            out.append(_Micro(mb.to(self.device), None))
        return out

    def _micro(self, mb: TrainBatch, rows: torch.Tensor) -> _Micro:
        prefixes = None
        if self.config.learner.share_prefix:
            prefixes = shared_prefixes(mb.input_ids, mb.attention_mask, mb.group_index)
        return _Micro(mb, rows, prefixes=prefixes)

    @staticmethod
    def _decoder_token_fraction(micro: list[_Micro]) -> float:
        """Token positions the policy's decoder ran over those of the padded micro-batches (1: nothing shared)."""
        padded = ran = 0
        for m in micro:
            if m.rows is not None:
                rows, width = m.batch.input_ids.shape
                padded += rows * width
                ran += decoder_tokens(width, rows, m.prefixes or [])
        return ran / max(padded, 1)

    def _micro_rows(self, batch: TrainBatch, share: torch.Tensor) -> list[torch.Tensor]:
        """A rank's share of rows in micro-batches: by `micro_batch_tokens` real tokens when set, else by
        `micro_batch_size` sequences. Every rank computes every share's split, so all agree on the count."""
        algo = self.config.algorithm
        if not len(share):
            return []
        if algo.micro_batch_tokens:
            lengths = batch.attention_mask[share].sum(-1).tolist()
            return [share[group] for group in token_budget_chunks(lengths, algo.micro_batch_tokens)]
        return list(share.split(algo.micro_batch_size))

    def _gather(self, micro: list[_Micro], field: str, shape: torch.Size) -> torch.Tensor:
        """The per-micro-batch tensors `field` of every data rank, as one [B, T] CPU tensor on every rank."""
        full = torch.zeros(shape, dtype=torch.float64, device=self.device)
        for m in micro:
            if m.rows is not None:
                local = getattr(m, field)
                full[m.rows.to(self.device), : local.shape[1]] = local.to(torch.float64)
        return self._reduce(full).to("cpu", torch.float32)

    def _reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum over the data ranks (the processes of a sequence group hold the same values)."""
        return collectives.all_reduce_sum(tensor, self.mesh.dp_group)

    # -- one step ---------------------------------------------------------------------------
    def _score(self, micro: list[_Micro], sums: dict[str, torch.Tensor], fused: bool = False) -> None:
        """Old (pre-update) logprobs (unless `fused`: the update pass takes them), reference logprobs, values
        and importance weights, without gradients."""
        chunk = self.config.learner.logprob_chunk_tokens
        with torch.no_grad():
            for m in micro:
                b = m.batch
                if self.reference is not None:
                    m.ref_logprobs = self.reference.logprobs(b.input_ids, b.attention_mask, m.prefixes)
                if self.critic is not None:
                    m.values = self.critic.values(b.input_ids, b.attention_mask)
                if not fused:
                    old, ent = token_logprobs_and_entropy(
                        self.model, b.input_ids, b.attention_mask, chunk, self.pack, m.prefixes
                    )
                    self._set_old_logprobs(m, old, ent, sums)

    def _set_old_logprobs(self, m: _Micro, old: torch.Tensor, ent: torch.Tensor, sums: dict[str, torch.Tensor]) -> None:
        """The pre-update logprobs of a micro-batch and what derives from them: rollout mismatch, entropy,
        KL to the reference, the rollout correction's importance weights and rejections."""
        b, mask = m.batch, m.batch.response_mask
        m.old_logprobs = old
        sums["mismatch_kl"] += (k3_kl(old, b.rollout_logprobs) * mask).sum()
        sums["entropy"] += (ent * mask).sum()
        if m.ref_logprobs is not None:
            sums["kl_ref"] += (kl_estimate(old, m.ref_logprobs, "low_var_kl") * mask).sum()
        if self.correction.enabled:
            fix = self.correction(old, b.rollout_logprobs, mask)
            m.is_weights, m.loss_mask = fix.weights, fix.keep
            for key, value in fix.sums.items():
                sums[key] += value

    def _fused_scoring(self, n_mini: int) -> bool:
        """Whether the update's own forward pass can give the pre-update logprobs: a single optimizer step (one
        epoch, one mini-batch) sees the weights that scoring would, and nothing needs the logprobs before it
        (KL in the reward does, and the divisors of a rollout correction that rejects). Saves one forward pass."""
        algo = self.config.algorithm
        single = algo.ppo_epochs == 1 and n_mini == 1 and not self.correction.rejects
        return self.config.learner.fuse_scoring and single and not algo.use_kl_in_reward

    def _kl_penalised_rewards(
        self, batch: TrainBatch, micro: list[_Micro], extra: dict[str, float], update_controller: bool = True
    ) -> torch.Tensor:
        """verl's apply_kl_penalty: r_t - beta * KL_t on model tokens; the controller then sees the batch's
        mean per-sequence KL."""
        algo, mask = self.config.algorithm, batch.response_mask
        old = self._gather(micro, "old_logprobs", mask.shape)
        ref = self._gather(micro, "ref_logprobs", mask.shape)
        kl = kl_estimate(old, ref, algo.kl_penalty) * mask
        beta = self.kl_ctrl.value
        current = masked_mean(kl, mask, dim=-1).mean().item()
        if update_controller:
            self.kl_ctrl.update(current, batch.size)
        extra.update(kl_in_reward=current, kl_coef=beta)
        return batch.token_rewards - beta * kl

    def train_step(self, trajectories: Sequence[Trajectory]) -> dict[str, float]:
        """One update. A failure before the first optimizer step (collate, scoring, advantages, the first
        pass's forward, backward and gradient norm; NonFiniteUpdate for a non-finite norm) leaves the
        trainer as it was, so the caller may retry on other trajectories."""
        kl_state = self.kl_ctrl.state_dict()
        try:
            return self._step(trajectories, dry_run=False)
        except BaseException:
            self.kl_ctrl.load_state_dict(kl_state)
            self.optimizer.zero_grad(set_to_none=True)
            raise

    def probe_step(self, trajectories: Sequence[Trajectory]) -> dict[str, float]:
        """Collective. The step's computation up to the first gradient norm, applying nothing: raises what
        `train_step` would raise on these trajectories alone (NonFiniteUpdate for a non-finite norm)."""
        try:
            return self._step(trajectories, dry_run=True)
        finally:
            self.optimizer.zero_grad(set_to_none=True)

    def _step(self, trajectories: Sequence[Trajectory], dry_run: bool) -> dict[str, float]:
        algo, reward = self.config.algorithm, self.config.reward
        trajectories, greedy = split_baselines(trajectories)
        if self.config.learner.share_prefix:
            trajectories = group_ordered(trajectories)
        batch = collate(trajectories, self.pad_id, allocation=reward.allocation, gamma=reward.gamma)
        baselines = None
        if self.estimator.needs_baseline:
            baselines = baseline_scores(trajectories, greedy, reward.allocation, reward.gamma)
        mask = batch.response_mask
        minis = self._mini_batches(batch)
        micro = [m for mini in minis for m in mini.micro]
        sums = {key: torch.zeros((), dtype=torch.float64, device=self.device) for key in _SUMS}
        extra: dict[str, float] = {"lr": self.optimizer.param_groups[0]["lr"]}

        start, cpu_start = time.perf_counter(), time.process_time()
        fused = self._fused_scoring(len(minis)) and not dry_run
        self._score(micro, sums, fused)
        if self.correction.rejects:
            self._reject_from_divisors(minis)
        token_rewards = batch.token_rewards
        if algo.use_kl_in_reward:
            token_rewards = self._kl_penalised_rewards(batch, micro, extra, update_controller=not dry_run)
        values = self._gather(micro, "values", mask.shape) if self.critic is not None else None
        turns = turns_of(trajectories) if self.estimator.needs_turns else None
        advantages, returns = self.estimator.advantages_and_returns(
            AdvantageInputs(
                token_rewards,
                mask,
                batch.group_index,
                values=values,
                gamma=algo.gamma,
                lam=algo.lam,
                turns=turns,
                baselines=baselines,
            )
        )
        for m in micro:
            width = m.batch.input_ids.shape[1]
            rows = m.rows if m.rows is not None else slice(0, 1)
            m.advantages = advantages[rows, :width].to(self.device)
            m.returns = returns[rows, :width].to(self.device)
        extra.update(
            advantage_mean=masked_mean(advantages, mask).item(),
            advantage_abs_mean=masked_mean(advantages.abs(), mask).item(),
            **self.estimator.step_metrics(),
        )
        scored = time.perf_counter()
        extra["time/score_s"] = scored - start  # these phases end in a host sync (gather, grad norm)

        grad_norms, skipped = self._update_policy(minis, sums, dry_run)
        if dry_run:
            return {"grad_norm": grad_norms[-1]}
        extra["time/policy_update_s"] = time.perf_counter() - scored
        extra["decoder_token_fraction"] = self._decoder_token_fraction(micro)
        if self.critic is not None:
            extra["critic_lr"] = self.critic.optimizer.param_groups[0]["lr"]
            updated = time.perf_counter()
            critic_norms = self.critic.update([(mini.micro, mini.norm) for mini in minis], sums)
            extra["time/critic_update_s"] = time.perf_counter() - updated
            extra.update(critic_grad_norm=critic_norms[-1], **self._value_stats(values, returns, mask))
        self.scheduler.step()
        self.step += 1
        if self.keeps_tokens:
            self.step_tokens = self._step_tokens(trajectories, micro, advantages, token_rewards, mask)
        extra["time/step_cpu_s"] = time.process_time() - cpu_start  # every thread of the process: load shows here
        totals = self._reduce(torch.stack([sums[key] for key in _SUMS])).tolist()
        return {**self._metrics(batch, dict(zip(_SUMS, totals)), grad_norms, skipped, len(minis)), **extra}

    def _step_tokens(
        self,
        trajectories: Sequence[Trajectory],
        micro: list[_Micro],
        advantages: torch.Tensor,
        token_rewards: torch.Tensor,
        mask: torch.Tensor,
    ) -> StepTokens:
        """Collective: what this update computed per token, for the recorded episodes."""
        loss_mask = self._gather(micro, "loss_mask", mask.shape) if self.correction.rejects else mask
        return StepTokens(
            trajectories=list(trajectories),
            learner_logprobs=self._gather(micro, "old_logprobs", mask.shape),
            advantages=advantages.float().cpu(),
            token_rewards=token_rewards.float().cpu(),
            loss_mask=loss_mask,
        )

    def _update_policy(
        self, minis: list[_Mini], sums: dict[str, torch.Tensor], dry_run: bool = False
    ) -> tuple[list[float], int]:
        """One optimizer step per mini-batch and epoch; returns each step's gradient norm and how many steps
        a non-finite norm skipped."""
        algo = self.config.algorithm
        grad_norms, skipped = [], 0
        for _ in range(1 if dry_run else algo.ppo_epochs):
            for mini in minis:
                norm_value = self._accumulate_policy_gradient(mini, sums)
                grad_norms.append(norm_value)
                if not math.isfinite(norm_value) and (len(grad_norms) == 1 or dry_run):  # nothing applied yet
                    raise NonFiniteUpdate(f"non-finite gradient norm {norm_value} (loss {float(sums['loss']):.4g})")
                if dry_run:
                    break
                if math.isfinite(norm_value):
                    self.optimizer.step()
                else:
                    skipped += 1
        self.optimizer.zero_grad(set_to_none=True)
        return grad_norms, skipped

    def _accumulate_policy_gradient(self, mini: _Mini, sums: dict[str, torch.Tensor]) -> float:
        """Forward and backward over the mini-batch's micro-batches; returns the clipped gradient's norm."""
        algo, chunk = self.config.algorithm, self.config.learner.logprob_chunk_tokens
        norm = mini.policy_norm or mini.norm
        self.optimizer.zero_grad(set_to_none=True)
        for i, m in enumerate(mini.micro):
            b, mask = m.batch, m.batch.response_mask
            scoring = m.old_logprobs is None  # fused scoring: this pass gives the pre-update logprobs
            if algo.entropy_coeff > 0 or scoring:
                lp, ent = token_logprobs_and_entropy(
                    self.model, b.input_ids, b.attention_mask, chunk, self.pack, m.prefixes
                )
            else:
                lp, ent = token_logprobs(self.model, b.input_ids, b.attention_mask, chunk, self.pack, m.prefixes), None
            if scoring:
                self._set_old_logprobs(m, lp.detach(), ent.detach(), sums)
                if algo.entropy_coeff <= 0:
                    ent = None
            mask = mask if m.loss_mask is None else m.loss_mask
            pg, stats = self.policy_loss(
                PolicyLossInputs(lp, m.old_logprobs, m.advantages, mask, is_weights=m.is_weights, **norm)
            )
            loss = pg
            if ent is not None:
                ent_loss = aggregate(ent, mask, algo.loss_agg_mode, **norm)
                loss = loss - algo.entropy_coeff * ent_loss
                sums["entropy_loss"] += ent_loss.detach()
            if algo.use_kl_loss:
                kl_loss = aggregate(
                    kl_estimate(lp, m.ref_logprobs, algo.kl_loss_type), mask, algo.loss_agg_mode, **norm
                )
                loss = loss + algo.kl_loss_coef * kl_loss
                sums["kl_loss"] += kl_loss.detach()
            # FSDP averages gradients over ranks; the partial losses already sum to the mini-batch loss. (With
            # sequence parallelism each process of a group holds its data rank's loss, and its backward pass reaches
            # the parameters through its own tokens only: the group's gradients sum to that loss's.)
            set_last_micro_batch(self.model, i == len(mini.micro) - 1)
            (loss * self.world_size).backward()
            n = mask.sum()
            sums["loss"] += loss.detach()
            sums["pg_loss"] += pg.detach()
            for key in POLICY_STATS:
                sums[key] += stats[key] * n
            sums["update_tokens"] += n
        norm_value = torch.nn.utils.clip_grad_norm_(self.model.parameters(), algo.grad_clip)
        return float(norm_value.full_tensor() if hasattr(norm_value, "full_tensor") else norm_value)

    @staticmethod
    def _value_stats(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
        m = mask > 0
        v, r = values[m].double(), returns[m].double()
        var_r = r.var(unbiased=False).item() if r.numel() > 1 else 0.0
        explained = 1.0 - (r - v).var(unbiased=False).item() / var_r if var_r > 0 else float("nan")
        return {
            "values_mean": v.mean().item() if v.numel() else 0.0,
            "returns_mean": r.mean().item() if r.numel() else 0.0,
            "vf_explained_var": explained,
        }

    def _metrics(
        self, batch: TrainBatch, s: dict[str, float], grad_norms: list[float], skipped: int, n_mini: int
    ) -> dict[str, float]:
        epochs = self.config.algorithm.ppo_epochs * n_mini  # loss sums hold one normalised loss per optimizer step
        tokens = max(batch.response_mask.sum().item(), 1.0)
        update_tokens = max(s["update_tokens"], 1.0)
        versions = batch.policy_versions[batch.response_mask > 0]
        out = {
            "loss": s["loss"] / epochs,
            "pg_loss": s["pg_loss"] / epochs,
            **{key: s[key] / update_tokens for key in POLICY_STATS},
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
        algo = self.config.algorithm
        seqs = (batch.response_mask.sum(-1) > 0).sum().item()
        out.update(self.correction.metrics(s, tokens, seqs))
        if algo.entropy_coeff > 0:
            out["entropy_loss"] = s["entropy_loss"] / epochs
        if self.reference is not None:
            out["kl_ref"] = s["kl_ref"] / tokens
        if algo.use_kl_loss:
            out["kl_loss"] = s["kl_loss"] / epochs
        if self.critic is not None:
            out.update(vf_loss=s["vf_loss"] / epochs, vf_clip_frac=s["vf_clip_frac"] / update_tokens)
        return out

    # -- weights and checkpoints --------------------------------------------------------------
    def weight_set_for_push(self):
        """The full weights by Hugging Face name, in the configured model dtype, as a set read bucket by
        bucket: each tensor is gathered (FSDP) and copied to CPU only when its bucket is built, so no
        rank holds more than a bucket beyond its shards. Collective on every pass: every rank walks it
        in the same order (`full_weights.walk_for_push` on the ranks that do not send)."""
        return full_weights.streamed_weights(self.model, DTYPES[self.config.model.dtype])

    def named_weights_for_push(self) -> list[tuple[str, torch.Tensor]]:
        """Full weights by Hugging Face name, on CPU, in the configured model dtype. Collective; rank 0 gets
        the list, the other ranks an empty one."""
        dtype = DTYPES[self.config.model.dtype]
        return [(name, t.to(dtype)) for name, t in full_weights.full_state_dict(self.model).items()]

    def _parts(self) -> checkpoint.Parts:
        parts = {"policy": (self.model, self.optimizer)}
        if self.critic is not None:
            parts["critic"] = (self.critic.model, self.critic.optimizer)
        return parts

    def save_checkpoint(self, directory: str | Path, extra: dict[str, Any] | None = None) -> Path:
        """Collective. Writes and commits `<directory>/step_<step>`, keeping the newest `keep_checkpoints`
        there. `extra` (JSON-serialisable, e.g. stream offsets) comes back from `load_checkpoint`."""
        return self.start_checkpoint(directory, extra, background=False).commit()

    def start_checkpoint(
        self, directory: str | Path, extra: dict[str, Any] | None = None, background: bool = False
    ) -> checkpoint.PendingCheckpoint:
        """Collective. Like `save_checkpoint`, but with `background` (and the sharded format) the shards are
        written by a thread while training goes on; the caller commits the returned checkpoint later."""
        path = checkpoint.checkpoint_path(directory, self.step)
        meta = {
            "step": self.step,
            "policy_version": self.policy_version,
            "extra": extra or {},
            "advantage": self.config.algorithm.advantage,
            "reference": self.reference.identity if self.reference is not None else None,
        }
        state: dict[str, Any] = {"scheduler": self.scheduler.state_dict(), "kl_ctrl": self.kl_ctrl.state_dict()}
        if self.critic is not None:
            state["critic_scheduler"] = self.critic.scheduler.state_dict()
        fmt = self.checkpoint_format
        return checkpoint.save(
            path,
            self._parts(),
            meta,
            keep=self.config.learner.keep_checkpoints,
            state=state,
            fmt=fmt,
            background=background and fmt == "sharded",
        )

    @property
    def checkpoint_format(self) -> str:
        """`learner.checkpoint_format` with `auto` resolved: one process gains nothing from shards."""
        learner = self.config.learner
        if learner.checkpoint_format != "auto":
            return learner.checkpoint_format
        return "sharded" if self.world_size > 1 or learner.checkpoint_async else "full"

    def export_hf(self, out_dir: str | Path, tokenizer_from: str | Path | None = None) -> Path | None:
        """Collective. Writes the policy as a Hugging Face model directory (config, safetensors weights in
        the configured dtype, tokenizer and generation config when the source has them) on rank 0."""
        weights = dict(self.named_weights_for_push())
        if not collectives.is_rank0():
            return None
        from services.learner.hf_export import write_hf_model

        return write_hf_model(
            out_dir, weights, self.model_path, tokenizer_from or self.model_path, dtype=self.config.model.dtype
        )

    def load_checkpoint(self, path: Path) -> dict[str, Any]:
        """Collective. Restores weights, optimizer, scheduler and KL-controller state, RNG and
        `policy_version`; returns `extra`. Base learning rates and weight decay come from the current
        config; the schedule position from the checkpoint."""
        meta, state = checkpoint.load(path, self._parts())
        algo = self.config.algorithm
        if self.reference is not None:
            self.reference.check(meta.get("reference") or {})
        for group in self.optimizer.param_groups:
            group["weight_decay"] = algo.weight_decay
        if "scheduler" in state:
            restore_scheduler(self.scheduler, state["scheduler"], algo.lr)
            self.kl_ctrl.load_state_dict(state["kl_ctrl"])
        if self.critic is not None:
            for group in self.critic.optimizer.param_groups:
                group["weight_decay"] = algo.weight_decay
            restore_scheduler(self.critic.scheduler, state["critic_scheduler"], algo.critic_lr)
        self.step, self.policy_version = int(meta["step"]), int(meta["policy_version"])
        return meta["extra"]
