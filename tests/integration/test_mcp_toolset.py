"""The `mcp` toolset against a real MCP server (tests/support/mcp_server.py), over stdio and streamable HTTP:
listing, calls and their failures, concurrency, and surviving a server restart."""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from pydantic import ValidationError

from services.common.grpc_server import free_port
from services.envs.tools import TOOLSETS, ToolContext, ToolError, ToolOutput
from services.envs.tools.mcp import McpOptions, McpToolset
from tests.support.processes import alive

SERVER = Path(__file__).resolve().parents[1] / "support" / "mcp_server.py"


def _ctx(tmp_path: Path, time_left: float = 10.0) -> ToolContext:
    return ToolContext("episode-1", tmp_path, time_left)


def test_options_are_checked_per_transport():
    assert TOOLSETS.get("mcp") is McpToolset
    McpOptions(transport="stdio", command=["server"])
    McpOptions(transport="http", url="https://example.org/mcp", headers={"Authorization": "Bearer x"})
    for bad in (
        {"transport": "stdio"},
        {"transport": "stdio", "command": ["server"], "url": "http://localhost/mcp"},
        {"transport": "http"},
        {"transport": "http", "url": "localhost:8000/mcp"},
        {"transport": "http", "url": "http://localhost/mcp", "command": ["server"]},
        {"transport": "http", "url": "http://localhost/mcp", "retries": 3},
        {"transport": "sse", "url": "http://localhost/mcp"},
    ):
        with pytest.raises(ValidationError):
            McpOptions(**bad)


def test_stdio_server_lists_calls_times_out_and_stops(tmp_path):
    async def scenario() -> int:
        options = McpOptions(transport="stdio", command=[sys.executable, str(SERVER)], prefix="srv_", timeout_s=5)
        toolset = McpToolset(options)
        await toolset.start()
        try:
            specs = {spec.name: spec for spec in toolset.specs()}
            assert set(specs) == {"srv_add", "srv_echo", "srv_fail", "srv_slow", "srv_pid"}
            assert set(specs["srv_add"].parameters["properties"]) == {"a", "b"}
            assert specs["srv_add"].parameters["properties"]["a"]["type"] == "integer"
            assert set(specs["srv_slow"].parameters["required"]) == {"seconds"}
            assert specs["srv_echo"].description

            assert await toolset.call("srv_add", {"a": 2, "b": 3}, _ctx(tmp_path)) == ToolOutput("5")
            failed = await toolset.call("srv_fail", {"message": "boom"}, _ctx(tmp_path))
            assert failed.error and "boom" in failed.content
            with pytest.raises(ToolError) as refused:
                await toolset.call("add", {"a": 1, "b": 1}, _ctx(tmp_path))
            assert refused.value.kind == "refused"

            began = time.monotonic()
            with pytest.raises(ToolError) as timed_out:
                await toolset.call("srv_slow", {"seconds": 10}, _ctx(tmp_path, time_left=0.5))
            assert timed_out.value.kind == "timeout" and time.monotonic() - began < 2

            sums = await asyncio.gather(
                *(toolset.call("srv_add", {"a": i, "b": 1}, _ctx(tmp_path)) for i in range(16)),
                toolset.call("srv_slow", {"seconds": 0.3}, _ctx(tmp_path)),
            )
            assert [out.content for out in sums] == [str(i + 1) for i in range(16)] + ["slept 0.3"]

            first = int((await toolset.call("srv_pid", {}, _ctx(tmp_path))).content)
            subprocess.run(["kill", "-9", str(first)], check=True)
            # the server died: the next call starts a new one and is served
            assert await toolset.call("srv_echo", {"text": "again"}, _ctx(tmp_path)) == ToolOutput("again")
            second = int((await toolset.call("srv_pid", {}, _ctx(tmp_path))).content)
            assert second != first and alive(second)
        finally:
            await toolset.aclose()
        return second

    pid = asyncio.run(scenario())
    assert not alive(pid)


class _HttpServer:
    """tests/support/mcp_server.py over HTTP on one port, started and stopped by PID."""

    def __init__(self, port: int, log: Path):
        self.port = port
        self.log = log
        self.proc: subprocess.Popen | None = None

    def start(self, *extra: str) -> None:
        with self.log.open("a") as out:
            argv = [sys.executable, str(SERVER), "--http", "--port", str(self.port), *extra]
            self.proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.5).close()
                return
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.kill()
                    pytest.fail(f"MCP server did not come up:\n{self.log.read_text()}")
                time.sleep(0.1)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture
def http_server(tmp_path):
    server = _HttpServer(free_port(), tmp_path / "mcp_server.log")
    server.start()
    try:
        yield server
    finally:
        server.kill()


def test_http_server_restart_is_survived(http_server, tmp_path):
    async def scenario() -> None:
        url = f"http://127.0.0.1:{http_server.port}/mcp"
        options = McpOptions(transport="http", url=url, include=["add", "echo", "pid"], timeout_s=5)
        toolset = McpToolset(options)
        await toolset.start()
        try:
            assert {spec.name for spec in toolset.specs()} == {"add", "echo", "pid"}
            assert await toolset.call("add", {"a": 2, "b": 3}, _ctx(tmp_path)) == ToolOutput("5")

            http_server.kill()
            http_server.start("--drop", "echo")
            # several calls find the session gone at once: they share one reconnect and are all served
            sums = await asyncio.gather(*(toolset.call("add", {"a": i, "b": 40}, _ctx(tmp_path)) for i in range(6)))
            assert [out.content for out in sums] == [str(i + 40) for i in range(6)]
            assert int((await toolset.call("pid", {}, _ctx(tmp_path))).content) == http_server.proc.pid
            with pytest.raises(ToolError, match="echo") as vanished:
                await toolset.call("echo", {"text": "x"}, _ctx(tmp_path))
            assert vanished.value.kind == "refused"

            http_server.kill()
            began = time.monotonic()
            with pytest.raises(ToolError) as down:
                await toolset.call("add", {"a": 1, "b": 1}, _ctx(tmp_path, time_left=1.5))
            assert down.value.kind == "unavailable" and time.monotonic() - began < 2.5
        finally:
            await toolset.aclose()

    asyncio.run(scenario())
