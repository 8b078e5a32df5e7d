"""The job API as a real process (`python -m services.jobs` on loopback, the local launcher), for tests that
drive it over HTTP or with the CLI and may kill it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]


class JobApiProcess:
    def __init__(self, root: Path, port: int, token: str, settings: dict[str, str] | None = None):
        """`root`: the API's database, log and (unless `settings` says otherwise) run folder; `settings`:
        more `OMRL_API_*` variables, over these defaults."""
        self.root, self.port = root, port
        self.url = f"http://127.0.0.1:{port}"
        self.env = {
            **os.environ,
            "OMRL_API_TOKEN": token,
            "OMRL_API_DB": str(root / "jobs.sqlite"),
            "OMRL_API_OUTPUT_DIR": str(root / "runs"),
            "OMRL_API_POLL_INTERVAL_S": "0.5",
            **(settings or {}),
        }
        self.proc: subprocess.Popen | None = None

    @property
    def log(self) -> Path:
        return self.root / "api.log"

    def start(self, timeout_s: float = 60) -> JobApiProcess:
        """Returns once the API is ready: its first reconcile pass is done, so jobs that ran across a restart
        are taken up again."""
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "services.jobs", "--host", "127.0.0.1", "--port", str(self.port)],
                cwd=ROOT,
                env=self.env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                if httpx.get(f"{self.url}/readyz", timeout=2).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            assert self.proc.poll() is None, self.log.read_text()[-3000:]
            assert time.monotonic() < deadline, "job API did not come up"
            time.sleep(0.1)

    def stop(self, sig: int = signal.SIGTERM) -> None:
        """Sends `sig` and waits for the exit (SIGKILL after 20 s)."""
        if self.proc is None or self.proc.poll() is not None:
            return
        os.kill(self.proc.pid, sig)
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=20)
