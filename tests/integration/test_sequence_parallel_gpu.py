"""Ulysses sequence parallelism on two GPUs (NCCL, bf16, torch's varlen flash kernel) computes what one GPU computes
on the unsplit rows, to bf16 rounding: the attention alone, the policy's logprobs/entropy and the critic's values of
a packed micro-batch of ~4k tokens with every parameter's gradient, and two PPO steps of the trainer (the `auto`
levers: compiled layers where Triton builds)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.support.sequence_parallel import KV_CASES, attention_case, build_model, model_case, trainer_case

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices"),
]
REPO = Path(__file__).resolve().parents[2]
PADDED = (1500, 1, 700, 2100, 34)
"""4,335 ragged tokens: a split over 2 pads one."""
HEAD_DIM = 64


def _relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp(min=1e-12))


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("sp_gpu")
    model = str(build_model(tmp / "model", kv_heads=1, hidden=4 * HEAD_DIM, positions=4096))
    out = tmp / "two.pt"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    cmd += ["-m", "tests.support.sequence_parallel", "--model", model, "--out", str(out), "--device", "cuda"]
    cmd += ["--dtype", "bfloat16", "--lengths", ",".join(map(str, PADDED)), "--head-dim", str(HEAD_DIM)]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    two = torch.load(out, weights_only=False)
    one = {}
    for kv in KV_CASES:
        one[f"attention/{kv}"] = attention_case(
            kv, lengths=PADDED, head_dim=HEAD_DIM, device="cuda", dtype=torch.bfloat16
        )
    for kind in ("fused", "dense", "values"):
        one[f"model/{kind}"] = model_case(model, kind, lengths=PADDED, device="cuda", dtype="bfloat16")
    one["trainer"] = trainer_case(model, 1, device="cuda")
    return one, two


@pytest.mark.parametrize("kv_heads", KV_CASES)
def test_attention_on_two_gpus_equals_one(results, kv_heads):
    one, two = results
    for name, unsplit in one[f"attention/{kv_heads}"].items():
        assert _relative_error(two[f"attention/{kv_heads}"][name], unsplit) < 1e-2, name


@pytest.mark.parametrize("kind", ["fused", "dense", "values"])
def test_outputs_and_gradients_on_two_gpus_equal_one(results, kind):
    one, two = results
    split, unsplit = two[f"model/{kind}"], one[f"model/{kind}"]
    assert split.keys() == unsplit.keys()
    for name in unsplit:
        assert _relative_error(split[name], unsplit[name]) < 3e-2, name


def test_trainer_steps_on_two_gpus_equal_one(results):
    one, two = results
    for m1, m2 in zip(one["trainer"]["metrics"], two["trainer"]["metrics"], strict=True):
        for key in ("loss", "grad_norm", "entropy", "kl_loss", "vf_loss", "critic_grad_norm"):
            assert m2[key] == pytest.approx(m1[key], rel=5e-2, abs=1e-3), key
