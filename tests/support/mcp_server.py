"""A small real MCP server (the SDK's `MCPServer`, FastMCP in mcp 1.x) for the `mcp` toolset's tests.

`python tests/support/mcp_server.py` serves over stdio; `--http --port N` serves streamable HTTP at
`http://127.0.0.1:N/mcp`. Tools: `add`, `echo`, `fail` (an isError result carrying its message), `slow` (sleeps),
`pid` (the server's process id, so a test can check the process is gone); `--drop NAME` leaves a tool out, as a
server restarted in a new version might."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os

from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.exceptions import ToolError

server = MCPServer("omrl-test")


@server.tool()
def add(a: int, b: int) -> int:
    """Adds two integers."""
    return a + b


@server.tool()
def echo(text: str) -> str:
    """Returns the text unchanged."""
    return text


@server.tool()
def fail(message: str) -> str:
    """Always fails with the message."""
    # the SDK's ToolError reaches the client with its message; any other exception only as "Error executing tool"
    raise ToolError(message)


@server.tool()
async def slow(seconds: float) -> str:
    """Sleeps, then says so."""
    await asyncio.sleep(seconds)
    return f"slept {seconds}"


@server.tool()
def pid() -> int:
    """This server's process id."""
    return os.getpid()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--http", action="store_true")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--drop", action="append", default=[])
    args = parser.parse_args()
    for name in args.drop:
        server.remove_tool(name)
    # per-request INFO lines would bury a failing test's output
    logging.getLogger().setLevel(logging.WARNING)
    if args.http:
        server.run("streamable-http", host="127.0.0.1", port=args.port)
    else:
        server.run()


if __name__ == "__main__":
    main()
