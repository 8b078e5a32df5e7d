"""A real rollout server process (vLLM on CPU, tiny model) for integration and fault tests: started on
a free port with its own run name and push token, ready once gRPC health says SERVING."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import redis

from services.common.grpc_server import free_port
from services.common.tiny_model import build_tiny_model
from services.launcher.processes import ServiceProcess, kill_group
from services.rollout.client import GrpcRolloutClient
from tests.support.worker_cores import bind_engines_of_this_worker

WORKER_CPU = bind_engines_of_this_worker()
"""The CPU the servers' vLLM workers are bound to: this xdist worker's own."""

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
            kill_group(self.proc.pid)
            self.proc.wait()
        client = redis.Redis.from_url("redis://127.0.0.1:6379/0", socket_timeout=5)
        keys = list(client.scan_iter(match=f"omrl:{self.run}:*"))
        if keys:
            client.delete(*keys)


def start_rollout(tmp: Path, sets: Sequence[str] = (), model: Path | None = None) -> RolloutProcess:
    """A rollout server process on `model` (the tiny model, built under `tmp` when None); `sets`: more
    `--set key=value` settings."""
    model = model or build_tiny_model(tmp / "model", CORPUS)
    port, run, token = free_port(), f"test-rollout-{uuid.uuid4().hex[:8]}", uuid.uuid4().hex
    log = tmp / "rollout.log"
    args = [sys.executable, "-m", "services.rollout", "--no-produce", "--port", str(port)]
    args += ["--set", f"model.path={model}", "--set", f"run={run}"]
    for setting in sets:
        args += ["--set", setting]
    # the engine's worker on one CPU, as on CI's 2-core machines, whatever this machine has
    env = {"VLLM_LOGGING_LEVEL": "WARNING", "OMRL_WEIGHT_TOKEN": token, "VLLM_CPU_OMP_THREADS_BIND": str(WORKER_CPU)}
    service = ServiceProcess("rollout", args, log, f"127.0.0.1:{port}", env).start()
    server = RolloutProcess(service.health_address, model, service.popen, log, run, token)
    try:  # fails at once on a server that died at start-up
        service.wait_healthy(240)
    except RuntimeError as exc:
        server.kill()
        raise AssertionError(str(exc)) from None
    return server


class SharedRollout:
    """A module's rollout server for tests in any order: `get()` hands out the running one, or starts one
    when there is none yet or a test ended it (SIGTERM, a killed engine), so only a run where such a test
    came before others pays a second start. Every server it starts serves the same model (`model`) with
    the same settings, each with its own run, token and log."""

    def __init__(self, tmp: Path, sets: Sequence[str] = ()):
        self.tmp, self.sets = tmp, tuple(sets)
        self.model = build_tiny_model(tmp / "model", CORPUS)
        self.starts = 0
        self._server: RolloutProcess | None = None

    def get(self) -> RolloutProcess:
        if self._server is not None and self._server.proc.poll() is not None:
            self._server.kill()  # only its run's Redis keys are left to clear
            self._server = None
        if self._server is None:
            self.starts += 1
            self._server = start_rollout(self.tmp / f"start-{self.starts}", self.sets, model=self.model)
        return self._server

    def close(self, grace_s: float = 0.0) -> None:
        """Stops the server (SIGTERM first, when `grace_s`) and clears its run's keys."""
        server, self._server = self._server, None
        if server is None:
            return
        if grace_s and server.proc.poll() is None:
            os.killpg(server.proc.pid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                server.proc.wait(timeout=grace_s)
        server.kill()


def reference_logprobs(model, prompt, output):
    """The logprobs transformers gives `output` after `prompt`: what the server's must match."""
    import torch

    ids = torch.tensor([prompt + output])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1]
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(output)[:, None])[:, 0]


def perturbed(model, scale, seed):
    """`model`'s weights plus seeded noise of `scale`: a new policy version to push."""
    import torch

    g = torch.Generator().manual_seed(seed)
    return [(n, t + scale * torch.randn(t.shape, generator=g)) for n, t in model.state_dict().items()]
