"""The learner's run loop: collect a step's groups from the stream, update the policy, push the new
weights to every registered rollout server, checkpoint, and only then acknowledge the entries.

Rank 0 talks to Redis and the rollout servers; every rank trains on the same batch (FSDP splits it).
A restart resumes from the last committed checkpoint: entries it recorded as consumed are
acknowledged and skipped, every other pending entry is trained on again, so each batch is applied
exactly once.

While it waits for a step's groups, rank 0 keeps the run whole: a rollout server that (re)started and serves an
older policy is pushed the current one (it takes no work until it has it), and if Redis comes back without
the run's state (restarted without persistence) the learner rebuilds it from its own step and version; the
groups of the step that were lost with it are counted and replaced, never trained around."""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis

from services.common.config import TrainConfig, config_digest
from services.common.run_state import RunState
from services.common.stream import StreamEntry, TrajectoryStream
from services.common.trajectory import RecordError, decode_batch
from services.learner import collectives, full_weights
from services.learner.determinism import canonical_order
from services.learner.episodes import EpisodeRecorder, episode_summary
from services.learner.poison_guard import Poison, PoisonGuard, check_trajectory
from services.learner.prometheus_metrics import DROPPED, export_summary

CATCH_UP_EVERY_S = 10.0
"""Least time between two pushes to the same lagging rollout server (its registry entry lags a push by
up to one heartbeat)."""
WAIT_REPORT_EVERY_S = 30.0

log = logging.getLogger(__name__)

CONSUMER = "learner-0"


class StepTimeout(RuntimeError):
    pass


class RunFailed(RuntimeError):
    """The run cannot go on with its config: restarted on it, the learner would fail the same way. The run
    state records why (`RunState.mark_failed`), so no launcher restarts it and a learner started on that
    config exits at once; a changed config clears it."""


class DynamicSamplingExhausted(RunFailed):
    """A step dropped more uninformative groups than `algorithm.dynamic_sampling_max_gen_batches` allows."""


def check_sampling_budget(config: TrainConfig, step: int, dropped: int, kept: int) -> None:
    """Fails step `step` once it would need more than `dynamic_sampling_max_gen_batches` times groups_per_step
    groups (verl's max_num_gen_batches), kept and dropped: once it dropped more than (N - 1) x groups_per_step."""
    batches, want = config.algorithm.dynamic_sampling_max_gen_batches, config.rollout.groups_per_step
    if not batches or dropped <= (batches - 1) * want:
        return
    raise DynamicSamplingExhausted(
        f"step {step}: dynamic sampling dropped {dropped} groups whose episodes all got the same reward and has "
        f"{kept}/{want} groups to train on, past algorithm.dynamic_sampling_max_gen_batches={batches} ({batches} x "
        f"{want} groups per step): the tasks may be all solved or all failed by the policy; raise the limit (0: none) "
        "or set algorithm.dynamic_sampling=false"
    )


def same_reward(members: Iterable) -> bool:
    """Every member got exactly the same `Trajectory.reward`: under the group-relative estimators the group's
    advantages are all 0. Dynamic sampling drops such groups; the step summary counts those trained on."""
    return len({t.reward for t in members}) == 1


def by_group(trajectories: Iterable) -> list[list]:
    """`trajectories` split by `group_id`, groups in order of first appearance."""
    groups: dict[str, list] = {}
    for traj in trajectories:
        groups.setdefault(traj.group_id, []).append(traj)
    return list(groups.values())


def uniform_groups(trajectories: Iterable) -> int:
    """Groups among `trajectories` whose members all got the same reward (`same_reward`)."""
    return sum(same_reward(members) for members in by_group(trajectories))


@dataclass
class CollectedStep:
    trajectories: list = field(default_factory=list)
    entry_ids: list[str] = field(default_factory=list)
    groups: set[str] = field(default_factory=set)
    dropped_stale: int = 0
    filtered_groups: set[str] = field(default_factory=set)
    """Groups dynamic sampling dropped (every member got the same reward); disjoint from `groups`."""
    filtered_trajectories: int = 0
    """Their episodes: played, never trained on."""


