"""Run folders for the inspector's tests, without a model: episodes built as real trajectories and written by the
learner's own row builder (services.learner.episodes.episode_row), per-token values drawn at random, and the
metrics files a local run leaves (metrics.jsonl at its end, trackers/metrics.jsonl while it runs)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from services.common.trajectory import TrajectoryBuilder
from services.learner.episodes import StepTokens, episode_row, step_file

HOSTILE_TEXT = '<script>alert("x")</script><b>bold</b>'
"""Model text that a page must show as text, never as markup."""
STOP_REASONS = ("done", "max_turns")


def trajectories(step: int, groups: int = 2, group_size: int = 3, seed: int = 0) -> list:
    """Episodes of two envs; the first episode of each group acts invalidly and says HOSTILE_TEXT."""
    rng = random.Random(seed * 1000 + step)
    out = []
    for g in range(groups):
        for i in range(group_size):
            builder = TrajectoryBuilder(
                env=("maze", "corridor")[g % 2], task_index=g, group_id=f"s{step}g{g}", prompt_ids=[1, 2, 3]
            )
            for turn in range(1 + (i % 2)):
                ids = [rng.randrange(4, 60) for _ in range(3)]
                builder.add_model_turn(
                    ids,
                    [-rng.uniform(0.1, 3.0) for _ in ids],
                    policy_version=step,
                    text=HOSTILE_TEXT if i == 0 else f"go {turn}",
                    action="" if i == 0 else "forward",
                    action_valid=i != 0,
                    finish_reason="stop",
                )
                builder.add_observation([rng.randrange(4, 60) for _ in range(2)], env_reward=0.5 * turn)
            traj = builder.finish(env_return=float(i), success=i == group_size - 1, stop_reason=STOP_REASONS[i % 2])
            traj.reward = round(rng.uniform(-1.0, 1.0), 4)
            traj.reward_components.update({"goal": traj.reward, "format": 0.25})
            out.append(traj)
    return out


def write_step(folder: Path, step: int, seed: int = 0) -> list[dict]:
    trajs = trajectories(step, seed=seed)
    width = max(len(t.token_ids) for t in trajs)
    rng = np.random.default_rng(step)

    def table(low: float, high: float) -> np.ndarray:
        return rng.uniform(low, high, size=(len(trajs), width))

    mask = np.zeros((len(trajs), width))
    for i, traj in enumerate(trajs):  # the model's tokens, some rejected as a rollout correction would
        mask[i, : len(traj.loss_mask)] = np.asarray(traj.loss_mask) * (rng.uniform(size=len(traj.loss_mask)) > 0.2)
    tokens = StepTokens(trajs, table(-3, 0), table(-1, 1), table(0, 0.1), mask)
    rows = [
        episode_row(step, t, tokens, i, lambda ids: " ".join(f"t{i}" for i in ids), lambda ids: [f"t{i} " for i in ids])
        for i, t in enumerate(trajs)
    ]
    path = step_file(folder, step)
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), path)
    return rows


def metrics(steps: int, offset: float = 0.0) -> list[dict]:
    return [
        {
            "step": s,
            "reward_mean": round(0.1 * s + offset, 4),
            "success_rate": min(1.0, 0.2 * s),
            "approx_kl": 0.001 * s,
            "response_len_mean": 10.0 + s,
            "step_seconds": 2.0 + 0.1 * s,
        }
        for s in range(1, steps + 1)
    ]


def finished_run(folder: Path, steps: int = 3, offset: float = 0.0) -> dict[int, list[dict]]:
    """A run as the local launcher leaves it when it succeeded; returns the recorded rows by step."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.yaml").write_text(f"learner:\n  steps: {steps}\n")
    (folder / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in metrics(steps, offset)))
    return {s: write_step(folder, s) for s in range(1, steps + 1)}


def live_run(folder: Path, steps: int = 2) -> None:
    """A run in the middle of its steps: only the jsonl tracker's lines, with a step written twice (a restart)."""
    (folder / "trackers").mkdir(parents=True, exist_ok=True)
    lines = [{"step": m["step"], "time": 0.0, "metrics": m} for m in metrics(steps)]
    lines.append({"step": steps, "time": 1.0, "metrics": {**metrics(steps)[-1], "reward_mean": 9.5}})
    (folder / "trackers" / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
