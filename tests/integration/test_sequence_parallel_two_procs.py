"""Ulysses sequence parallelism (`learner.sequence_parallel`) on CPU processes (torchrun, gloo) computes what one
process computes on the unsplit rows: the attention alone (with as many, fewer and, repeated, fewer key/value heads
than processes), the policy's logprobs and entropy (fused chunked head and dense head) and the critic's values of a
packed micro-batch of ragged sequences with the gradient of every parameter, and whole PPO steps (critic, reference
KL, entropy bonus). Two processes split each row; the `slow` case runs four as 2 data x 2 sequence ranks."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.support.sequence_parallel import KV_CASES, attention_case, build_model, model_case, trainer_case

REPO = Path(__file__).resolve().parents[2]
MODEL_KINDS = ("fused", "dense", "values")
ROUGH = ("clip_frac", "clip_frac_lower", "vf_clip_frac", "tis_clip_frac")
"""Counts of tokens past a threshold: after an optimizer step float rounding may move one token across it."""


def _torchrun(model: str, out: Path, nproc: int, sp: int) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc)]
    cmd += ["-m", "tests.support.sequence_parallel", "--model", model, "--out", str(out), "--sp", str(sp)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _finish(proc: subprocess.Popen, out: Path, timeout: float) -> dict:
    try:
        log, _ = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, log[-4000:]
    return torch.load(out, weights_only=False)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return str(build_model(tmp_path_factory.mktemp("sp") / "model", kv_heads=1))


@pytest.fixture(scope="module")
def one(model):
    """The unsplit computations in this process (a world of one)."""
    out = {f"attention/{kv}": attention_case(kv) for kv in KV_CASES}
    out.update({f"model/{kind}": model_case(model, kind) for kind in MODEL_KINDS})
    out["trainer"] = trainer_case(model, 1)
    return out


@pytest.fixture(scope="module")
def two(model, tmp_path_factory, request):
    out = tmp_path_factory.mktemp("sp2") / "two.pt"
    proc = _torchrun(model, out, nproc=2, sp=2)
    request.getfixturevalue("one")  # computed while the two processes run
    return _finish(proc, out, timeout=240)


def assert_same_tensors(split: dict, unsplit: dict, rtol=1e-5, atol=1e-5) -> None:
    assert split.keys() == unsplit.keys()
    for name in unsplit:
        torch.testing.assert_close(split[name], unsplit[name], rtol=rtol, atol=atol, msg=lambda m, n=name: f"{n}: {m}")


def assert_same_steps(split: dict, unsplit: dict) -> None:
    """The first step (the same weights) to float rounding; the second (after four Adam steps of policy and critic,
    which turn rounding-sized gradient differences into lr-sized moves) to 1e-3: a plain numerical change
    (`logprob_chunk_tokens` 7 -> 5 with sdpa for varlen) moves one process's second step by 8e-5."""
    first, second = zip(unsplit["metrics"], split["metrics"], strict=True)
    assert first[0].keys() == first[1].keys()
    for key in first[0]:
        assert first[1][key] == pytest.approx(first[0][key], rel=1e-5, abs=1e-7), key
    for key in second[0]:
        if key not in ROUGH:
            assert second[1][key] == pytest.approx(second[0][key], rel=1e-3, abs=1e-6), key
    assert split["checksum"] == pytest.approx(unsplit["checksum"], rel=1e-5)


@pytest.mark.parametrize("kv_heads", KV_CASES)
def test_attention_alone_equals_the_unsplit_row(one, two, kv_heads):
    assert two["world_size"] == 2
    assert_same_tensors(two[f"attention/{kv_heads}"], one[f"attention/{kv_heads}"], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("kind", MODEL_KINDS)
def test_outputs_and_every_gradient_equal_the_unsplit_row(one, two, kind):
    split, unsplit = two[f"model/{kind}"], one[f"model/{kind}"]
    assert sum(name.startswith("grad/") for name in unsplit) >= 19  # every parameter of the 2-layer model
    assert_same_tensors(split, unsplit)
    assert any(g.abs().max() > 0 for name, g in unsplit.items() if name.startswith("grad/"))


def test_ppo_steps_equal_one_process(one, two):
    assert two["trainer"]["dp_size"] == 1
    assert_same_steps(two["trainer"], one["trainer"])


@pytest.mark.slow
def test_two_data_by_two_sequence_ranks_train_like_one_process(model, one, tmp_path):
    """Four processes: the batch split over 2 data ranks, each row over the 2 processes of a data rank."""
    out = tmp_path / "four.pt"
    four = _finish(_torchrun(model, out, nproc=4, sp=2), out, timeout=400)
    assert four["world_size"] == 4 and four["trainer"]["dp_size"] == 2
    for kind in MODEL_KINDS:
        assert_same_tensors(four[f"model/{kind}"], one[f"model/{kind}"])
    assert_same_steps(four["trainer"], one["trainer"])
