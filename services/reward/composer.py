"""The weighted sum of the configured reward functions, with each weighted part kept for logging, and the per-turn
sum of the process rewards among them."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import NamedTuple

from prometheus_client import CollectorRegistry

from services.common.config import EnvConfig, RewardComponentConfig, RewardConfig
from services.common.protos import trajectory_pb2
from services.common.registry import Registry
from services.reward.base import RewardFunction
from services.reward.reference_scorer import ReferenceScorer
from services.reward.references import References
from services.reward.registry import REWARDS


class ComponentFailed(RuntimeError):
    """A reward component raised, or broke its contract, on a batch; `component` names it."""

    def __init__(self, component: str, message: str):
        super().__init__(message)
        self.component = component


class Scored(NamedTuple):
    """One trajectory's reward: `total` is the sum of `components` (each weight * value; a process reward's value
    is the sum of its turn scores); `turns`, one per turn, the weighted sum of the process rewards' turn scores
    (empty when no component scores turns)."""

    total: float
    components: dict[str, float]
    turns: list[float]

    def apply_to(self, traj: trajectory_pb2.Trajectory) -> None:
        """Writes the reward into the record: its total, breakdown and each turn's process reward."""
        if self.turns and len(self.turns) != len(traj.turns):
            raise ValueError(f"{len(self.turns)} turn rewards for {traj.trajectory_id!r} of {len(traj.turns)} turns")
        traj.reward = self.total
        traj.reward_components.update(self.components)
        for turn, value in zip(traj.turns, self.turns):
            turn.process_reward = value


class RewardComposer:
    def __init__(
        self,
        components: Mapping[str, RewardComponentConfig | dict],
        registry: Registry[RewardFunction] = REWARDS,
        references: References | None = None,
    ):
        """Fails here (ValueError) on unknown names or bad params, never at scoring time. `references`: the task
        dataset's reference answers, which the rule scorers (ReferenceScorer) score against."""
        if not components:
            raise ValueError(f"no reward components configured; known: {', '.join(registry.names())}")
        specs = {name: RewardComponentConfig.model_validate(spec) for name, spec in components.items()}
        unknown = sorted({spec.function(name) for name, spec in specs.items()} - set(registry.names()))
        if unknown:
            raise ValueError(f"unknown reward component(s) {', '.join(unknown)}; known: {', '.join(registry.names())}")
        self.components: list[tuple[str, float, RewardFunction]] = []
        for name, spec in specs.items():
            try:
                fn = registry.create(spec.function(name), **spec.params)
            except (TypeError, ValueError) as exc:
                raise ValueError(f"reward component {name!r}: bad params {spec.params}: {exc}") from None
            if isinstance(fn, ReferenceScorer):
                if references is None:
                    raise ValueError(
                        f"reward component {name!r} scores against the task dataset's reference answers: "
                        "build the composer with the run's env config"
                    )
                fn.bind(references, name)
            self.components.append((name, spec.weight, fn))

    @classmethod
    def from_config(
        cls, config: RewardConfig, env: EnvConfig | None = None, *, metrics_registry: CollectorRegistry | None = None
    ) -> RewardComposer:
        """`env`: the run's env config, whose task dataset holds the reference answers (read on first need)."""
        references = References.from_config(env, metrics_registry=metrics_registry) if env is not None else None
        return cls(config.components, references=references)

    @property
    def names(self) -> list[str]:
        return [name for name, _, _ in self.components]

    @property
    def per_turn(self) -> bool:
        """Whether any component scores turns (a process reward)."""
        return any(fn.per_turn for _, _, fn in self.components)

    def score(self, traj: trajectory_pb2.Trajectory) -> Scored:
        return self.score_many([traj])[0]

    def score_many(self, trajs: Sequence[trajectory_pb2.Trajectory]) -> list[Scored]:
        """`score` of each trajectory, each component given them all at once (`RewardFunction.score_batch`)."""
        parts: list[dict[str, float]] = [{} for _ in trajs]
        turns = [[0.0] * len(t.turns) if self.per_turn else [] for t in trajs]
        for name, weight, fn in self.components:
            if fn.per_turn:
                for traj, scores, out, sums in zip(trajs, _turn_values(name, fn, trajs), parts, turns):
                    for i, value in enumerate(scores):
                        _check_finite(name, value, traj)
                        sums[i] += weight * value
                    out[name] = weight * sum(scores)
                continue
            batched = type(fn).score_batch is not RewardFunction.score_batch
            values = _values(name, fn, trajs) if batched else [v for t in trajs for v in _values(name, fn, [t])]
            if len(values) != len(trajs):
                raise ComponentFailed(
                    name, f"reward component {name!r} gave {len(values)} scores for {len(trajs)} trajectories"
                )
            for traj, value, out in zip(trajs, values, parts):
                _check_finite(name, value, traj)
                out[name] = weight * value
        return [Scored(sum(p.values()), p, t) for p, t in zip(parts, turns)]


def _check_finite(name: str, value: float, traj: trajectory_pb2.Trajectory) -> None:
    if not math.isfinite(value):
        raise ComponentFailed(name, f"reward component {name!r} gave {value} for trajectory {traj.trajectory_id!r}")


def _failure(name: str, trajs: Sequence[trajectory_pb2.Trajectory], exc: Exception) -> ComponentFailed:
    """The component's failure, naming it and the trajectories (a batch: the first few)."""
    ids = ", ".join(repr(t.trajectory_id) for t in trajs[:3]) + (", ..." if len(trajs) > 3 else "")
    which = f"trajectory {ids}" if len(trajs) == 1 else f"{len(trajs)} trajectories ({ids})"
    return ComponentFailed(name, f"reward component {name!r} failed on {which}: {type(exc).__name__}: {exc}")


def _turn_values(name: str, fn: RewardFunction, trajs: Sequence[trajectory_pb2.Trajectory]) -> list[list[float]]:
    """A process reward's turn scores of each trajectory, checked to be one per turn."""
    try:
        scores = [[float(v) for v in row] for row in fn.score_turns_batch(trajs)]
    except Exception as exc:
        raise _failure(name, trajs, exc) from exc
    if len(scores) != len(trajs):
        raise ComponentFailed(
            name, f"reward component {name!r} gave turn scores for {len(scores)} of {len(trajs)} trajectories"
        )
    for traj, row in zip(trajs, scores):
        if len(row) != len(traj.turns):
            raise ComponentFailed(
                name,
                f"reward component {name!r} gave {len(row)} turn scores for trajectory {traj.trajectory_id!r} "
                f"of {len(traj.turns)} turns",
            )
    return scores


def _values(name: str, fn: RewardFunction, trajs: Sequence[trajectory_pb2.Trajectory]) -> list[float]:
    """The component's scores of `trajs`."""
    try:
        return [float(v) for v in fn.score_batch(trajs)]
    except Exception as exc:
        raise _failure(name, trajs, exc) from exc
