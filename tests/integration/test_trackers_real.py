"""The experiment trackers against their real libraries (services/learner/trackers): what a short run logs is read
back with each tool's own reader, TensorBoard's event accumulator, the MLflow client, and W&B's offline run files."""

from __future__ import annotations

import json
import struct
import sys
import time

import psutil
import pytest

from services.common.config import TrainConfig
from services.learner.trackers import Trackers

STEPS = {
    1: {"reward_mean": 0.25, "time/score_s": 1.5, "reward/goal": 0.0, "pass@k": 0.5},
    2: {"reward_mean": 0.5, "time/score_s": 1.25, "reward/goal": 1.0, "pass@k": 0.5},
    3: {"reward_mean": 0.75, "time/score_s": 1.0, "reward/goal": 1.0, "pass@k": 1.0},
}
"""Each step's metrics: values a float32 holds exactly (TensorBoard stores float32), and a name MLflow refuses."""
ROWS = [
    {"episode": "g0/0", "reward": 1.0, "turns": 3, "success": True, "text": "go | left\nthen right"},
    {"episode": "g0/1", "reward": 0.0, "turns": 6, "success": False},
]


def log_a_short_run(config: TrainConfig) -> None:
    trackers = Trackers.from_config(config)
    assert trackers.names == config.logging.trackers
    trackers.log_config(config.model_dump(mode="json"))
    for step, metrics in STEPS.items():
        trackers.log_metrics(step, {**metrics, "advantage": "grpo", "histogram": [1.0, 2.0]})
    trackers.log_episodes(3, ROWS)
    trackers.close()
    assert trackers.names == []


def make_config(tmp_path, tracker: str, **logging) -> TrainConfig:
    return TrainConfig(run="trackers-probe", output_dir=str(tmp_path), logging={"trackers": [tracker], **logging})


