"""The learner on CUDA: FSDP full sharding with bf16 mixed precision (fp32 master weights and gradient
reduction), one process and, where two GPUs exist, two (NCCL)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from services.common.config import TrainConfig
from tests.support.smoke import build_tiny_llama, synthetic_trajectories

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(build_tiny_llama(tmp_path_factory.mktemp("tiny") / "model"))


@pytest.mark.parametrize("advantage", ["grpo", "gae"])
def test_one_gpu_step_in_bf16(model_dir, advantage):
    from services.learner.trainer import PolicyTrainer

    config = TrainConfig.model_validate(
        {
            "model": {"dtype": "bfloat16"},
            "rollout": {"group_size": 4},
            "learner": {"device": "cuda"},
            "algorithm": {
                "advantage": advantage,
                "lr": 1e-2,
                "micro_batch_size": 3,
                "use_kl_loss": True,
                "entropy_coeff": 0.01,
            },
        }
    )
    trainer = PolicyTrainer(config, model_dir)
    param = next(trainer.model.parameters())
    assert param.device.type == "cuda" and param.dtype == torch.float32  # fp32 master weights, sharded
    before = {n: t.clone() for n, t in trainer.named_weights_for_push()}
    metrics = [trainer.train_step(synthetic_trajectories(8, 4, seed=s)) for s in range(2)]
    assert all(torch.isfinite(torch.tensor(m["loss"])) and m["grad_norm"] > 0 for m in metrics)
    assert metrics[1]["kl_ref"] > 0  # the policy moved away from the reference
    after = trainer.named_weights_for_push()
    assert all(t.device.type == "cpu" and t.dtype == torch.bfloat16 for _, t in after)
    assert any(not torch.equal(before[n], t) for n, t in after)
    if advantage == "gae":
        assert metrics[1]["vf_loss"] > 0 and trainer.critic.model.score.weight.device.type == "cuda"


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_two_gpus_train_like_one(model_dir, tmp_path):
    from tests.support.smoke import run

    out = tmp_path / "two.json"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
        "-m",
        "tests.support.smoke",
        "--model",
        model_dir,
        "--out",
        str(out),
        "--device",
        "cuda",
        "--agg-modes",
        "token-mean",
        "--steps",
        "2",
    ]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
        "NCCL_NVLS_ENABLE": "0",
        "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
        "NVSHMEM_DISABLE_NVLS": "1",
    }
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    two = json.loads(out.read_text())
    assert two["world_size"] == 2
    one = run(model_dir, agg_modes=["token-mean"], steps=2, device="cuda")
    for m1, m2 in zip(one["token-mean"]["metrics"], two["results"]["token-mean"]["metrics"], strict=True):
        for key in ("loss", "grad_norm", "entropy", "mismatch_kl"):
            assert m2[key] == pytest.approx(m1[key], rel=1e-3, abs=1e-5), key  # fp32 on GPU: reduction order only
    assert two["results"]["token-mean"]["checksum"] == pytest.approx(one["token-mean"]["checksum"], rel=1e-4)
