"""The python toolset against the sandbox server (services/envs/sandbox_server.py) started as a real process on a
free port: code runs there, an episode's files persist across its calls and stay apart from other episodes', the
bearer token is required, and the wall clock is the server's too."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from services.common.grpc_server import free_port
from services.envs.tools.base import ToolContext, ToolError
from services.envs.tools.python import Python, PythonOptions

ROOT = Path(__file__).resolve().parents[2]
TOKEN_ENV = "OMRL_TEST_SANDBOX_TOKEN"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    if shutil.which("bwrap") is None:
        pytest.skip("the sandbox server's default isolation needs bwrap (scripts/setup.sh installs bubblewrap)")
    port = free_port()
    root = Path("/tmp") / f"omrl-sandbox-test-{port}"  # under /tmp: a root server's sandbox uid must pass through
    log = tmp_path_factory.mktemp("sandbox") / "server.log"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMRL_SANDBOX_TOKEN": "s3cret"}
    env.pop("OMRL_BIND_HOST", None)
    # a CPU-bound call must reach its 1 s of CPU before the wall clock's end on a loaded machine: with 2 s, beside
    # a busy process and the other xdist worker, it got less than half a core and the wall clock came first
    options = json.dumps({"cpu_s": 1, "wall_s": 6})
    args = ["--port", str(port), "--options", options, "--workspace-root", str(root), "--log-level", "warning"]
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "services.envs.sandbox_server", *args], env=env, stdout=out, stderr=out
        )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, log.read_text()
            try:
                if httpx.get(f"{url}/healthz", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.1)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        shutil.rmtree(root, ignore_errors=True)


def run(url: str, calls: list[tuple[str, str]], token: str = "s3cret") -> list:
    """Answers (or ToolErrors) of (episode id, code) calls made in turn through a remote python toolset."""

    async def go():
        os.environ[TOKEN_ENV] = token
        tool = Python(PythonOptions(endpoint=url, token_env=TOKEN_ENV, wall_s=10))  # the server's 6 s binds
        await tool.start()
        answers = []
        try:
            for episode, code in calls:
                ctx = ToolContext(episode, Path("/nowhere"), 30)
                try:
                    answers.append(await tool.call("python", {"code": code}, ctx))
                except ToolError as exc:
                    answers.append(exc)
        finally:
            await tool.aclose()
            os.environ.pop(TOKEN_ENV, None)
        return answers

    return asyncio.run(go())


def test_code_runs_on_the_server_with_a_workspace_per_episode(server):
    first, second, other = run(
        server,
        [
            ("e1", "open('note.txt', 'w').write('kept'); print(1+1)"),
            ("e1", "import os; print(os.getcwd(), open('note.txt').read())"),
            ("e2", "import os; print(os.listdir('.'))"),
        ],
    )
    assert first.content.splitlines() == ["exit code 0", "--- stdout ---", "2"] and not first.error
    assert second.content.endswith("/workspace kept")
    assert other.content.endswith("[]")


def test_the_token_is_required(server):
    (answer,) = run(server, [("e1", "print(1)")], token="wrong")
    assert isinstance(answer, ToolError) and answer.kind == "unavailable" and "401" in str(answer)
    assert httpx.post(f"{server}/run", json={"code": "print(1)", "episode_id": "e", "timeout": 1}).status_code == 401


def test_limits_hold_on_the_server(server):
    sleep, loop = run(server, [("e3", "import time; time.sleep(100)"), ("e3", "while True: pass")])
    assert isinstance(sleep, ToolError) and sleep.kind == "timeout"
    assert loop.error and loop.content.startswith("killed by SIGXCPU")