def test_tensorboard_scalars_and_texts_read_back_with_tensorboards_reader(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    config = make_config(tmp_path, "tensorboard")
    log_a_short_run(config)

    events = EventAccumulator(str(config.run_dir / "trackers" / "tensorboard"), size_guidance={"scalars": 0})
    events.Reload()
    assert sorted(events.Tags()["scalars"]) == sorted(STEPS[1])
    for name in STEPS[1]:
        assert [(event.step, event.value) for event in events.Scalars(name)] == [
            (step, metrics[name]) for step, metrics in STEPS.items()
        ]
    [logged_config] = events.Tensors("config/text_summary")
    assert json.loads(logged_config.tensor_proto.string_val[0].decode()) == config.model_dump(mode="json")
    [table] = events.Tensors("episodes/text_summary")
    assert table.step == 3
    assert table.tensor_proto.string_val[0].decode().splitlines() == [
        "| episode | reward | turns | success | text |",
        "| --- | --- | --- | --- | --- |",
        "| g0/0 | 1.0 | 3 | True | go \\| left<br>then right |",
        "| g0/1 | 0.0 | 6 | False |  |",
    ]


def test_mlflow_run_reads_back_through_the_mlflow_client(tmp_path):
    from mlflow.artifacts import load_dict
    from mlflow.tracking import MlflowClient

    from services.learner.trackers.mlflow_run import mlflow_name

    config = make_config(tmp_path, "mlflow")
    log_a_short_run(config)

    client = MlflowClient(tracking_uri=f"sqlite:///{config.run_dir / 'trackers' / 'mlflow' / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("trackers-probe")
    [run] = client.search_runs([experiment.experiment_id])
    assert run.info.status == "FINISHED"
    assert run.info.artifact_uri.startswith((config.run_dir / "trackers" / "mlflow" / "artifacts").resolve().as_uri())
    assert sorted(run.data.metrics) == sorted(["reward_mean", "time/score_s", "reward/goal", "pass_k"])
    for name in STEPS[1]:
        history = client.get_metric_history(run.info.run_id, mlflow_name(name))
        assert [(metric.step, metric.value) for metric in history] == [
            (step, metrics[name]) for step, metrics in STEPS.items()
        ]
    params = run.data.params
    assert (params["run"], params["algorithm.advantage"], params["logging.trackers"]) == (
        "trackers-probe",
        "grpo",
        '["mlflow"]',
    )
    assert params["env.options"] == "{}"
    artifacts = run.info.artifact_uri
    assert load_dict(f"{artifacts}/config.json") == config.model_dump(mode="json")
    assert load_dict(f"{artifacts}/episodes/step_00000003.json") == {
        "columns": ["episode", "reward", "turns", "success", "text"],
        "data": [["g0/0", 1.0, 3, True, "go | left\nthen right"], ["g0/1", 0.0, 6, False, None]],
    }


def test_mlflow_names_are_ones_mlflow_accepts():
    from services.learner.trackers.mlflow_run import mlflow_name

    assert [mlflow_name(name) for name in ("reward/goal", "time/score_s", "pass@k", "a//b", "/x", "..", "")] == [
        "reward/goal",
        "time/score_s",
        "pass_k",
        "_a__b",
        "__x",
        "_..",
        "_",
    ]


def wandb_records(path) -> list:
    """The records of a W&B offline run's transaction log (`run-*.wandb`), which wandb 0.31 has no public reader for:
    a 7-byte header, then LevelDB log records (a 7-byte header each: CRC, length, kind) in 32 KiB blocks, each
    record's bytes a `wandb_internal_pb2.Record`, possibly split over blocks (kinds first, middle, last)."""
    from wandb.proto import wandb_internal_pb2

    data, block = path.read_bytes(), 32768
    assert data[:4] == b":W&B"
    records, pending, at = [], b"", 7
    while at + 7 <= len(data):
        if block - at % block < 7:  # a block's tail too short for a header is padding
            at += block - at % block
            continue
        _, length, kind = struct.unpack("<IHB", data[at : at + 7])
        pending += data[at + 7 : at + 7 + length]
        at += 7 + length
        if kind in (1, 4):  # full, last
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


@pytest.fixture
def wandb_home(tmp_path, monkeypatch):
    """W&B's own folders (settings, cache, the staging of tables) in tmp_path rather than in the home folder."""
    for variable in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(variable, str(tmp_path / "wandb-home" / variable.lower()))
    monkeypatch.delenv("WANDB_MODE", raising=False)


def wandb_processes() -> list[psutil.Process]:
    return [child for child in psutil.Process().children(recursive=True) if "wandb" in child.name()]


def test_wandb_offline_run_files_hold_the_metrics_config_and_table_and_no_process_is_left(tmp_path, wandb_home):
    config = make_config(tmp_path, "wandb")
    hooks = sys.excepthook, sys.exit
    log_a_short_run(config)
    assert (sys.excepthook, sys.exit) == hooks

    [run_folder] = (config.run_dir / "trackers" / "wandb").glob("offline-run-*")
    [log] = run_folder.glob("run-*.wandb")
    records = wandb_records(log)
    history = {}
    for record in records:
        if record.WhichOneof("record_type") == "history":
            items = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            history[record.history.step.num] = items
    assert sorted(history) == [1, 2, 3]
    for step, metrics in STEPS.items():
        assert {name: history[step][name] for name in metrics} == metrics
    assert "advantage" not in history[1]
    assert history[3]["episodes/_type"] == "table-file"

    updates = {}
    for record in records:
        if record.WhichOneof("record_type") == "config":
            updates.update({item.key: json.loads(item.value_json) for item in record.config.update})
    dumped = config.model_dump(mode="json")
    assert {key: updates[key] for key in dumped} == dumped

    table = json.loads((run_folder / "files" / history[3]["episodes/path"]).read_text())
    assert table["columns"] == ["episode", "reward", "turns", "success", "text"]
    assert table["data"] == [["g0/0", 1.0, 3, True, "go | left\nthen right"], ["g0/1", 0.0, 6, False, None]]

    deadline = time.monotonic() + 30
    while wandb_processes() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert wandb_processes() == []
