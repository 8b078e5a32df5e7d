"""The launcher interface: where a job's services run. The job API holds one launcher and drives it
with start / poll / cancel; a launcher keeps what it needs to find a job again in a JSON `handle`
that the API persists, so a restarted API can pick its jobs up again (`recover`). The launchers
themselves (`services.launcher.local`, `services.launcher.kubernetes`) are plugins of the job API:
they implement this interface, and `LAUNCHERS` finds them by name."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

from services.common.config import TrainConfig
from services.common.registry import Registry
from services.jobs.spec import JobSpec

# Job states as the launchers report them (the API adds `queued` before a launcher sees a job).
STARTING, RUNNING, CANCELLING = "starting", "running", "cancelling"
SUCCEEDED, FAILED, CANCELLED, INTERRUPTED = "succeeded", "failed", "cancelled", "interrupted"
TERMINAL = frozenset({SUCCEEDED, FAILED, CANCELLED, INTERRUPTED})


class SpecRejected(ValueError):
    """A valid spec this launcher cannot run; `loc` names the field, as in a validation error."""

    def __init__(self, loc: tuple[str, ...], message: str):
        super().__init__(message)
        self.loc, self.message = loc, message


@dataclass
class LaunchStatus:
    state: str
    error: str | None = None
    messages: list[str | dict[str, Any]] = field(default_factory=list)
    """Human-readable lines since the last poll (phases, scheduling problems); a dict is a structured event
    with at least `message` (start-up stages: `service`, `stage`)."""
    handle: dict[str, Any] | None = None
    """An updated handle to persist, or None if unchanged."""


class Launcher(ABC):
    name: str = ""

    def check(self, spec: JobSpec) -> None:
        """Raises SpecRejected for a spec this launcher cannot run."""

    def capacity(self) -> int | None:
        """Jobs this launcher runs at once (None: no limit; the cluster queues them)."""
        return None

    @abstractmethod
    def run_config(self, job_id: str, spec: JobSpec) -> TrainConfig:
        """The config the job's services run with: `run` is the job id, addresses are the launcher's."""

    @abstractmethod
    def start(self, job_id: str, spec: JobSpec) -> dict[str, Any]:
        """Starts the job without waiting for it; returns its handle."""

    @abstractmethod
    def poll(self, job_id: str, handle: dict[str, Any]) -> LaunchStatus:
        """Where the job stands now."""

    @abstractmethod
    def cancel(self, job_id: str, handle: dict[str, Any]) -> dict[str, Any]:
        """Starts stopping everything the job runs and returns the updated handle; `poll` reports
        `cancelling` until it is all gone, then `cancelled`."""

    def recover(self, job_id: str, handle: dict[str, Any]) -> LaunchStatus:
        """Called once per unfinished job when the API starts again."""
        return self.poll(job_id, handle)

    def logs(self, job_id: str, handle: dict[str, Any], service: str, tail: int) -> str:
        return ""

    def close(self) -> None:
        pass


LAUNCHERS: Registry[Launcher] = Registry("launcher")
LAUNCHERS.register_lazy("local", "services.launcher.local")
LAUNCHERS.register_lazy("kubernetes", "services.launcher.kubernetes")
