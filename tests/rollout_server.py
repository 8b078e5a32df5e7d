"""A real rollout server process (vLLM on CPU, tiny model) for integration and fault tests: started on
a free port with its own run name and push token, ready once gRPC health says SERVING."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import redis

from services.common.grpc_server import free_port, wait_for_health
from services.common.tiny_model import build_tiny_model
from services.rollout.client import GrpcRolloutClient

CORPUS = [
    f"You are in cell {i}. The exit is to the {'left' if i % 2 else 'right'}. <action>left</action>" for i in range(30)
]


@dataclass
class RolloutProcess:
    address: str
    model: Path
    proc: subprocess.Popen
    log: Path
    run: str
    token: str

    def call(self, coro_fn, token: str | None = "default"):
        """Runs `coro_fn(client)` on a fresh client carrying the server's token (or `token`)."""

        async def go():
            client = GrpcRolloutClient(
                self.address, timeout_s=60, weight_token=self.token if token == "default" else token
            )
            try:
                return await coro_fn(client)
            finally:
                await client.close()

        return asyncio.run(go())

    def kill(self) -> None:
        """Stops the server if it still runs and deletes its run's Redis keys."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        client = redis.Redis.from_url("redis://127.0.0.1:6379/0", socket_timeout=5)
        keys = list(client.scan_iter(match=f"omrl:{self.run}:*"))
        if keys:
            client.delete(*keys)


def start_rollout(tmp: Path) -> RolloutProcess:
    model = build_tiny_model(tmp / "model", CORPUS)
    port, run, token = free_port(), f"test-rollout-{uuid.uuid4().hex[:8]}", uuid.uuid4().hex
    log = tmp / "rollout.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "services.rollout",
                "--no-produce",
                "--port",
                str(port),
                "--set",
                f"model.path={model}",
                "--set",
                f"run={run}",
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, "VLLM_LOGGING_LEVEL": "WARNING", "OMRL_WEIGHT_TOKEN": token},
            start_new_session=True,
        )
    server = RolloutProcess(f"127.0.0.1:{port}", model, proc, log, run, token)
    deadline = time.monotonic() + 240
    while True:  # in short waits, so a server that died at start-up fails the test at once
        if proc.poll() is not None:
            server.kill()
            raise AssertionError(f"the rollout server exited {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            asyncio.run(wait_for_health(server.address, timeout_s=min(5.0, max(deadline - time.monotonic(), 0.1))))
            return server
        except TimeoutError:
            if time.monotonic() > deadline:
                server.kill()
                raise AssertionError(log.read_text()[-3000:]) from None
