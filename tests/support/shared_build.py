"""Something a session builds once (a tiny model), built once for the whole pytest-xdist run: the first worker
to ask builds it under a file lock in the run's shared temporary folder, the others wait and reuse it."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

from filelock import FileLock


def build_once(tmp_path_factory, name: str, build: Callable[[Path], Path]) -> Path:
    """`build(folder)` writes into an empty `folder` and returns the path to hand out; it must give the same
    result in every worker (seeded)."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # every worker's basetemp is a folder of the run's one
    folder, record = root / name, root / f"{name}.built"
    with FileLock(str(root / f"{name}.lock")):
        if not record.exists():
            folder.mkdir(exist_ok=True)
            record.write_text(str(build(folder)))
    return Path(record.read_text())
