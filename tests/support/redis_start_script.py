"""Runs a Redis start script of the deploy files (helm chart, compose) against the local redis-server on a
free port, with the password in REDISCLI_AUTH as those files provide it, to check what the server makes of it."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from services.common.grpc_server import free_port

AVAILABLE = bool(shutil.which("redis-server") and shutil.which("redis-cli"))
PASSWORD = 'p a"s\\s$w`o'  # spaces, quotes, a backslash, shell specials


@dataclass
class Started:
    authed_ping: str
    unauthed_ping: str
    argv: str
    appendonly: str


def start(script: str, data_dir: Path, password: str = PASSWORD) -> Started:
    port = free_port()
    script = script.replace("dir /data", f"dir {data_dir}\nport {port}\nbind 127.0.0.1")
    env = {**os.environ, "REDISCLI_AUTH": password}
    server = subprocess.Popen(["sh", "-c", script], env=env, stdout=subprocess.DEVNULL)
    cli = ["redis-cli", "-p", str(port)]

    def ask(*args: str, authed: bool = True) -> str:
        return subprocess.run(
            [*cli, *args],
            env=env if authed else {**os.environ, "REDISCLI_AUTH": ""},
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()

    try:
        deadline = time.monotonic() + 20
        while (pong := ask("ping")) != "PONG":
            assert time.monotonic() < deadline and server.poll() is None, "redis did not start"
            time.sleep(0.05)
        return Started(
            pong,
            ask("ping", authed=False),
            Path(f"/proc/{server.pid}/cmdline").read_text(),
            ask("config", "get", "appendonly").split()[-1],
        )
    finally:
        server.terminate()
        server.wait(timeout=20)
