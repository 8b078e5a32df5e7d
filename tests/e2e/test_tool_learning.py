"""The tiny model learns to use a tool: every service a real process (vLLM on CPU, envs with the calculator,
reward, Redis, the learner), `configs/tool_arith.yaml` (3-digit sums through the tool-calling loop). The
warm-started policy, which calls the calculator with a random operator and copies a number, is right at most 20%
of the time on 512 held-out tasks; GRPO takes it to at least 80% over the last steps, every success through a
calculator call, with hardly any malformed call left."""

import uuid
from pathlib import Path

import pytest

from services.common.config import load_config
from services.common.run_state import RunState
from services.launcher.local import LocalRun
from services.learner.episodes import read_step

pytestmark = [pytest.mark.slow, pytest.mark.e2e]

RECIPE = str(Path(__file__).resolve().parents[2] / "configs" / "tool_arith.yaml")
BAR, LAST = 0.80, 5
"""What the run must reach: its success rate over the last LAST steps (`learner.stop_at_success` ends it there)."""
START_BAR = 0.20
KEY = "validation/tool_arith/success_rate"


def test_tool_use_rises_from_at_most_20_to_at_least_80_percent(tmp_path, record_property):
    config = load_config(
        RECIPE,
        [
            f"output_dir={tmp_path}",
            f"env.data_dir={tmp_path / 'data'}",
            f"run=tool-learn-{uuid.uuid4().hex[:6]}",
            # v0 on 512 held-out tasks at the training temperature, and no validation after it
            "env.validation_tasks=512",
            "env.validation_temperature=1.0",
            "env.validation_every=1000",
            "learner.steps=60",
            "learner.checkpoint_every=1000",
            f"learner.stop_at_success={BAR}",
            f"learner.stop_window={LAST}",
            "logging.episodes_per_step=-1",  # every episode recorded: the test reads their tool calls
        ],
    )
    lines: list[str] = []
    run = LocalRun(config, say=lines.append)
    try:
        result = run.run()
    finally:
        RunState.connect(config).reset()
    start = [v[KEY] for v in run.validations if v["policy_version"] == 0]
    assert len(start) == 1 and start[0] <= START_BAR, (start, lines[-20:])
    success = [m["success_rate"] for m in result.history]
    assert [m["step"] for m in result.history] == list(range(1, len(success) + 1)), "\n".join(lines[-20:])
    last = sum(success[-LAST:]) / len(success[-LAST:])
    curve = [round(s, 2) for s in success]
    record_property("v0", round(start[0], 4))  # in the JUnit report (scripts/test.sh), which xdist leaves visible
    record_property("curve", curve)
    print(f"tool_arith: {start[0]:.1%} (v0, held out) -> {last:.1%} in {len(success)} steps: {curve}")
    assert last >= BAR, curve
    final_steps = range(len(success) - LAST + 1, len(success) + 1)
    episodes = [row for step in final_steps for row in read_step(result.run_dir, step)]
    assert episodes and all(row["tool_calls"] >= 1 for row in episodes if row["success"]), "a success without a call"
    malformed = sum(row["invalid_tool_calls"] > 0 for row in episodes)
    assert malformed <= 0.1 * len(episodes), (malformed, len(episodes))
