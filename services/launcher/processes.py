"""Child processes of a local run: started with their logs in files, stopped by PID."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from services.common.grpc_server import wait_for_health

SHARED_MEMORY = Path("/dev/shm")
"""Where Python's `SharedMemory` segments live (`psm_*`): vLLM's engine core and worker queues, 100s of MB each."""


@dataclass
class ServiceProcess:
    name: str
    args: list[str]
    log_path: Path
    health_address: str | None = None
    env: dict[str, str] = field(default_factory=dict)
    popen: subprocess.Popen | None = None

    def start(self) -> ServiceProcess:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **self.env}
        # own process group: stopping the service also stops the engine workers it spawned
        with open(self.log_path, "ab") as log:
            self.popen = subprocess.Popen(
                self.args, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )
        return self

    @property
    def pid(self) -> int:
        return self.popen.pid

    def running(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except FileNotFoundError:
            return ""

    def wait_healthy(self, timeout_s: float, on_wait: Callable[[float], None] | None = None) -> float:
        """Seconds it took; `on_wait(elapsed)` is called about every 5 s while the service is not serving yet."""
        start = time.monotonic()
        deadline = start + timeout_s
        while self.health_address:
            if not self.running():
                raise RuntimeError(f"{self.name} exited with {self.popen.returncode}:\n{self.log_tail()}")
            try:
                asyncio.run(wait_for_health(self.health_address, min(5.0, max(deadline - time.monotonic(), 0.1))))
                break
            except TimeoutError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{self.name} not healthy after {timeout_s:.0f}s:\n{self.log_tail()}") from None
                if on_wait is not None:
                    on_wait(time.monotonic() - start)
        return time.monotonic() - start

    def stop(self, grace_s: float = 30.0) -> int | None:
        """SIGTERM to the service itself (it shuts its own workers down in order), SIGKILL to its whole
        process group if it is still running after the grace period, and to any worker it left."""
        if self.popen is None:
            return None
        if self.popen.poll() is None:
            try:
                self.popen.send_signal(signal.SIGTERM)
                self.popen.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                pass
        kill_group(self.popen.pid)
        return self.popen.wait(timeout=10.0)


def group_shared_memory(pgid: int) -> set[Path]:
    """The `SharedMemory` segments the processes of group `pgid` map."""
    found: set[Path] = set()
    for proc in psutil.process_iter():
        try:
            if os.getpgid(proc.pid) != pgid:
                continue
            maps = Path(f"/proc/{proc.pid}/maps").read_text()
        except (OSError, psutil.Error):
            continue
        for line in maps.splitlines():
            fields = line.split(maxsplit=5)
            if len(fields) == 6 and fields[5].startswith(f"{SHARED_MEMORY}/psm_"):
                found.add(Path(fields[5].removesuffix(" (deleted)")))
    return found


def kill_group(pgid: int) -> None:
    """SIGKILL to a process group, and removes the shared-memory segments its processes mapped: their owners
    unlink them on a clean exit only, and /dev/shm is RAM (a killed rollout server's engine left ~420 MB)."""
    segments = group_shared_memory(pgid)
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    for segment in segments:
        segment.unlink(missing_ok=True)


def python_module(module: str, *args: str) -> list[str]:
    return [sys.executable, "-m", module, *args]
