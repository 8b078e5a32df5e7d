"""Training improves an agent: every service a real process (vLLM on CPU, envs, reward, Redis, the FSDP
learner), the tiny model on corridor. PPO with a critic, GRPO, and GRPO with rollout running ahead of the
learner (max_staleness 1) each take the success rate from at most 20% (the starting policy, on 512 held-out tasks)
to at least 80% (the last steps). The three runs start from one model (`learning_tiny_model`), whose success on the
held-out tasks is measured once for the session (`starting_success`)."""

import json
import uuid
from pathlib import Path
from statistics import mean

import pytest

from services.common.config import load_config
from services.common.run_state import RunState
from services.launcher.local import LocalRun
from tests.support.inprocess_rl import held_out_outcomes
from tests.support.learner import LEARNING_TASK
from tests.support.shared_build import build_once

pytestmark = [pytest.mark.slow, pytest.mark.e2e]

TASK = LEARNING_TASK  # corridor, 3 moves for distance 3: 1/8 by chance
RECIPE = str(Path(__file__).resolve().parents[2] / "configs" / "tiny_model_rl.yaml")
"""GRPO, 16 groups of 8 per step, 50 steps, lr 1e-3 (3 warm-up steps, cosine to 1e-4),
2 epochs, clip-higher 0.28, KL loss 0.1, entropy bonus 0.005.

Tuning runs (GRPO, these sizes, lr 1e-3, 2 epochs): with neither clip-higher nor a KL loss the policy
turned deterministic within ~15 steps while following the hint only part of the time and stalled at
50-70%; a KL loss of 0.3 alone plateaued near 65%; clip-higher 0.28 with a KL loss of 0.1 reached
95-100%, with or without this small entropy bonus (0.02 also learned, but filled replies with random
tokens around the action). At constant lr, one PPO run fell from ~100% to ~45% within two steps at
step 38 (likely because whitened GAE advantages of near-constant returns are mostly noise); hence the
cosine decay. With it and this entropy bonus another PPO run stalled at ~50%; 0.02 made PPO learn."""
RUNS = {
    # the entropy bonus that PPO needs lengthened replies in some runs (13 -> 17.5 tokens, around the action):
    # a length penalty from 15 tokens (3 terse turns) keeps them terse
    "ppo": [
        "algorithm.advantage=gae",
        "algorithm.critic_lr=3e-3",
        "algorithm.entropy_coeff=0.02",
        'reward.components={"goal": {"weight": 1.0}, "format": {"weight": 0.1}, '
        '"length_penalty": {"weight": 0.5, "params": {"max_tokens": 15}}}',
    ],
    # 8 groups a step are too few: over seeds 0-2 (`seed=`, tuning runs on a 2-core Xeon) GRPO reached the stop in
    # 33 steps, ended at 71% (failed) and ended at 82%; with 16 it stopped after ~33, 30 and 33 steps
    "grpo": ["algorithm.advantage=grpo"],
    # trained on one-step-old samples (every step, staleness 1), it learns more slowly: with 8 groups it stopped
    # after 49, 43, 52 and 29 steps over seeds 0-3, and one CI run stalled at 30-50% to step 60; with 16, seeds 1
    # and 2 stopped after 54 (at or above the 80% bar from step ~35) and 35
    "grpo_async": ["algorithm.advantage=grpo", "algorithm.max_staleness=1", "learner.steps=60"],
}
START = ["env.validation_tasks=512", "env.validation_temperature=1.0"]
"""The starting policy (v0) plays 512 held-out tasks at the training temperature: a measure apart from the first
steps' batches, and of many episodes for a bound so near the chance rate (64-episode batches gave 19% over steps 1-3
in two tuning runs, against the 20% bar). It is measured once, in-process (`starting_success`: the real env, prompt
format, action parser and reward functions; the policy sampled with torch, seeded and deterministic), not by each
run's rollout: the three runs start from the same model, and a run's own validation of v0 (512 episodes beside its
first step's, 29 s of a 261 s GRPO run on the AMD EPYC of docs/testing.md, c985332) made its first step wait for it.
The rollout's validation in a whole run is tested by tests/e2e/test_prometheus_dashboards.py. Seen: 14.6% in-process
(75 of 512), 14.5-16.7% in the runs' own validations (about 77 successes of 512, sd 8; the bar is 102)."""
FIRST, LAST = 3, 5
"""Steps averaged for the first and the final reply lengths and success rate."""
BAR = 0.80
"""What a run must reach: its success rate over the last LAST steps. A run ends as soon as it does
(`learner.stop_at_success`), which the test then checks on the history the learner reported; a run that never gets
there runs every step and fails. (Stopping above the bar only buys steps: f0fc98c's CI, stopping at 0.85, took 22, 31
and 31 steps; the same curves reach 0.80 at steps 21, 27 and 27. At 0.9, 8d3f96f's took 29, 34 and 38.)"""


