"""What the inspector reads, behind one interface: runs with a status, their per-step metrics, and the episodes
the learner recorded (`services.learner.episodes`). Implementations: run folders on disk (`folders`) and the
job API's jobs (`jobs`)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import Any

RUNNING, SUCCEEDED, FAILED, CANCELLED, UNKNOWN = "running", "succeeded", "failed", "cancelled", "unknown"


class RunNotFound(KeyError):
    pass


@dataclass
class RunInfo:
    name: str
    status: str
    """running, succeeded, failed, cancelled or unknown."""
    last_step: int | None = None
    total_steps: int | None = None
    detail: str = ""
    """What the status rests on, or the error of a failed run."""
    folder: Path | None = None
    """Its run folder where it is on this machine (the recorded episodes), else None."""

    @property
    def live(self) -> bool:
        return self.status == RUNNING


class RunSource(ABC):
    @abstractmethod
    def runs(self) -> list[RunInfo]:
        """Every run, newest first where the source knows the order."""

    @abstractmethod
    def run(self, name: str) -> RunInfo:
        """Raises RunNotFound."""

    @abstractmethod
    def metrics(self, name: str) -> list[dict[str, Any]]:
        """One dict per learner step, in step order, each with `step`."""

    def steps(self, name: str) -> list[int]:
        """The steps with recorded episodes."""
        from services.learner.episodes import recorded_steps

        folder = self.run(name).folder
        return recorded_steps(folder) if folder else []

    def episodes(self, name: str, step: int) -> list[dict[str, Any]]:
        """The recorded episodes of one step; FileNotFoundError when there are none."""
        from services.learner.episodes import read_step

        folder = self.run(name).folder
        if folder is None:
            raise FileNotFoundError(f"the run folder of {name} is not on this machine")
        return read_step(folder, step)


def last_per_step(entries: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A restarted run writes a step again: its last entry wins, in step order."""
    by_step = {int(e["step"]): e for e in entries if isinstance(e.get("step"), (int, float))}
    return [by_step[s] for s in sorted(by_step)]
