"""Where the services listen, read from the kernel: the env service, the reward service (gRPC and metrics
ports) and the job API started as real processes bind loopback by default, the address in $OMRL_BIND_HOST
when it is set, and `--host` over both. 127.0.0.2 and 127.0.0.3 stand for "some other address" (both are
loopback on Linux, so nothing is opened to the network). The rollout server and the learner load a model
before they listen: tests/unit/test_bind_addresses.py checks theirs."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from services.common.grpc_server import BIND_HOST_ENV, free_port

pytestmark = [pytest.mark.faults]
ROOT = Path(__file__).resolve().parents[2]
CASES = {
    "default": (None, None, "127.0.0.1"),
    "env": ("127.0.0.2", None, "127.0.0.2"),
    "flag over env": ("127.0.0.2", "127.0.0.3", "127.0.0.3"),
}
"""case -> ($OMRL_BIND_HOST, --host, the address every listening socket must have)"""


def command(service: str, tmp: Path) -> tuple[list[str], set[int], dict[str, str]]:
    """The service's command line, the ports it must listen on, and its environment."""
    port, metrics = free_port(), free_port()
    if service == "jobs":
        env = {"OMRL_API_TOKEN": "t", "OMRL_API_DB": str(tmp / "jobs.sqlite"), "OMRL_API_OUTPUT_DIR": str(tmp)}
        return ["-m", "services.jobs", "--port", str(port)], {port}, env
    return ["-m", f"services.{service}", "--port", str(port), "--metrics-port", str(metrics)], {port, metrics}, {}


def listening(pid: int) -> dict[int, str]:
    """port -> IPv4 address of every TCP socket the process listens on (gRPC's dual-stack sockets give it
    v4-mapped: ::ffff:127.0.0.1)."""
    try:
        conns = psutil.Process(pid).net_connections(kind="tcp")
    except psutil.NoSuchProcess:
        return {}
    return {c.laddr.port: c.laddr.ip.removeprefix("::ffff:") for c in conns if c.status == psutil.CONN_LISTEN}


@pytest.mark.parametrize("service", ["envs", "reward", "jobs"])
def test_every_listening_socket_is_on_the_chosen_address(service, tmp_path):
    started = []
    try:
        for case, (env_host, flag, expected) in CASES.items():
            args, ports, env = command(service, tmp_path / case.replace(" ", "-"))
            env = {**os.environ, **env, "PYTHONPATH": str(ROOT)}
            env.pop(BIND_HOST_ENV, None)
            if env_host:
                env[BIND_HOST_ENV] = env_host
            log = tmp_path / f"{case}.log"
            with log.open("wb") as out:
                proc = subprocess.Popen(
                    [sys.executable, *args, *(["--host", flag] if flag else [])],
                    env=env,
                    cwd=ROOT,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            started.append((case, proc, ports, expected, log))
        deadline = time.monotonic() + 60
        for case, proc, ports, expected, log in started:
            while not ports <= listening(proc.pid).keys():
                assert proc.poll() is None, f"{service} ({case}) exited:\n{log.read_text()[-2000:]}"
                assert time.monotonic() < deadline, f"{service} ({case}) never listened on {ports}"
                time.sleep(0.1)
            assert set(listening(proc.pid).values()) == {expected}, (case, listening(proc.pid))
    finally:
        for _, proc, *_ in started:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        for _, proc, *_ in started:
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
