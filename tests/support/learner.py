"""The learner config that trainer tests compare runs under, and step metrics without their timings."""

from services.common.config import TrainConfig


def untimed(metrics):
    """Metrics without the wall-clock phase timings, which differ from run to run."""
    return {k: v for k, v in metrics.items() if not k.startswith("time/")}


def make_config(learner=None, **algorithm):
    """A CPU learner, seed 1, groups of 4; `learner` and `algorithm` settings on top."""
    return TrainConfig.model_validate(
        {
            "seed": 1,
            "rollout": {"group_size": 4},
            "learner": {"device": "cpu", **(learner or {})},
            "algorithm": {"lr": 3e-3, "micro_batch_size": 3, "entropy_coeff": 0.01, **algorithm},
        }
    )
