"""What needs vLLM installed: the committed list of AsyncEngineArgs fields (services/engines/
vllm_engine_args.json, which config-time checks read without vLLM) is what the installed vLLM has, and the
backend applies the engine-args checks before starting anything."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import ValidationError

pytest.importorskip("vllm")
ROOT = Path(__file__).resolve().parents[2]


def test_the_committed_field_list_matches_the_installed_vllm():
    out = subprocess.run(
        [sys.executable, "-m", "services.engines.vllm_args", "--check"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert out.returncode == 0, out.stderr[-2000:]


def test_the_vllm_backend_refuses_tensor_parallelism_on_cpu_before_starting_anything():
    from services.engines.vllm import VllmBackend

    with pytest.raises(ValueError, match="rollout.gpus=2: tensor parallelism needs GPUs"):
        VllmBackend("/nonexistent-model", gpus=2)
    with pytest.raises(ValidationError, match="unknown vLLM 0.32.0 engine argument"):
        VllmBackend("/nonexistent-model", engine_args={"max_num_batch_tokens": 1})