class LearnerService:
    def __init__(
        self,
        config: TrainConfig,
        trainer: Any,
        pusher: Any,
        state: RunState | None = None,
        stream: TrajectoryStream | None = None,
        recorder: EpisodeRecorder | None = None,
        trackers: Any = None,
    ):
        self.config, self.trainer, self.pusher = config, trainer, pusher
        self.state, self.stream = state, stream  # rank 0 only
        self.recorder, self.trackers = recorder, trackers  # rank 0 only; None: no recorded episodes, no trackers
        self._validations_after = "0"  # the validation_episodes stream's last entry recorded
        self._validated = -1  # the newest policy version whose validation entry was read
        self.version = 0
        self.step = 0
        self._unacked: list[str] = []
        self._backlog: list[StreamEntry] = []
        self.history: list[dict[str, Any]] = []
        self.dropped_stale_total = 0
        self.groups_filtered_total = 0
        self.groups_lost_to_redis = 0
        self._pushed = None
        """The weights of the last push, kept for servers that come back (rank 0)."""
        self._catch_up_after: dict[str, float] = {}
        self._applied: dict[str, tuple[int, Any]] = {}
        """Rollout server -> (the version a push of this learner applied there, the server's registry entry's
        heartbeat time when that push began): until its next heartbeat, the registry shows the version before."""
        self._pending: Any = None
        """(checkpoint being written in the background, the entry ids it covers)"""
        self.guard = PoisonGuard(config, trainer, state, stream)  # see its module for the poison-input policy
        self._successes: deque[float] = deque(maxlen=config.learner.stop_window)
        self.finished = False
        """The last step ran: `learner.steps` of them, or the success target was reached (every rank agrees: the
        success rate comes from the broadcast batch)."""

    # -- start-up ----------------------------------------------------------------------------
    def resume(self) -> None:
        ckpt = self.trainer.latest_checkpoint(self.config.learner.checkpoint_dir)
        consumed: set[str] = set()
        if ckpt is not None:
            extra = self.trainer.load_checkpoint(ckpt)
            self.step, self.version = extra["step"], extra["policy_version"]
            consumed = set(extra.get("unacked_entry_ids", []))
            self.dropped_stale_total = extra.get("dropped_stale_total", 0)
            self.groups_filtered_total = extra.get("groups_filtered_total", 0)
            self.groups_lost_to_redis = extra.get("groups_lost_to_redis", 0)
            log.info("resumed from %s at step %d (policy v%d)", ckpt, self.step, self.version)
        if self.stream is not None:
            self.stream.ensure_group()
            # Redis may have lost the claim counter while the learner was away: claims restart at its step
            self.state.raise_claims_to(self.step * self.config.rollout.groups_per_step)
            pending = self.stream.read(CONSUMER, count=100000, block_ms=0, pending=True)
            self._ack([e.entry_id for e in pending if e.entry_id in consumed])
            self._backlog = [e for e in pending if e.entry_id not in consumed]
            if self._backlog:
                log.info("%d pending stream entries will be trained on again", len(self._backlog))

    def wait_for_rollouts(self, timeout_s: float = 600.0) -> None:
        deadline = time.monotonic() + timeout_s
        while collectives.is_rank0() and not self.state.rollout_servers():
            if time.monotonic() > deadline:
                raise StepTimeout("no rollout server registered")
            time.sleep(0.5)

    # -- one step ----------------------------------------------------------------------------
    def _collect(self) -> CollectedStep:
        cfg, out = self.config, CollectedStep()
        want = cfg.rollout.groups_per_step
        deadline, waiting_since = time.monotonic() + cfg.learner.step_timeout_s, time.time()
        next_report = time.monotonic() + WAIT_REPORT_EVERY_S
        oldest_ok, stale = self.step - cfg.algorithm.max_staleness, 0
        while len(out.groups) < want:
            if self._backlog:  # replayed as the stream delivered it: at most as many entries as groups missing
                take = want - len(out.groups)
                entries, self._backlog = self._backlog[:take], self._backlog[take:]
            else:
                try:
                    entries = self.stream.read(
                        CONSUMER, count=want - len(out.groups), block_ms=cfg.stream.read_block_ms
                    )
                except redis.ResponseError as exc:
                    if "NOGROUP" not in str(exc):
                        raise
                    out = self._rebuild_run_state(out)
                    continue
                except (redis.ConnectionError, redis.TimeoutError) as exc:  # the client retried with back-off
                    log.warning("Redis unreachable while collecting step %d: %s", self.step + 1, exc)
                    entries = []
            lost: dict[str, set[str]] = {}  # group -> entries of its stale or filtered trajectories
            for entry in entries:
                out.entry_ids.append(entry.entry_id)
                fresh: dict[str, list] = {}
                for traj in self.guard.admit(entry, self.version):
                    if min((t.policy_version for t in traj.turns), default=self.version) < oldest_ok:
                        DROPPED.labels(reason="stale").inc()
                        stale += 1
                        out.dropped_stale += 1
                        lost.setdefault(traj.group_id, set()).add(entry.entry_id)
                        continue
                    fresh.setdefault(traj.group_id, []).append(traj)
                for group_id, members in fresh.items():
                    if self._uninformative(group_id, members, out):
                        self._filter(group_id, members, out)
                        lost.setdefault(group_id, set()).add(entry.entry_id)
                        continue
                    out.trajectories += members
                    out.groups.add(group_id)
            self.guard.purge(out)
            self._count_stale_groups(e for group_id, ids in lost.items() if group_id not in out.groups for e in ids)
            check_sampling_budget(cfg, self.step + 1, len(out.filtered_groups), len(out.groups))
            if entries:
                continue
            self._reclaim_lost_deliveries(out)
            self._catch_up_servers()
            now = time.monotonic()
            if now > deadline:
                filtered = f"{len(out.filtered_groups)} groups filtered; " if cfg.algorithm.dynamic_sampling else ""
                raise StepTimeout(
                    f"step {self.step + 1}: {len(out.groups)}/{want} groups after "
                    f"{cfg.learner.step_timeout_s:.0f}s ({stale} stale trajectories dropped; {filtered}"
                    f"{self._servers_line(waiting_since)}); raise learner.step_timeout_s to wait longer"
                )
            if now > next_report:
                next_report = now + WAIT_REPORT_EVERY_S
                log.info(
                    "step %d: %d/%d groups so far, waiting (%s; gives up in %.0fs)",
                    self.step + 1,
                    len(out.groups),
                    want,
                    self._servers_line(waiting_since),
                    deadline - now,
                )
        out.trajectories = canonical_order(out.trajectories)
        return out

    def _uninformative(self, group_id: str, members: list, out: CollectedStep) -> bool:
        """Dynamic sampling: a new group whose members all got the same reward (every advantage 0), or a later
        member of a group already filtered. A group is judged on the members of the entry that brings it: the
        producers publish each group whole, in one entry."""
        if not self.config.algorithm.dynamic_sampling:
            return False
        if group_id in out.filtered_groups:
            return True
        return group_id not in out.groups and same_reward(members)

    def _filter(self, group_id: str, members: list, out: CollectedStep) -> None:
        """Drops a filtered group like a stale one: its entry is acknowledged with the step, and the caller
        counts it lost so that the producers play a fresh group in its place."""
        DROPPED.labels(reason="filtered").inc(len(members))
        out.filtered_groups.add(group_id)
        out.filtered_trajectories += len(members)

    def _servers_line(self, since: float | None = None) -> str:
        """The rollout servers registered and their versions; and why a rollout last dropped a group, where that
        happened after `since` (time.time(): when this step began to wait)."""
        try:
            servers = self.state.rollout_servers()
        except redis.RedisError as exc:
            return f"Redis unreachable: {exc}"
        versions = ", ".join(f"{a} v{info.get('policy_version')}" for a, info in sorted(servers.items()))
        line = f"{len(servers)} rollout server(s) registered{': ' + versions if versions else ''}"
        try:
            failure = self.state.last_group_failure()
        except redis.RedisError:
            failure = None
        if failure and since is not None and failure["time"] >= since:
            line += f"; last group dropped {time.time() - failure['time']:.0f}s ago: {failure['message']}"
        return line

    def _reclaim_lost_deliveries(self, out: CollectedStep) -> None:
        """A read whose reply never arrived (Redis restarted mid-read and the client retried) left its
        entries pending for this consumer, where new reads never return them: take them back."""
        known = {*out.entry_ids, *self._unacked, *(entry.entry_id for entry in self._backlog)}
        try:
            lost = [entry_id for entry_id in self.stream.pending_ids(CONSUMER) if entry_id not in known]
            if lost:
                log.warning(
                    "%d stream entries were delivered to the learner but never received (a read "
                    "interrupted by a Redis restart): reading them again",
                    len(lost),
                )
                self._backlog += self.stream.fetch(lost)
        except redis.RedisError as exc:
            log.warning("could not check for lost deliveries: %s", exc)

    def _catch_up_servers(self) -> None:
        """Pushes the current weights to registered rollout servers that serve an older version (restarted,
        or missed a push while they were away); they take no work until they have it."""
        if self._pushed is None:
            return
        now = time.monotonic()
        try:
            servers = self.state.rollout_servers()
        except redis.RedisError:
            return
        behind = [
            a
            for a, info in servers.items()
            if int(info.get("policy_version", -1)) < self.version
            and not self._holds_current(a, info)
            and now >= self._catch_up_after.get(a, 0.0)
        ]
        if not behind:
            return
        for address in behind:
            self._catch_up_after[address] = now + CATCH_UP_EVERY_S
        for result in self.pusher.push(self.version, self._pushed, sorted(behind), run=self.config.run):
            if result.ok:
                log.info("rollout %s was behind: pushed v%d (%.1fs)", result.address, self.version, result.seconds)
            else:
                log.warning(
                    "rollout %s is behind and the push of v%d failed: %s", result.address, self.version, result.error
                )

    def _holds_current(self, address: str, info: dict[str, Any]) -> bool:
        """Our push applied the current version there and the registry has not heard from the server since: its
        entry is a heartbeat older than the push, not a server that lost the version (a restart beats anew)."""
        version, beat = self._applied.get(address, (-1, None))
        return version >= self.version and info.get("ts") == beat

    def _rebuild_run_state(self, partial: CollectedStep) -> CollectedStep:
        """Redis lost the run's state (its consumer group is gone). The learner's own step and version are
        the truth: publish them again, restart group claims at this step, and collect the step anew; the
        groups already read for it went with Redis and are counted as lost."""
        self.groups_lost_to_redis += len(partial.groups)
        DROPPED.labels(reason="redis_lost").inc(len(partial.trajectories))
        log.error(
            "Redis lost the run's state (restarted without persistence?): rebuilding it at step %d, policy "
            "v%d; %d group(s) read for this step were lost with it and will be replaced",
            self.step + 1,
            self.version,
            len(partial.groups),
        )
        self.stream.ensure_group()
        self.state.publish_version(self.version)
        self.state.raise_claims_to(self.step * self.config.rollout.groups_per_step)
        self._backlog = []
        return CollectedStep()

    def _count_stale_groups(self, entry_ids: Iterable[str]) -> None:
        """Groups lost to staleness or dropped by dynamic sampling, by the entries they came in: the producers
        shift later claims by each one a claim of this run published (see services.rollout.producer and
        GroupLeases.count_lost), so it is replaced instead of starving the last step; it counts once, even when
        a restart drops it again."""
        if self.state is not None:
            self.state.leases.count_lost(entry_ids)

    def _ack(self, entry_ids: list[str]) -> None:
        """Acknowledges entries a committed checkpoint holds; their groups can no longer be lost."""
        self.stream.ack(entry_ids)
        if self.state is not None:  # a learner fed a stream without run state (tests, offline tools) holds no leases
            self.state.leases.settle(entry_ids)

    def _push(self, rollback: bool = False) -> tuple[float, str, list[dict]]:
        """`rollback`: the servers may go back to this version (a learner resumed from a checkpoint older
        than the last version it pushed before it died)."""
        if not self.pusher.needs_servers:  # offline (recorded batches): only the version is published
            if collectives.is_rank0():
                self.state.publish_version(self.version)
            return 0.0, "", []
        weights = self.trainer.weight_set_for_push()
        if not collectives.is_rank0():
            full_weights.walk_for_push(weights)
            return 0.0, "", []
        start = time.perf_counter()
        servers = self.state.rollout_servers()
        addresses = sorted(servers)
        # Catch-up pushes re-read the model, which holds this version until the next step trains it. With
        # several ranks that read is a collective rank 0 cannot run alone: it keeps a spool of the push.
        sharded = collectives.world_size() > 1
        if sharded:
            from services.weightsync.spool import TeeToSpool

            weights = TeeToSpool(weights)
        results = self.pusher.push(self.version, weights, addresses, rollback=rollback, run=self.config.run)
        previous, self._pushed = self._pushed, weights.spooled() if sharded else weights
        if previous is not None and hasattr(previous, "spool"):
            previous.spool.delete()
        sent = next((r.sent_checksum for r in results if r.sent_checksum), "") or weights.checksum
        for result in results:
            if not result.ok:
                log.error("weight push v%d to %s failed: %s", self.version, result.address, result.error)
            elif result.checksum != sent:
                log.error(
                    "rollout %s applied checksum %s, learner has %s",
                    result.address,
                    result.checksum[:12],
                    sent[:12],
                )
            else:
                self._applied[result.address] = (self.version, servers.get(result.address, {}).get("ts"))
        self.state.publish_version(self.version)
        return time.perf_counter() - start, sent, [vars(r) for r in results]

    def _checkpoint(self, force: bool) -> float:
        if not force and self.step % self.config.learner.checkpoint_every:
            return 0.0
        start = time.perf_counter()
        self._commit_pending()
        background = self.config.learner.checkpoint_async and not force
        pending = self.trainer.start_checkpoint(
            self.config.learner.checkpoint_dir,
            {
                "step": self.step,
                "policy_version": self.version,
                "unacked_entry_ids": self._unacked,
                "dropped_stale_total": self.dropped_stale_total,
                "groups_filtered_total": self.groups_filtered_total,
                "groups_lost_to_redis": self.groups_lost_to_redis,
            },
            background=background,
        )
        self._pending = (pending, self._unacked)
        self._unacked = []
        if not background:
            self._commit_pending()
        return time.perf_counter() - start

    def _commit_pending(self) -> None:
        """Commits the checkpoint in flight, then acknowledges the entries it covers: a batch is acked only
        once a committed checkpoint holds its update."""
        if self._pending is None:
            return
        pending, entry_ids = self._pending
        self._pending = None
        pending.commit()
        if self.stream is not None:
            self._ack(entry_ids)

    def export_policy(self) -> None:
        """Collective: the trained policy as a Hugging Face model directory (`learner.export_dir`)."""
        learner = self.config.learner
        out = learner.export_dir or str(Path(learner.checkpoint_dir).parent / "policy_hf")
        start = time.perf_counter()
        if self.trainer.export_hf(out) is not None:
            log.info("policy exported as a Hugging Face model to %s (%.1fs)", out, time.perf_counter() - start)

    def run_step(self) -> dict[str, Any]:
        start, started_at = time.perf_counter(), time.time()
        stats = None
        while stats is None:  # None: every group of the batch made the step fail and was dead-lettered
            batch = self._collect() if collectives.is_rank0() else None
            collected = time.perf_counter()
            batch = collectives.broadcast_object(batch)
            stats = self.guard.train(self.trainer, batch)
        self.step += 1
        self.version = self.trainer.policy_version = self.step
        self.dropped_stale_total += batch.dropped_stale
        self.groups_filtered_total += len(batch.filtered_groups)
        push_s, checksum, pushes = self._push()
        self._unacked += batch.entry_ids
        self._successes.append(stats.get("success_rate", 0.0))
        self.finished = self.step >= self.config.learner.steps or self._target_reached()
        ckpt_s = self._checkpoint(force=self.finished)
        trained = [t for t in batch.trajectories if not t.baseline]  # remax's greedy baselines are not trained on
        versions = [t.policy_version for traj in trained for t in traj.turns]
        summary = {
            **stats,
            "step": self.step,
            "policy_version": self.version,
            "weights_checksum": checksum,
            "pushes": pushes,
            "push_seconds": push_s,
            "checkpoint_seconds": ckpt_s,
            "staleness": self.step - 1 - sum(versions) / max(len(versions), 1),
            "step_seconds": time.perf_counter() - start,
            "collect_seconds": collected - start,
            "started_at": started_at,  # epoch seconds: lines the step up against other processes' clocks
            "trajectories": len(trained),
            "groups": len(batch.groups),
            "entry_ids": batch.entry_ids,
            "dropped_stale": batch.dropped_stale,
            "dropped_stale_total": self.dropped_stale_total,
            "groups_uniform": uniform_groups(batch.trajectories),
            "groups_filtered": len(batch.filtered_groups),
            "groups_filtered_total": self.groups_filtered_total,
            "trajectories_filtered": batch.filtered_trajectories,
            "groups_lost_to_redis": self.groups_lost_to_redis,
        }
        for traj in trained:
            for name, value in traj.reward_components.items():
                summary.setdefault(f"reward/{name}", 0.0)
                summary[f"reward/{name}"] += value / len(trained)
        self._export(summary, self._record())
        return summary

    def _record(self) -> list[dict[str, Any]]:
        """The step's recorded episodes (rank 0; none when recording is off), and the validations published since."""
        tokens, self.trainer.step_tokens = getattr(self.trainer, "step_tokens", None), None
        if self.recorder is None or not collectives.is_rank0():
            return []
        self._record_validations()
        return self.recorder.record(self.step, tokens)

    def _record_final_validation(self, timeout_s: float = 120.0, poll_s: float = 0.5) -> None:
        """The rollout validates the final policy after the last step: wait for its entry (while a rollout server
        is registered, up to `timeout_s`) to record its episodes too."""
        every = self.config.env.validation_every
        if self.recorder is None or not collectives.is_rank0() or not every or self.step % every:
            return
        deadline = time.monotonic() + timeout_s
        self._record_validations()
        while self._validated < self.step and time.monotonic() < deadline and self.state.rollout_servers():
            time.sleep(poll_s)
            self._record_validations()
        if self._validated < self.step:
            log.warning("the final policy's validation episodes did not come: not recorded")

    def _record_validations(self) -> None:
        """Validation episodes from the run's `validation_episodes` stream, checked as training records are; an
        entry that does not decode, or a bad episode, is left out with a warning."""
        try:
            entries = self.state.validation_episodes(self._validations_after)
        except redis.RedisError as exc:
            log.warning("validation episodes not read this step: %r", exc)
            return
        for entry_id, version, payload in entries:
            self._validations_after = entry_id
            self._validated = max(self._validated, version)
            try:
                played = list(decode_batch(payload).trajectories)
            except RecordError as exc:
                log.warning("validation entry %s not recorded: %s", entry_id, exc)
                continue
            kept = []
            for traj in played:
                try:
                    check_trajectory(traj, self.guard.limits, self.version)
                    kept.append(traj)
                except Poison as exc:
                    log.warning("validation episode not recorded: %s", exc)
            self.recorder.record_validation(version, kept)

    def _target_reached(self) -> bool:
        target, window = self.config.learner.stop_at_success, self._successes
        return target is not None and len(window) == window.maxlen and sum(window) / len(window) >= target

    def _export(self, summary: dict[str, Any], episodes: list[dict[str, Any]]) -> None:
        if not collectives.is_rank0():
            return
        export_summary(summary)
        self.history.append(summary)
        self.state.publish_metrics(self.step, summary)
        if self.trackers is not None:
            self.trackers.log_metrics(self.step, summary)
            if episodes and self.step % self.config.logging.tracker_episodes_every == 0:
                self.trackers.log_episodes(self.step, [episode_summary(row) for row in episodes])

    def run(self) -> list[dict[str, Any]]:
        self._refuse_a_failed_run()
        if self.trackers is not None:
            self.trackers.log_config(self.config.model_dump(mode="json"))
        try:
            return self._run()
        except RunFailed as exc:
            if collectives.is_rank0():
                self.state.mark_failed(str(exc), config_digest(self.config))
            raise
        finally:
            if self.trackers is not None:
                self.trackers.close()

    def _refuse_a_failed_run(self) -> None:
        failure = self.state.failure() if collectives.is_rank0() else None
        if failure is None:
            return
        if failure.get("config") == config_digest(self.config):
            raise RunFailed(
                "this run failed and its config has not changed since, so it would fail the same way: "
                f"{failure.get('reason')}"
            )
        log.info("this run failed earlier (%s); its config has changed since, so it goes on", failure.get("reason"))
        self.state.clear_failure()

    def _run(self) -> list[dict[str, Any]]:
        self.resume()
        if collectives.is_rank0() and self.pusher.needs_servers:
            self.wait_for_rollouts()
        self._push(rollback=True)  # the servers may hold other weights than the checkpoint (restart, resume)
        self.finished = self.step >= self.config.learner.steps
        while not self.finished:
            summary = self.run_step()
            if collectives.is_rank0():
                log.info(
                    "step %d: reward %.3f success %.2f kl %.4f %.1fs v%d",
                    summary["step"],
                    summary.get("reward_mean", float("nan")),
                    summary.get("success_rate", float("nan")),
                    summary.get("approx_kl", float("nan")),
                    summary["step_seconds"],
                    summary["policy_version"],
                )
        self._commit_pending()
        self._record_final_validation()
        if self.step < self.config.learner.steps:
            log.info(
                "success %.2f over the last %d steps reached learner.stop_at_success: the run ends at step %d of %d",
                sum(self._successes) / len(self._successes),
                len(self._successes),
                self.step,
                self.config.learner.steps,
            )
        self.export_policy()
        if collectives.is_rank0():
            self.state.mark_done()
        return self.history
