"""`python -m services.reward` started by a test: waiting for it to serve, and stopping it."""

from __future__ import annotations

import asyncio
import subprocess
import time
from pathlib import Path

import pytest

from services.common.grpc_server import wait_for_health


def wait_healthy(proc: subprocess.Popen, address: str, log: Path) -> None:
    """Until the server at `address` answers its health check; fails the test with its log (the process killed)
    when it exits first or takes over 60 s."""
    deadline = time.monotonic() + 60
    while True:
        if proc.poll() is not None or time.monotonic() > deadline:
            kill(proc)
            pytest.fail(f"reward server did not come up:\n{log.read_text()}")
        try:
            asyncio.run(wait_for_health(address, 1.0, service="openmanus.reward.v1.RewardService"))
            return
        except TimeoutError:
            pass


def kill(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
        proc.wait()