@pytest.fixture(scope="session")
def starting_success(tmp_path_factory, learning_tiny_model) -> float:
    """The success rate of `learning_tiny_model` on the 512 held-out tasks (`START`), measured once for the whole
    pytest-xdist run; the test fails here if it is above 20% or not of 512 episodes."""
    config = load_config(RECIPE, [*TASK, *START])

    def measure(folder: Path) -> Path:
        out = folder / "v0.json"
        out.write_text(json.dumps(held_out_outcomes(config, learning_tiny_model)))
        return out

    won = json.loads(build_once(tmp_path_factory, "learning-start", measure).read_text())
    rate = sum(won) / len(won)
    print(f"v0 (held out, in-process): {rate:.1%} of {len(won)} episodes")
    assert len(won) == 512 and rate <= 0.20, rate
    return rate


# one class a run: under pytest-xdist (--dist loadscope, scripts/test.sh) each class is a scope of its own,
# so the three runs, together the longest module, go to whichever worker is free
class TestPpo:
    def test_success_rises_from_at_most_20_to_at_least_80_percent(
        self, learning_tiny_model, starting_success, tmp_path
    ):
        learn("ppo", learning_tiny_model, starting_success, tmp_path)


class TestGrpo:
    def test_success_rises_from_at_most_20_to_at_least_80_percent(
        self, learning_tiny_model, starting_success, tmp_path
    ):
        learn("grpo", learning_tiny_model, starting_success, tmp_path)


class TestGrpoAsync:
    def test_success_rises_from_at_most_20_to_at_least_80_percent(
        self, learning_tiny_model, starting_success, tmp_path
    ):
        learn("grpo_async", learning_tiny_model, starting_success, tmp_path)


def learn(name: str, tiny_model: str, start: float, tmp_path: Path) -> None:
    config = load_config(
        RECIPE,
        [
            *TASK,
            *RUNS[name],
            f"model.path={tiny_model}",
            f"output_dir={tmp_path}",
            f"run=learn-{name}-{uuid.uuid4().hex[:6]}",
            # one checkpoint, at the last step, instead of one a step (0.2-0.4 s each, on the step's critical
            # path): checkpoints change nothing the learner trains on (the same success curve, seen step by
            # step), and the resume tests cover them
            "learner.checkpoint_every=1000",
            f"learner.stop_at_success={BAR}",
            f"learner.stop_window={LAST}",
        ],
    )
    lines: list[str] = []
    run = LocalRun(config, say=lines.append)
    try:
        result = run.run()
    finally:
        RunState.connect(config).reset()
    history = result.history
    assert [m["step"] for m in history] == list(range(1, len(history) + 1)), "\n".join(lines[-20:])
    success = [m["success_rate"] for m in history]
    # the learner's own arithmetic (`_target_reached`): a run it stopped at the bar is at the bar here too
    last = sum(success[-LAST:]) / len(success[-LAST:])
    curve = [round(s, 2) for s in success]
    print(f"{name}: success {start:.0%} (v0, held out) -> {last:.0%} in {len(success)} steps: {curve}")
    assert last >= BAR, success
    lengths = [m["response_len_mean"] for m in history]
    assert mean(lengths[-LAST:]) < 1.3 * mean(lengths[:FIRST]), lengths  # still terse actions, no babble
    if name == "ppo":
        # the critic learns the returns while they vary (late on, success is near 100% and they hardly do)
        assert all("vf_loss" in m for m in history) and max(m["vf_explained_var"] for m in history) > 0.5
    if name == "grpo_async":
        # rollout ran ahead: some steps trained on tokens sampled by the previous policy
        assert max(m["staleness"] for m in history) > 0, [m["staleness"] for m in history]
        assert all(m["policy_version_min"] >= m["step"] - 2 for m in history)  # never older than the bound
        assert "dropped_stale_total" in history[-1]
