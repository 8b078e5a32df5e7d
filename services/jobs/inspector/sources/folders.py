"""Run folders on disk: a root whose subfolders are runs (`runs/`, the job API's `runs/jobs/`), or one run folder.

A run's files (services/launcher/local.py, services/launcher/job_files.py): `metrics.jsonl` and `history.json`
written when it ends, `trackers/metrics.jsonl` while it runs (the jsonl tracker), `status.json` of a job's
supervisor, `pids.json` of its services, `episodes/` of the learner."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import psutil
import yaml

from services.jobs.inspector.sources.base import (
    FAILED,
    RUNNING,
    SUCCEEDED,
    UNKNOWN,
    RunInfo,
    RunNotFound,
    RunSource,
    last_per_step,
)

MARKS = ("episodes", "metrics.jsonl", "trackers", "history.json", "status.json", "pids.json", "config.yaml")
"""Any of these makes a folder a run folder."""


def is_run_folder(path: Path) -> bool:
    return path.is_dir() and any((path / mark).exists() for mark in MARKS)


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    out = []
    try:
        lines = path.read_text().splitlines()
    except FileNotFoundError:
        return []
    for line in lines:
        try:
            entry = json.loads(line)
        except ValueError:  # the line being written while we read
            continue
        if isinstance(entry, dict):
            out.append(entry)
    return out


def read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, ValueError):
        return None


def folder_metrics(folder: Path) -> list[dict[str, Any]]:
    """The final `metrics.jsonl` where the run ended, else the live tracker's lines, else `history.json`."""
    entries = read_jsonl(folder / "metrics.jsonl")
    if not entries:
        live = read_jsonl(folder / "trackers" / "metrics.jsonl")
        entries = [{**e.get("metrics", {}), "step": e.get("step")} for e in live]
    if not entries:
        history = read_json(folder / "history.json")
        entries = [e for e in history if isinstance(e, dict)] if isinstance(history, list) else []
    return last_per_step([e for e in entries if e.get("kind") in (None, "step")])


def _alive(pid: Any, folder: Path) -> bool:
    """The process `pid` runs and belongs to this run (an argument names a path in the folder, as the services'
    `--config RUN/config.yaml` does, relative to its working directory or not): a reused PID does not."""
    try:
        proc = psutil.Process(int(pid))
        if proc.status() == psutil.STATUS_ZOMBIE:
            return False
        cwd, args = Path(proc.cwd()), proc.cmdline()
    except (psutil.Error, ValueError, TypeError):
        return False
    for arg in args:
        if folder.name in arg:
            try:
                if (cwd / arg).resolve().is_relative_to(folder):
                    return True
            except (OSError, ValueError):
                continue
    return False


def folder_status(folder: Path) -> tuple[str, str]:
    """(status, what it rests on)."""
    supervisor = read_json(folder / "status.json") or {}
    if supervisor.get("phase") == "exited":
        return supervisor.get("state") or UNKNOWN, supervisor.get("error") or ""
    pids = read_json(folder / "pids.json") or {}
    if supervisor.get("pid") and _alive(supervisor["pid"], folder) or any(_alive(p, folder) for p in pids.values()):
        return RUNNING, "its processes run"
    if supervisor:
        return FAILED, "its supervisor ended without an outcome"
    if read_jsonl(folder / "metrics.jsonl"):
        return SUCCEEDED, "the launcher wrote metrics.jsonl at its end"
    return UNKNOWN, "no process runs and no outcome was written"


def total_steps(folder: Path) -> int | None:
    """`learner.steps` of the run's config, as the launcher wrote it."""
    try:
        config = yaml.safe_load((folder / "config.yaml").read_text())
    except (FileNotFoundError, yaml.YAMLError):
        return None
    steps = ((config or {}).get("learner") or {}).get("steps") if isinstance(config, dict) else None
    return steps if isinstance(steps, int) else None


class FolderSource(RunSource):
    def __init__(self, root: Path):
        self.root = Path(root).resolve()

    def _folders(self) -> dict[str, Path]:
        if is_run_folder(self.root):
            return {self.root.name: self.root}
        return {p.name: p for p in self._children() if is_run_folder(p)}

    def _children(self) -> list[Path]:
        return sorted(p for p in self.root.iterdir() if p.is_dir()) if self.root.is_dir() else []

    def _info(self, name: str, folder: Path) -> RunInfo:
        from services.learner.episodes import recorded_steps

        status, detail = folder_status(folder)
        metrics = folder_metrics(folder)
        steps = recorded_steps(folder)
        last = max(([int(metrics[-1]["step"])] if metrics else []) + steps[-1:], default=None)
        return RunInfo(name, status, last, total_steps(folder), detail, folder)

    def runs(self) -> list[RunInfo]:
        folders = self._folders()
        newest_first = sorted(folders, key=lambda n: folders[n].stat().st_mtime, reverse=True)
        return [self._info(name, folders[name]) for name in newest_first]

    def run(self, name: str) -> RunInfo:
        folder = self._folders().get(name)
        if folder is None:
            raise RunNotFound(name)
        return self._info(name, folder)

    def metrics(self, name: str) -> list[dict[str, Any]]:
        return folder_metrics(self.run(name).folder)
