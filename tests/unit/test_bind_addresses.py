"""Every entry point binds loopback by default, the address in $OMRL_BIND_HOST when it is set, and `--host`
over both. The rollout server and the learner load a model before they listen: their entry points run here
up to the address they are about to bind, with the model, Redis and the servers left out. The env service,
the reward service and the job API are started as real processes in tests/faults/test_bind_addresses.py.
Every place in services/ that opens a listening socket is listed below, so that a new one gets reviewed."""

import re
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from services.common.grpc_server import BIND_HOST_ENV, bind_host

ROOT = Path(__file__).resolve().parents[2]
CASES = [(None, None, "127.0.0.1"), ("127.0.0.2", None, "127.0.0.2"), ("127.0.0.2", "127.0.0.3", "127.0.0.3")]
"""($OMRL_BIND_HOST, --host, the address bound)"""
CASE_IDS = ["default", "env", "flag-over-env"]
LISTENERS = {
    ("services/common/grpc_server.py", "add_insecure_port("): "serve(): every gRPC server, on bind_host()",
    ("services/common/grpc_server.py", "start_http_server("): "serve(): its metrics endpoint, on the same host",
    ("services/common/grpc_server.py", ".bind(("): "free_port(): a probe of a port, closed at once",
    ("services/learner/app.py", "start_http_server("): "the learner's metrics endpoint, on bind_host()",
    ("services/jobs/__main__.py", "uvicorn.run("): "the job API, on bind_host()",
    ("services/envs/sandbox_server.py", "uvicorn.run("): "the python tool's sandbox server, on bind_host(), every "
    "call but /healthz behind its bearer token",
    ("services/cli/inspector.py", ".bind(("): "omrl inspect PATH: the inspector of local run folders, on 127.0.0.1 "
    "only (no token: read-only, this machine's users)",
    ("services/cli/inspector.py", ".listen("): "the same socket",
    ("services/cli/inspector.py", "uvicorn.Server("): "serves on that socket",
    ("services/weightsync/nccl/group.py", "TCPStore("): "the nccl weight push's rendezvous (learner rank 0): torch's "
    "store listens on every address, as it must for the rollout pods that reach it at learner.weight_nccl_host",
}
"""(file, call) -> where it listens and why that is right."""
LISTENING_CALL = re.compile(
    r"add_insecure_port\(|start_http_server\(|uvicorn\.(?:run|Server)\(|\.bind\(\(|TCPStore\(|"
    r"create_server\(|start_server\(|HTTPServer\(|\.listen\("
)


class Bound(Exception):
    """Raised where an entry point is about to bind: args[0] is the address."""


@pytest.fixture
def bind_env(monkeypatch):
    def set_env(host: str | None) -> None:
        if host:
            monkeypatch.setenv(BIND_HOST_ENV, host)
        else:
            monkeypatch.delenv(BIND_HOST_ENV, raising=False)

    return set_env


def argv(name: str, flag: str | None, *args: str) -> list[str]:
    # threads.budget off: the entry points would size this process's thread pools
    return [name, "--threads.budget", "false", *args, *(["--host", flag] if flag else [])]


@pytest.mark.parametrize("env_host,flag,expected", CASES, ids=CASE_IDS)
def test_bind_host(bind_env, env_host, flag, expected):
    bind_env(env_host)
    assert bind_host(flag) == expected


@pytest.mark.parametrize("env_host,flag,expected", CASES, ids=CASE_IDS)
def test_the_rollout_server(monkeypatch, bind_env, env_host, flag, expected):
    from services.rollout import __main__ as entry
    from services.weightsync.credential import PushAuthenticator

    def for_server(cls, host, token):  # the first use of the address, before Redis, the engine and serve()
        raise Bound(host)

    bind_env(env_host)
    monkeypatch.setattr(PushAuthenticator, "for_server", classmethod(for_server))
    monkeypatch.setattr(entry, "setup_logging", lambda *a, **k: None)
    monkeypatch.setattr(sys, "argv", argv("rollout", flag, "--port", "0"))
    with pytest.raises(Bound) as bound:
        entry.main()
    assert bound.value.args[0] == expected


@pytest.mark.parametrize("env_host,flag,expected", CASES, ids=CASE_IDS)
def test_the_learner_metrics_endpoint(monkeypatch, bind_env, env_host, flag, expected):
    from services.learner import __main__ as entry
    from services.learner import app

    def start_http_server(port, addr):
        raise Bound(addr)

    bind_env(env_host)
    monkeypatch.setattr(entry, "setup_logging", lambda *a, **k: None)
    monkeypatch.setattr(app, "PolicyTrainer", lambda *a, **k: None)
    state = SimpleNamespace(client=None, trajectories_key="unused")
    monkeypatch.setattr(app, "RunState", SimpleNamespace(connect=lambda config: state))
    monkeypatch.setattr(app, "TrajectoryStream", lambda *a, **k: None)
    monkeypatch.setattr(app, "register_stream_collector", lambda stream: None)
    monkeypatch.setattr(app, "start_http_server", start_http_server)
    monkeypatch.setattr(sys, "argv", argv("learner", flag, "--model.path", "unused", "--metrics-port", "9"))
    with pytest.raises(Bound) as bound:
        entry.main()
    assert bound.value.args[0] == expected


def test_every_listening_socket_in_services_is_reviewed():
    found = set()
    for path in sorted((ROOT / "services").rglob("*.py")):
        relative = path.relative_to(ROOT).as_posix()
        if not relative.startswith("services/common/gen/"):
            found |= {(relative, m.group()) for m in LISTENING_CALL.finditer(path.read_text())}
    assert found == set(LISTENERS), "a new listening socket: bind it on bind_host(), then list it here"
