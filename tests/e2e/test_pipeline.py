"""Every service as a real process (vLLM engine, Redis, gRPC, FSDP learner): three training steps."""

import asyncio
import uuid

import pytest

from services.common.config import load_config
from services.common.run_state import RunState
from services.common.stream import TrajectoryStream
from services.common.trajectory import decode_batch
from services.launcher.local import LocalRun
from services.rollout.client import GrpcRolloutClient

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
STEPS = 3


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory, warm_tiny_model):
    config = load_config(
        None,
        [
            f"run=e2e-{uuid.uuid4().hex[:8]}",
            f"output_dir={tmp_path_factory.mktemp('runs')}",
            f"learner.steps={STEPS}",
            "rollout.group_size=4",
            "rollout.groups_per_step=2",
            f"model.path={warm_tiny_model}",
            "logging.episodes_per_step=-1",
            "logging.trackers=[jsonl]",
        ],
    )
    lines: list[str] = []
    run = LocalRun(config, say=lines.append)
    state = RunState.connect(config)
    try:
        run.start()
        history = run.follow()
        rollout_status = asyncio.run(GrpcRolloutClient(config.rollout.addresses[0]).status())
    finally:
        exit_codes = {p.name: p.stop() for p in run.processes}
    stream = TrajectoryStream(state.client, state.trajectories_key)
    yield {
        "config": config,
        "history": history,
        "rollout_status": rollout_status,
        "stream": stream,
        "batches": [decode_batch(fields[b"batch"]) for _, fields in state.client.xrange(state.trajectories_key)],
        "exit_codes": exit_codes,
        "lines": lines,
    }
    state.reset()


def test_every_step_ran_and_was_reported(finished_run):
    history = finished_run["history"]
    assert [m["step"] for m in history] == list(range(1, STEPS + 1))
    assert sum("step" in line and "policy v" in line for line in finished_run["lines"]) == STEPS


def test_trajectories_reached_the_learner_through_the_stream(finished_run):
    cfg, batches = finished_run["config"], finished_run["batches"]
    groups = {t.group_id for b in batches for t in b.trajectories}
    assert len(groups) == STEPS * cfg.rollout.groups_per_step
    assert all(
        m["trajectories"] == cfg.rollout.group_size * cfg.rollout.groups_per_step for m in finished_run["history"]
    )


def test_trajectories_hold_model_tokens_with_logprobs_and_masked_env_tokens(finished_run):
    for batch in finished_run["batches"]:
        for traj in batch.trajectories:
            mask, logprobs = list(traj.loss_mask), list(traj.logprobs)
            assert sum(mask) > 0 and mask[: traj.prompt_length] == [0] * traj.prompt_length
            assert all(lp < 0 or lp == 0 and m == 1 for lp, m in zip(logprobs, mask) if m == 1)
            assert any(lp < 0 for lp, m in zip(logprobs, mask) if m == 1)
            assert all(lp == 0.0 for lp, m in zip(logprobs, mask) if m == 0)
            for turn in traj.turns[:-1]:
                assert turn.env_tokens > 0, "every turn but the last is followed by masked observation tokens"


def test_rewards_carry_their_breakdown(finished_run):
    for batch in finished_run["batches"]:
        for traj in batch.trajectories:
            parts = dict(traj.reward_components)
            assert set(parts) == {"goal", "format", "length_penalty"}
            assert traj.reward == pytest.approx(sum(parts.values()))
            assert parts["goal"] == (1.0 if traj.success else 0.0)


def test_the_learner_recorded_every_episode_with_what_it_computed(finished_run):
    from services.learner.episodes import read_step

    folder = finished_run["config"].run_dir
    streamed = {t.trajectory_id: t for b in finished_run["batches"] for t in b.trajectories}
    recorded = [row for step in range(1, STEPS + 1) for row in read_step(folder, step)]
    assert sorted(row["trajectory_id"] for row in recorded) == sorted(streamed)
    for row in recorded:
        traj = streamed[row["trajectory_id"]]
        assert row["token_ids"] == list(traj.token_ids) and row["loss_mask"] == list(traj.loss_mask)
        assert row["rollout_logprobs"] == pytest.approx(list(traj.logprobs))
        assert [t["text"] for t in row["turns"]] == [t.text for t in traj.turns]
        sampled = [i for i, m in enumerate(row["loss_mask"]) if m]
        gap = max(abs(row["learner_logprobs"][i] - row["rollout_logprobs"][i]) for i in sampled)
        assert gap < 1e-3, "the learner scored the tokens the engine sampled, with the same weights"
        group = [t.reward for t in streamed.values() if t.group_id == traj.group_id]
        above = traj.reward - sum(group) / len(group)  # GRPO: every token of a row has its reward's side of the mean
        if abs(above) > 1e-6:
            assert all(row["advantages"][i] * above > 0 for i in sampled)


def test_the_trackers_got_every_step(finished_run):
    import json

    lines = (finished_run["config"].run_dir / "trackers" / "metrics.jsonl").read_text().splitlines()
    logged = [json.loads(line) for line in lines]
    rewards = {m["step"]: m["reward_mean"] for m in finished_run["history"]}
    assert {m["step"]: m["metrics"]["reward_mean"] for m in logged} == pytest.approx(rewards)


def test_turns_are_stamped_with_the_policy_that_sampled_them(finished_run):
    for batch in finished_run["batches"]:
        step = int(batch.trajectories[0].group_id[1:]) // finished_run["config"].rollout.groups_per_step
        assert {t.policy_version for traj in batch.trajectories for t in traj.turns} == {step}


def test_rollout_server_serves_each_pushed_version_with_the_learners_weights(finished_run):
    for m in finished_run["history"]:
        assert len(m["pushes"]) == 1
        push = m["pushes"][0]
        assert push["ok"] and push["policy_version"] == m["step"] and push["checksum"] == m["weights_checksum"]
    status, last = finished_run["rollout_status"], finished_run["history"][-1]
    assert status["policy_version"] == STEPS
    assert status["weights_checksum"] == last["weights_checksum"]
    # same weights, same dtype: the learner's recomputed logprobs match what the engine sampled with
    assert all(abs(m["mismatch_kl"]) < 1e-3 for m in finished_run["history"])


def test_consumer_group_has_nothing_pending(finished_run):
    assert finished_run["stream"].pending_count() == 0
    assert finished_run["stream"].lag() == 0


def test_services_shut_down_gracefully(finished_run):
    codes = finished_run["exit_codes"]
    assert codes["learner"] == 0
    assert all(code == 0 for name, code in codes.items() if name != "learner"), codes
