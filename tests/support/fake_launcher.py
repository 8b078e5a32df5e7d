"""A launcher that runs nothing, for tests of the job API and its manager: each poll moves a job one
state further along a script (by default running -> succeeded; `scripts` picks one by the spec's run name)."""

from __future__ import annotations

from typing import Any

from services.common.config import TrainConfig
from services.jobs.launchers import CANCELLED, Launcher, LaunchStatus, SpecRejected
from services.jobs.spec import JobSpec


class FakeLauncher(Launcher):
    name = "fake"

    def __init__(
        self,
        script: tuple[str, ...] = ("running", "succeeded"),
        capacity: int | None = None,
        scripts: dict[str, tuple[str, ...]] | None = None,
    ):
        self.script, self._capacity, self.scripts = script, capacity, scripts or {}
        self.started: list[str] = []
        self.cancelled: list[str] = []
        self.recovered: list[str] = []
        self.polls: dict[str, int] = {}
        self.fail_start: str | None = None
        self.unreachable: set[str] = set()
        self.messages: dict[str, list[str]] = {}
        self.errors: dict[str, str] = {}

    def check(self, spec: JobSpec) -> None:
        if spec.env.name == "babyai":  # a registered env, so the spec itself is valid
            raise SpecRejected(("env", "name"), "this launcher cannot run that environment")

    def capacity(self) -> int | None:
        return self._capacity

    def run_config(self, job_id: str, spec: JobSpec) -> TrainConfig:
        config = spec.train_config()
        config.run = job_id
        return config

    def start(self, job_id: str, spec: JobSpec) -> dict[str, Any]:
        if self.fail_start:
            raise RuntimeError(self.fail_start)
        self.started.append(job_id)
        return {"fake_id": job_id, "script": list(self.scripts.get(spec.run, self.script))}

    def poll(self, job_id: str, handle: dict[str, Any]) -> LaunchStatus:
        if job_id in self.unreachable:
            raise ConnectionError("launcher backend unreachable")
        if handle.get("cancelled"):
            return LaunchStatus(CANCELLED, handle=handle)
        n = self.polls[job_id] = self.polls.get(job_id, 0) + 1
        script = handle.get("script", self.script)
        state = script[min(n, len(script)) - 1] if script else "running"
        return LaunchStatus(
            state, error=self.errors.get(job_id), messages=self.messages.pop(job_id, []), handle={**handle, "polls": n}
        )

    def recover(self, job_id: str, handle: dict[str, Any]) -> LaunchStatus:
        self.recovered.append(job_id)
        return self.poll(job_id, handle)

    def cancel(self, job_id: str, handle: dict[str, Any]) -> dict[str, Any]:
        if job_id in self.unreachable:
            raise ConnectionError("launcher backend unreachable")
        self.cancelled.append(job_id)
        return {**handle, "cancelled": True}

    def logs(self, job_id: str, handle: dict[str, Any], service: str, tail: int) -> str:
        return f"{service} log of {job_id}"
