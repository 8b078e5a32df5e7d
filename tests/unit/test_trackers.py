"""The experiment trackers' fan-out (services/learner/trackers/fanout.py) and the JSON lines tracker: a failing tracker
is dropped after one warning, only finite numbers reach the trackers, and no tracker library loads unless chosen."""

import json
import logging
import math
import subprocess
import sys
from pathlib import Path

import numpy as np

from services.common.config import TrainConfig
from services.learner.trackers import Tracker, Trackers
from services.learner.trackers.fanout import plain_row

ROOT = Path(__file__).resolve().parents[2]


class Recording(Tracker):
    """Keeps every call; `fails_at` names the method that raises."""

    def __init__(self, name: str, fails_at: str = "") -> None:
        self.name, self.fails_at, self.calls = name, fails_at, []

    def _record(self, method: str, *args) -> None:
        self.calls.append((method, *args))
        if method == self.fails_at:
            raise RuntimeError(f"{self.name} broke in {method}")

    def log_config(self, config):
        self._record("log_config", config)

    def log_metrics(self, step, metrics):
        self._record("log_metrics", step, metrics)

    def log_episodes(self, step, rows):
        self._record("log_episodes", step, rows)

    def close(self):
        self._record("close")


def test_a_failing_tracker_is_warned_about_once_dropped_and_closed_while_the_others_go_on(caplog):
    broken, healthy = Recording("broken", fails_at="log_metrics"), Recording("healthy")
    trackers = Trackers([broken, healthy])
    with caplog.at_level(logging.WARNING, logger="services.learner.trackers.fanout"):
        trackers.log_config({"run": "r"})
        trackers.log_metrics(1, {"loss": 0.5})
        trackers.log_metrics(2, {"loss": 0.25})
        trackers.log_episodes(2, [{"reward": 1.0}])
        trackers.close()

    assert [record.getMessage() for record in caplog.records] == [
        "tracker broken failed at log_metrics and is dropped (training goes on): RuntimeError: broken broke in "
        "log_metrics"
    ]
    assert broken.calls == [("log_config", {"run": "r"}), ("log_metrics", 1, {"loss": 0.5}), ("close",)]
    assert healthy.calls == [
        ("log_config", {"run": "r"}),
        ("log_metrics", 1, {"loss": 0.5}),
        ("log_metrics", 2, {"loss": 0.25}),
        ("log_episodes", 2, [{"reward": 1.0}]),
        ("close",),
    ]
    assert trackers.names == []


def test_a_tracker_that_cannot_start_is_warned_about_and_left_out(tmp_path, caplog):
    not_a_folder = tmp_path / "run"
    not_a_folder.write_text("a file where the run folder should be")
    config = TrainConfig(run="r", logging={"trackers": ["jsonl"]})
    with caplog.at_level(logging.WARNING, logger="services.learner.trackers.fanout"):
        trackers = Trackers.from_config(config, run_dir=not_a_folder)
    trackers.log_metrics(1, {"loss": 0.5})
    trackers.close()
    assert trackers.names == []
    [message] = [record.getMessage() for record in caplog.records]
    assert message.startswith("tracker jsonl failed at start and is dropped (training goes on): NotADirectoryError")


def test_only_finite_numbers_reach_the_trackers_under_the_names_given():
    tracker = Recording("kept")
    trackers = Trackers([tracker])
    trackers.log_metrics(
        3,
        {
            "reward_mean": 0.5,
            "time/score_s": 2,
            "reward/goal": True,
            "float32": np.float32(1.5),
            "int64": np.int64(7),
            "text": "grpo",
            "list": [1.0, 2.0],
            "dict": {"a": 1.0},
            "none": None,
            "nan": math.nan,
            "inf": -math.inf,
            "past_float": 10**400,
        },
    )
    trackers.log_metrics(4, {"only": "text", "nan": math.nan})  # nothing left: no call
    assert tracker.calls == [
        ("log_metrics", 3, {"reward_mean": 0.5, "time/score_s": 2.0, "reward/goal": 1.0, "float32": 1.5, "int64": 7.0})
    ]
    assert all(type(value) is float for value in tracker.calls[0][2].values())


def test_episode_cells_become_what_every_tracker_stores():
    row = {"text": "a|b", "ok": False, "turns": np.int64(3), "reward": 0.5, "nan": math.nan, "actions": ["l", "r"]}
    assert plain_row(row) == {
        "text": "a|b",
        "ok": False,
        "turns": 3,
        "reward": 0.5,
        "nan": None,
        "actions": "['l', 'r']",
    }


def test_jsonl_writes_what_it_was_given(tmp_path):
    config = TrainConfig(run="r", output_dir=str(tmp_path), logging={"trackers": ["jsonl"]})
    rows = [{"episode": "g0/0", "reward": 1.0, "success": True}, {"episode": "g0/1", "reward": 0.0, "turns": 4}]
    trackers = Trackers.from_config(config)
    assert trackers.names == ["jsonl"]
    trackers.log_config(config.model_dump(mode="json"))
    trackers.log_metrics(1, {"reward_mean": 0.5, "time/score_s": 1.25, "note": "dropped"})
    trackers.log_metrics(2, {"reward_mean": 0.75, "time/score_s": 1.5})
    trackers.log_episodes(2, rows)
    trackers.close()

    folder = tmp_path / "r" / "trackers"
    assert json.loads((folder / "config.json").read_text()) == config.model_dump(mode="json")
    metrics = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    assert [(line["step"], line["metrics"]) for line in metrics] == [
        (1, {"reward_mean": 0.5, "time/score_s": 1.25}),
        (2, {"reward_mean": 0.75, "time/score_s": 1.5}),
    ]
    assert all(isinstance(line["time"], float) for line in metrics)
    [episodes] = [json.loads(line) for line in (folder / "episodes.jsonl").read_text().splitlines()]
    assert (episodes["step"], episodes["rows"]) == (2, rows)


def test_no_tracker_or_only_jsonl_imports_no_tracker_library(tmp_path):
    code = (
        "import sys; from pathlib import Path\n"
        "from services.common.config import TrainConfig\n"
        "from services.learner.trackers import Trackers\n"
        "for chosen in ([], ['jsonl']):\n"
        "    config = TrainConfig(output_dir=sys.argv[1], logging={'trackers': chosen})\n"
        "    trackers = Trackers.from_config(config)\n"
        "    assert trackers.names == chosen, trackers.names\n"
        "    trackers.log_config({'run': 'r'}); trackers.log_metrics(1, {'loss': 0.5})\n"
        "    trackers.log_episodes(1, [{'reward': 1.0}]); trackers.close()\n"
        "heavy = ('torch', 'tensorboard', 'tensorboardX', 'mlflow', 'sqlalchemy', 'wandb')\n"
        "print(sorted(m for m in heavy if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert out.stdout.strip() == "[]", out.stderr
