"""Where a bench writes its JSON: the path asked for, or bench/results/<stem>_<local time>.json."""

from __future__ import annotations

import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def result_path(asked: str | None, stem: str) -> Path:
    return Path(asked) if asked else RESULTS / f"{stem}_{time.strftime('%Y%m%d_%H%M%S')}.json"
