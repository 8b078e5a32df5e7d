"""Recorded episodes (services/learner/episodes.py): what the learner computed for each token, bounded on disk."""

import logging

import pytest
import torch

from services.learner.batch import collate
from services.learner.episodes import (
    EpisodeRecorder,
    episode_summary,
    read_step,
    recorded_steps,
    sample,
    step_file,
)
from services.learner.model import token_logprobs
from services.learner.trainer import PolicyTrainer
from tests.support.learner import Pieces, recording_config
from tests.support.smoke import synthetic_trajectories


def test_every_recorded_value_is_what_the_update_used(model_dir, tmp_path):
    config = recording_config(tmp_path)
    trainer = PolicyTrainer(config, model_dir)
    trajs = synthetic_trajectories(8, 4, seed=5)
    batch = collate(trajs, trainer.pad_id)
    with torch.no_grad():
        before = token_logprobs(trainer.model, batch.input_ids, batch.attention_mask)
    used = {}
    estimate = trainer.estimator.advantages_and_returns

    def spy(inputs):
        used["advantages"], returns = estimate(inputs)
        used["token_rewards"] = inputs.token_rewards
        return used["advantages"], returns

    trainer.estimator.advantages_and_returns = spy
    trainer.train_step(trajs)

    rows = EpisodeRecorder(config, Pieces()).record(3, trainer.step_tokens)
    assert rows == read_step(tmp_path / "run", 3)
    assert [r["trajectory_id"] for r in rows] == [t.trajectory_id for t in trajs]
    for i, (row, traj) in enumerate(zip(rows, trajs)):
        n = len(traj.token_ids)
        used_n = batch.attention_mask[i].sum().item()
        assert row["token_ids"] == list(traj.token_ids) and row["loss_mask"] == list(traj.loss_mask)
        assert row["rollout_logprobs"] == pytest.approx(list(traj.logprobs))
        assert row["learner_logprobs"][:used_n] == pytest.approx(before[i, :used_n].tolist(), abs=1e-5)
        assert row["advantages"][:used_n] == pytest.approx(used["advantages"][i, :used_n].tolist())
        assert row["token_rewards"][:used_n] == pytest.approx(used["token_rewards"][i, :used_n].tolist())
        assert all(len(row[key]) == n for key in ("learner_logprobs", "advantages", "token_rewards", "token_text"))
        assert row["token_text"][:2] == [f"<{traj.token_ids[0]}>", f"<{traj.token_ids[1]}>"]
        assert (row["step"], row["group_id"], row["reward"], row["success"]) == (
            3,
            traj.group_id,
            pytest.approx(traj.reward),
            traj.success,
        )
        assert [t["policy_version"] for t in row["turns"]] == [t.policy_version for t in traj.turns]
        first = traj.turns[0]
        after = first.start + first.model_tokens
        assert row["turns"][0]["observation"] == Pieces().decode(traj.token_ids[after : after + first.env_tokens])
        assert row["prompt"] == Pieces().decode(traj.token_ids[: traj.prompt_length])


def test_the_loss_mask_is_the_rollout_corrections_where_it_rejects_tokens(model_dir, tmp_path):
    config = recording_config(tmp_path, rollout_is_mode="mask", tis_cap=1.5)
    trainer = PolicyTrainer(config, model_dir)
    trajs = synthetic_trajectories(8, 4, seed=6)
    metrics = trainer.train_step(trajs)
    rows = EpisodeRecorder(config, Pieces()).record(1, trainer.step_tokens)
    kept = sum(sum(r["loss_mask"]) for r in rows)
    sampled = sum(sum(t.loss_mask) for t in trajs)
    assert 0 < kept < sampled, metrics  # random rollout logprobs: some tokens pass the bound, some do not


def test_a_sample_is_whole_groups_in_batch_order():
    trajs = synthetic_trajectories(10, 4, seed=1)  # groups of 4, 4, 2
    assert sample(trajs, 0) == []
    assert sample(trajs, 3) == [0, 1, 2, 3]  # at least one group
    assert sample(trajs, 8) == list(range(8))
    assert sample(trajs, 9) == list(range(8))
    assert sample(trajs, -1) == list(range(10))


def recorded_tokens(model_dir, tmp_path, config):
    trainer = PolicyTrainer(config, model_dir)
    trainer.train_step(synthetic_trajectories(8, 4, seed=2))
    return trainer.step_tokens


def test_old_steps_are_deleted_past_the_byte_limit(model_dir, tmp_path):
    config = recording_config(tmp_path)
    tokens = recorded_tokens(model_dir, tmp_path, config)
    recorder = EpisodeRecorder(config, Pieces())
    recorder.record(1, tokens)
    one = step_file(recorder.folder, 1).stat().st_size
    recorder.max_bytes = int(2.5 * one)
    for step in range(2, 7):
        recorder.record(step, tokens)
        files = list((recorder.folder / "episodes").glob("*"))
        assert sum(f.stat().st_size for f in files) <= recorder.max_bytes
    assert recorded_steps(recorder.folder) == [5, 6]
    with pytest.raises(FileNotFoundError, match=r"step 2 has no recorded episodes .* \(recorded: steps 5..6\)"):
        read_step(recorder.folder, 2)


def test_a_failed_write_is_logged_once_and_training_goes_on(model_dir, tmp_path, caplog):
    config = recording_config(tmp_path)
    tokens = recorded_tokens(model_dir, tmp_path, config)
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "episodes").write_text("a file where the folder goes")
    recorder = EpisodeRecorder(config, Pieces())
    with caplog.at_level(logging.WARNING):
        assert recorder.record(1, tokens) == [] and recorder.record(2, tokens) == []
    assert len([r for r in caplog.records if "not recorded" in r.getMessage()]) == 1


def test_nothing_is_gathered_or_written_when_recording_is_off(model_dir, tmp_path):
    config = recording_config(tmp_path, episodes=0)
    trainer = PolicyTrainer(config, model_dir)
    trainer.train_step(synthetic_trajectories(8, 4, seed=2))
    assert trainer.step_tokens is None
    assert EpisodeRecorder(config, Pieces()).record(1, trainer.step_tokens) == []
    assert not (tmp_path / "run").exists()


def test_an_episode_summary_is_flat_and_reads_as_a_transcript(model_dir, tmp_path):
    config = recording_config(tmp_path, episodes=4)
    rows = EpisodeRecorder(config, Pieces()).record(1, recorded_tokens(model_dir, tmp_path, config))
    summary = episode_summary(rows[0])
    assert all(isinstance(v, (str, int, float, bool)) for v in summary.values())
    assert summary["model_tokens"] == sum(rows[0]["loss_mask"])
    assert summary["transcript"].startswith(rows[0]["prompt"]) and "[turn 1:" in summary["transcript"]
