"""`python -m services.reward` with rule scorers, over gRPC: reference answers read from the reasoning env's generated
task dataset (both splits), and a task without one counted."""

import asyncio
import json
import os
import subprocess
import sys
import urllib.request
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import yaml

from services.common.config import EnvConfig
from services.common.grpc_server import free_port
from services.envs.datasets import ensure
from services.reward.client import GrpcRewardClient
from tests.support.reward_server import wait_healthy
from tests.support.trajectories import answered

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("reward-rules")
    env = {"name": "reasoning", "data_dir": str(tmp / "data"), "train_tasks": 3, "validation_tasks": 2}
    folder = ensure(EnvConfig(**env))
    answers = {}
    for split in ("train", "validation"):
        for row in pq.read_table(folder / f"{split}.parquet").to_pylist():
            answers[row["task_index"]] = json.loads(row["reward_model"]["ground_truth"])["answer"]
    components = {"exact_match": {"weight": 1.0}, "math_equiv": {"weight": 2.0}}
    (tmp / "config.yaml").write_text(yaml.safe_dump({"env": env, "reward": {"components": components}}))
    port, metrics_port, log = free_port(), free_port(), tmp / "reward.log"
    with log.open("w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "services.reward", "--port", str(port), "--metrics-port", str(metrics_port)]
            + ["--config", str(tmp / "config.yaml")],
            cwd=ROOT,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    address = f"127.0.0.1:{port}"
    try:
        wait_healthy(proc, address, log)
        yield address, metrics_port, log, answers
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def score(address, trajectories):
    async def main():
        async with GrpcRewardClient(address, timeout_s=60) as client:
            return await client.score(trajectories)

    return asyncio.run(main())


def test_right_wrong_and_missing_references(server):
    address, metrics_port, log, answers = server
    assert sorted(answers) == [0, 1, 2, 3, 4]
    batch = [
        answered(0, answers[0], trajectory_id="right"),
        answered(3, f"{answers[3]}.0", trajectory_id="equivalent"),  # a validation task: equal, not the same text
        answered(1, str(int(answers[1]) + 1), trajectory_id="wrong"),
        answered(99, "7", trajectory_id="missing"),
    ]
    scores = score(address, batch)
    assert [s.components for s in scores] == [
        {"exact_match": 1.0, "math_equiv": 2.0},
        {"exact_match": 0.0, "math_equiv": 2.0},
        {"exact_match": 0.0, "math_equiv": 0.0},
        {"exact_match": 0.0, "math_equiv": 0.0},
    ]
    assert [s.total for s in scores] == [3.0, 2.0, 0.0, 0.0]
    score(address, [answered(98, "7")])
    text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5).read().decode()
    for component in ("exact_match", "math_equiv"):
        assert f'omrl_reward_reference_missing_total{{component="{component}"}} 2.0' in text
    lines = log.read_text().splitlines()
    assert sum("exact_match: task 99 has no reference answer" in line for line in lines) == 1
    assert not any("task 98 has no reference answer" in line for line in lines), "logged once per component"
