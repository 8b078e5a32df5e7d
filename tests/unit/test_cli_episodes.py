"""`omrl episodes`: a local run folder's recorded episodes, filtered and sorted."""

import json

import pytest

from services.cli.main import main
from services.learner.episodes import EpisodeRecorder
from services.learner.trainer import PolicyTrainer
from tests.support.learner import Pieces, recording_config
from tests.support.smoke import synthetic_trajectories


@pytest.fixture(scope="module")
def run_folder(model_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("cli")
    config = recording_config(tmp)
    trainer = PolicyTrainer(config, model_dir)
    trajs = synthetic_trajectories(8, 4, seed=4)
    trainer.train_step(trajs)
    recorder = EpisodeRecorder(config, Pieces())
    recorder.record(4, trainer.step_tokens)
    recorder.record(5, trainer.step_tokens)
    return tmp / "run", trajs


def test_the_last_step_by_default_and_filters_by_success(run_folder, capsys):
    folder, trajs = run_folder
    assert main(["episodes", str(folder), "--filter", "success=false"]) == 0
    out = capsys.readouterr().out
    failed = [t for t in trajs if not t.success]
    assert out.startswith(f"step 5: {len(failed)} of {len(trajs)} recorded episodes")
    assert all(t.trajectory_id in out for t in failed)
    assert not any(t.trajectory_id in out for t in trajs if t.success)


@pytest.mark.parametrize("ascending", [False, True])
def test_sorted_by_reward_as_json(run_folder, capsys, ascending):
    folder, trajs = run_folder
    args = ["--step", "4", "--sort", "reward", "--limit", "3", "--json", *(["--ascending"] if ascending else [])]
    assert main(["episodes", str(folder), *args]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    best = sorted(trajs, key=lambda t: t.reward, reverse=not ascending)[:3]
    assert [r["trajectory_id"] for r in rows] == [t.trajectory_id for t in best]
    assert rows[0]["step"] == 4 and len(rows[0]["advantages"]) == len(rows[0]["token_ids"])


@pytest.mark.parametrize(
    "args, message",
    [
        (["--step", "9"], "step 9 has no recorded episodes"),
        (["--filter", "colour=red"], "--filter 'colour=red': want KEY=VALUE"),
        (["--sort", "length"], "--sort 'length': want one of"),
    ],
)
def test_bad_requests_are_one_line_errors(run_folder, capsys, args, message):
    folder, _ = run_folder
    assert main(["episodes", str(folder), *args]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1


def test_a_folder_without_records_says_so(tmp_path, capsys):
    assert main(["episodes", str(tmp_path)]) == 2
    assert "no recorded episodes" in capsys.readouterr().err
