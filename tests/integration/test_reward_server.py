"""`python -m services.reward` as a real process, reached through GrpcRewardClient."""

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import time
import urllib.request
from pathlib import Path

import pytest
import yaml

from services.common.config import load_config
from services.common.errors import DeadlineExceeded, Internal, InvalidArgument, Unavailable
from services.common.grpc_server import free_port
from services.reward.client import GrpcRewardClient
from services.reward.composer import RewardComposer
from services.reward.registry import REWARDS
from tests.support.reward_server import kill, wait_healthy
from tests.support.service_fakes import trajectory

ROOT = Path(__file__).resolve().parents[2]
GRACE_S = 3.0
TEST_REWARDS = """
import time
from services.reward.base import RewardFunction
from services.reward.registry import REWARDS

@REWARDS.register("tripwire")
class Tripwire(RewardFunction):
    name = "tripwire"
    def __call__(self, traj):
        if traj.env == "explode":
            raise RuntimeError("tripped")
        if traj.env == "slow":
            time.sleep(1.5)
        return 0.25
"""
CONFIG = {
    "reward": {
        "timeout_s": 0.5,
        "components": {
            "goal": {"weight": 1.0},
            "format": {"weight": 0.5},
            "length_penalty": {"weight": 0.2, "params": {"max_tokens": 4}},
            "tripwire": {"weight": 2.0},
            "hinted_action": {"weight": 0.5, "params": {"hints": {"go left": "left"}, "mismatch": -1.0}},
        },
    }
}


def start(tmp: Path, *args: str) -> tuple[subprocess.Popen, str, Path]:
    (tmp / "omrl_test_rewards.py").write_text(textwrap.dedent(TEST_REWARDS))
    port = free_port()
    log = tmp / f"reward-{port}.log"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(tmp)])}
    with log.open("w") as out:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "services.reward",
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--import",
                "omrl_test_rewards",
                "--grace-s",
                str(GRACE_S),
                *args,
            ],
            cwd=ROOT,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    return proc, f"127.0.0.1:{port}", log


def terminate(proc: subprocess.Popen, log: Path) -> tuple[int, float]:
    start_time = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(timeout=GRACE_S), time.monotonic() - start_time
    except subprocess.TimeoutExpired:
        kill(proc)
        pytest.fail(f"reward server ignored SIGTERM for {GRACE_S}s:\n{log.read_text()}")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("reward")
    config = tmp / "config.yaml"
    config.write_text(yaml.safe_dump(CONFIG))
    metrics_port = free_port()
    proc, address, log = start(tmp, "--config", str(config), "--metrics-port", str(metrics_port))
    wait_healthy(proc, address, log)
    yield address, metrics_port, log
    if proc.poll() is None:
        terminate(proc, log)


def score(address: str, trajectories, **kwargs):
    async def main():
        async with GrpcRewardClient(address, timeout_s=10, **kwargs) as client:
            return await client.score(trajectories)

    return asyncio.run(main())


def test_scores_match_the_in_process_composer(server, tmp_path):
    address, _, log = server
    assert f"reward listening on {address}" in log.read_text()
    batch = [
        trajectory((2, True), (5, False), success=True, trajectory_id="a"),
        trajectory((9, True), trajectory_id="b"),
        trajectory(trajectory_id="c"),
    ]
    for turn in batch[0].turns:
        turn.anchor = "You are in cell 2: go left."
    scores = score(address, batch)
    assert scores[0][1] == pytest.approx(
        {"goal": 1.0, "format": 0.25, "length_penalty": -0.15, "tripwire": 0.5, "hinted_action": 0.0}
    )
    assert scores[0][0] == pytest.approx(1.6)
    assert [s.turns for s in scores] == [[0.5, -0.5], [0.0], []]  # the process reward of each turn
    sys.path.insert(0, str(log.parent))
    try:
        import omrl_test_rewards  # noqa: F401  (registers "tripwire" here too)

        composer = RewardComposer.from_config(load_config(str(log.parent / "config.yaml")).reward)
    finally:
        sys.path.remove(str(log.parent))
        sys.modules.pop("omrl_test_rewards", None)
        REWARDS.unregister("tripwire")
    expected = [composer.score(traj) for traj in batch]
    for (total, parts, turns), (want_total, want_parts, want_turns) in zip(scores, expected):
        assert total == pytest.approx(want_total) and parts == pytest.approx(want_parts) and turns == want_turns
    assert score(address, []) == []


def test_large_batches_are_split(server):
    batch = [trajectory((200, True), trajectory_id=str(i)) for i in range(20)]
    scores = score(server[0], batch, max_request_bytes=2000)
    assert len(scores) == 20 and all(s.components["format"] == 0.5 for s in scores)


def test_error_status_codes(server):
    address = server[0]
    with pytest.raises(Internal, match="component 'tripwire' failed on trajectory 'x': RuntimeError: tripped"):
        score(address, [trajectory(), trajectory(trajectory_id="x", env="explode")])
    with pytest.raises(DeadlineExceeded, match="took over 0.5s"):
        score(address, [trajectory(env="slow")])
    broken = trajectory((2, True))
    broken.logprobs[0] = -3.0
    with pytest.raises(InvalidArgument, match="logprob on a non-model token"):
        score(address, [broken])
    with pytest.raises(Unavailable):
        score(f"127.0.0.1:{free_port()}", [trajectory()])


def test_metrics_endpoint(server):
    address, metrics_port, _ = server
    score(address, [trajectory((1, True))])
    text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5).read().decode()
    assert 'omrl_reward_component_score_count{component="tripwire"}' in text
    assert "omrl_reward_score_seconds_bucket" in text
    assert 'omrl_reward_grpc_requests_total{code="OK",method="/openmanus.reward.v1.RewardService/Score"}' in text


def test_bad_config_fails_at_startup(tmp_path):
    proc, _, log = start(tmp_path, "--set", "reward.components.nope.weight=1")
    assert proc.wait(timeout=30) == 2
    # the server's registry holds the built-ins and the test plugin's tripwire, as this process's does
    known = ", ".join(sorted({*REWARDS.names(), "tripwire"}))
    assert f"reward.components.nope: 'nope' is not one of: {known}" in log.read_text()


def test_sigterm_exits_zero_within_grace(tmp_path):
    proc, address, log = start(tmp_path)
    wait_healthy(proc, address, log)
    assert score(address, [trajectory((1, True), success=True)])[0][0] == pytest.approx(1.1)
    rc, elapsed = terminate(proc, log)
    assert rc == 0 and elapsed < GRACE_S
