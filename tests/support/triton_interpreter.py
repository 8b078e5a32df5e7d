"""Runs Triton kernels on CPU: a child process with Triton's interpreter (it is chosen when triton is first
imported, so not in the test process, which may have imported it already). CI machines have no GPU."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def run_interpreted(code: str, timeout_s: float = 300) -> str:
    """The code's standard output; the test fails with its error output where it exits non-zero."""
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    run = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout_s
    )
    assert run.returncode == 0, run.stderr[-3000:]
    return run.stdout
