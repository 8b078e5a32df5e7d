"""A short whole-system run on the learning task: every service a real process (tests/e2e)."""

from __future__ import annotations

import uuid
from pathlib import Path

from services.common.config import TrainConfig, load_config
from services.common.run_state import RunState
from services.launcher.local import LocalRun
from tests.support.learner import LEARNING_TASK

RECIPE = str(Path(__file__).resolve().parents[2] / "configs" / "tiny_model_rl.yaml")


def short_run(model: str, out: Path, name: str, steps: int, *overrides: str) -> tuple[TrainConfig, list[dict]]:
    """`steps` steps of 4 groups of 4 on LEARNING_TASK from `model` (the tiny recipe, one checkpoint at the end),
    `overrides` on top; the run's config and the history its learner reported, every step of it (asserted)."""
    config = load_config(
        RECIPE,
        [
            *LEARNING_TASK,
            f"model.path={model}",
            f"output_dir={out}",
            f"run={name}-{uuid.uuid4().hex[:6]}",
            f"learner.steps={steps}",
            "rollout.groups_per_step=4",
            "rollout.group_size=4",
            "learner.checkpoint_every=1000",
            *overrides,
        ],
    )
    lines: list[str] = []
    try:
        history = LocalRun(config, say=lines.append).run().history
    finally:
        RunState.connect(config).reset()
    assert [m["step"] for m in history] == list(range(1, steps + 1)), "\n".join(lines[-20:])
    return config, history
