"""Files a local job keeps in its run directory, for whoever follows it from outside: the supervisor's
`status.json` (phase, outcome) and LocalRun's `pids.json` (service PIDs)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

STATUS, PIDS = "status.json", "pids.json"
PREPARING, STARTING, RUNNING, EXITED = "preparing", "starting", "running", "exited"


class StatusFile:
    def __init__(self, path: Path):
        self.path = path
        self.data: dict[str, Any] = {"pid": os.getpid()}

    def write(self, **fields: Any) -> None:
        self.data.update(fields, updated=time.time())
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data))
        os.replace(tmp, self.path)  # readers never see a half-written file


def read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return {}
