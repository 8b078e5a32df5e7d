"""The weighted sum of the configured reward functions, with each weighted part kept for logging."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from prometheus_client import CollectorRegistry

from services.common.config import EnvConfig, RewardComponentConfig, RewardConfig
from services.common.protos import trajectory_pb2
from services.common.registry import Registry
from services.reward.base import RewardFunction
from services.reward.reference_scorer import ReferenceScorer
from services.reward.references import References
from services.reward.registry import REWARDS


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
        unknown = sorted(set(components) - set(registry.names()))
        if unknown:
            raise ValueError(f"unknown reward component(s) {', '.join(unknown)}; known: {', '.join(registry.names())}")
        self.components: list[tuple[str, float, RewardFunction]] = []
        for name, spec in components.items():
            spec = RewardComponentConfig.model_validate(spec)
            try:
                fn = registry.create(name, **spec.params)
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

    def score(self, traj: trajectory_pb2.Trajectory) -> tuple[float, dict[str, float]]:
        """(total, {component: weight * value}); the total is the sum of the parts."""
        return self.score_many([traj])[0]

    def score_many(self, trajs: Sequence[trajectory_pb2.Trajectory]) -> list[tuple[float, dict[str, float]]]:
        """`score` of each trajectory, each component given them all at once (`RewardFunction.score_batch`)."""
        parts: list[dict[str, float]] = [{} for _ in trajs]
        for name, weight, fn in self.components:
            batched = type(fn).score_batch is not RewardFunction.score_batch
            values = _values(name, fn, trajs) if batched else [v for t in trajs for v in _values(name, fn, [t])]
            if len(values) != len(trajs):
                raise RuntimeError(f"reward component {name!r} gave {len(values)} scores for {len(trajs)} trajectories")
            for traj, value, out in zip(trajs, values, parts):
                if not math.isfinite(value):
                    raise ValueError(f"reward component {name!r} gave {value} for trajectory {traj.trajectory_id!r}")
                out[name] = weight * value
        return [(sum(p.values()), p) for p in parts]


def _values(name: str, fn: RewardFunction, trajs: Sequence[trajectory_pb2.Trajectory]) -> list[float]:
    """The component's scores of `trajs`; its failure names it and the trajectories (a batch: the first few)."""
    try:
        return [float(v) for v in fn.score_batch(trajs)]
    except Exception as exc:
        ids = ", ".join(repr(t.trajectory_id) for t in trajs[:3]) + (", ..." if len(trajs) > 3 else "")
        which = f"trajectory {ids}" if len(trajs) == 1 else f"{len(trajs)} trajectories ({ids})"
        raise RuntimeError(f"reward component {name!r} failed on {which}: {type(exc).__name__}: {exc}") from exc
