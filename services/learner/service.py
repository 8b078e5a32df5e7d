"""The learner's run loop: collect a step's groups from the stream, update the policy, push the new
weights to every registered rollout server, checkpoint, and only then acknowledge the entries.

Rank 0 talks to Redis and the rollout servers; every rank trains on the same batch (FSDP splits it).
A restart resumes from the last committed checkpoint: entries it recorded as consumed are
acknowledged and skipped, every other pending entry is trained on again, so each batch is applied
exactly once."""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

from services.common.config import TrainConfig
from services.common.run_state import RunState
from services.common.stream import StreamEntry, TrajectoryStream
from services.common.weights import pack
from services.learner import fsdp
from services.learner.exporter import DROPPED, export_summary
from services.learner.validation import PoisonGuard

log = logging.getLogger(__name__)

CONSUMER = "learner-0"


class StepTimeout(RuntimeError):
    pass


@dataclass
class CollectedStep:
    trajectories: list = field(default_factory=list)
    entry_ids: list[str] = field(default_factory=list)
    groups: set[str] = field(default_factory=set)
    dropped_stale: int = 0


class LearnerService:
    def __init__(self, config: TrainConfig, trainer: Any, pusher: Any, state: RunState | None = None,
                 stream: TrajectoryStream | None = None):
        self.config, self.trainer, self.pusher = config, trainer, pusher
        self.state, self.stream = state, stream  # rank 0 only
        self.version = 0
        self.step = 0
        self._unacked: list[str] = []
        self._backlog: list[StreamEntry] = []
        self.history: list[dict[str, Any]] = []
        self.dropped_stale_total = 0
        self.guard = PoisonGuard(config, trainer, state, stream)  # see its module for the poison-input policy

    # -- start-up ----------------------------------------------------------------------------
    def resume(self) -> None:
        ckpt = self.trainer.latest_checkpoint(self.config.learner.checkpoint_dir)
        consumed: set[str] = set()
        if ckpt is not None:
            extra = self.trainer.load_checkpoint(ckpt)
            self.step, self.version = extra["step"], extra["policy_version"]
            consumed = set(extra.get("unacked_entry_ids", []))
            self.dropped_stale_total = extra.get("dropped_stale_total", 0)
            log.info("resumed from %s at step %d (policy v%d)", ckpt, self.step, self.version)
        if self.stream is not None:
            self.stream.ensure_group()
            pending = self.stream.read(CONSUMER, count=100000, block_ms=0, pending=True)
            self.stream.ack([e.entry_id for e in pending if e.entry_id in consumed])
            self._backlog = [e for e in pending if e.entry_id not in consumed]
            if self._backlog:
                log.info("%d pending stream entries will be trained on again", len(self._backlog))

    def wait_for_rollouts(self, timeout_s: float = 600.0) -> None:
        deadline = time.monotonic() + timeout_s
        while fsdp.is_rank0() and not self.state.rollout_servers():
            if time.monotonic() > deadline:
                raise StepTimeout("no rollout server registered")
            time.sleep(0.5)

    # -- one step ----------------------------------------------------------------------------
    def _collect(self) -> CollectedStep:
        cfg, out = self.config, CollectedStep()
        want = cfg.rollout.groups_per_step
        deadline = time.monotonic() + cfg.learner.step_timeout_s
        oldest_ok, stale = self.step - cfg.algorithm.max_staleness, 0
        while len(out.groups) < want:
            if self._backlog:  # replayed as the stream delivered it: at most as many entries as groups missing
                take = want - len(out.groups)
                entries, self._backlog = self._backlog[:take], self._backlog[take:]
            else:
                entries = self.stream.read(CONSUMER, count=want - len(out.groups), block_ms=cfg.stream.read_block_ms)
            lost = set()
            for entry in entries:
                out.entry_ids.append(entry.entry_id)
                for traj in self.guard.admit(entry, self.version):
                    if min((t.policy_version for t in traj.turns), default=self.version) < oldest_ok:
                        DROPPED.labels(reason="stale").inc()
                        stale += 1
                        out.dropped_stale += 1
                        lost.add(traj.group_id)
                        continue
                    out.trajectories.append(traj)
                    out.groups.add(traj.group_id)
            self.guard.purge(out)
            self._report_stale_groups(len(lost - out.groups))
            if not entries and time.monotonic() > deadline:
                raise StepTimeout(f"step {self.step + 1}: {len(out.groups)}/{want} groups after "
                                  f"{cfg.learner.step_timeout_s:.0f}s ({stale} stale trajectories dropped)")
        return out

    def _report_stale_groups(self, count: int) -> None:
        """Run-wide count of groups lost to staleness: the producers shift later claims by it (see
        services.rollout.producer), so a dropped group is replaced instead of starving the last step."""
        if count and self.state is not None:
            self.state.client.incrby(self.config.key("stale_groups"), count)

    def _push(self) -> tuple[float, str, list[dict]]:
        if not self.pusher.needs_servers:  # offline (recorded batches): only the version is published
            if fsdp.is_rank0():
                self.state.publish_version(self.version)
            return 0.0, "", []
        weights = self.trainer.named_weights_for_push()
        if not fsdp.is_rank0():
            return 0.0, "", []
        start, packed = time.perf_counter(), pack(weights)
        addresses = sorted(self.state.rollout_servers())
        results = self.pusher.push(self.version, packed, addresses)
        for result in results:
            if not result.ok:
                log.error("weight push v%d to %s failed: %s", self.version, result.address, result.error)
            elif result.checksum != packed.checksum:
                log.error("rollout %s applied checksum %s, learner has %s", result.address, result.checksum[:12],
                          packed.checksum[:12])
        self.state.publish_version(self.version)
        return time.perf_counter() - start, packed.checksum, [vars(r) for r in results]

    def _checkpoint(self, force: bool) -> float:
        if not force and self.step % self.config.learner.checkpoint_every:
            return 0.0
        start = time.perf_counter()
        self.trainer.save_checkpoint(self.config.learner.checkpoint_dir, {
            "step": self.step, "policy_version": self.version, "unacked_entry_ids": self._unacked,
            "dropped_stale_total": self.dropped_stale_total})
        if self.stream is not None:
            self.stream.ack(self._unacked)
        self._unacked = []
        return time.perf_counter() - start

    def run_step(self) -> dict[str, Any]:
        start = time.perf_counter()
        stats = None
        while stats is None:  # None: every group of the batch made the step fail and was dead-lettered
            batch = self._collect() if fsdp.is_rank0() else None
            batch = fsdp.broadcast_object(batch)
            stats = self.guard.train(self.trainer, batch)
        self.step += 1
        self.version = self.trainer.policy_version = self.step
        self.dropped_stale_total += batch.dropped_stale
        push_s, checksum, pushes = self._push()
        self._unacked += batch.entry_ids
        ckpt_s = self._checkpoint(force=self.step == self.config.learner.steps)
        versions = [t.policy_version for traj in batch.trajectories for t in traj.turns]
        summary = {**stats, "step": self.step, "policy_version": self.version, "weights_checksum": checksum,
                   "pushes": pushes, "push_seconds": push_s, "checkpoint_seconds": ckpt_s,
                   "staleness": self.step - 1 - sum(versions) / max(len(versions), 1),
                   "step_seconds": time.perf_counter() - start, "trajectories": len(batch.trajectories),
                   "groups": len(batch.groups), "entry_ids": batch.entry_ids, "dropped_stale": batch.dropped_stale,
                   "dropped_stale_total": self.dropped_stale_total}
        for traj in batch.trajectories:
            for name, value in traj.reward_components.items():
                summary.setdefault(f"reward/{name}", 0.0)
                summary[f"reward/{name}"] += value / len(batch.trajectories)
        self._export(summary)
        return summary

    def _export(self, summary: dict[str, Any]) -> None:
        if not fsdp.is_rank0():
            return
        export_summary(summary)
        self.history.append(summary)
        self.state.publish_metrics(self.step, summary)

    def run(self) -> list[dict[str, Any]]:
        self.resume()
        if fsdp.is_rank0() and self.pusher.needs_servers:
            self.wait_for_rollouts()
        self._push()  # the servers may hold other weights than the checkpoint (restart, resume)
        while self.step < self.config.learner.steps:
            summary = self.run_step()
            if fsdp.is_rank0():
                log.info("step %d: reward %.3f success %.2f kl %.4f %.1fs v%d", summary["step"],
                         summary.get("reward_mean", float("nan")), summary.get("success_rate", float("nan")),
                         summary.get("approx_kl", float("nan")), summary["step_seconds"], summary["policy_version"])
        if fsdp.is_rank0():
            self.state.mark_done()
        return self.history
