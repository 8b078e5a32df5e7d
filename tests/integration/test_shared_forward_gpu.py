"""Prefix-shared reward-model passes on a GPU: the scores of the plain padded pass, in float32 and bfloat16."""

import pytest
import torch

from services.reward.reward_model import RewardModel
from tests.support.reward_models import agent_like_rows, build_tiny_policy, build_tiny_reward_model

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.mark.parametrize("dtype, tolerance", [("float32", 1e-4), ("bfloat16", 5e-2)])
def test_shared_passes_score_as_the_plain_pass_on_cuda(tmp_path, dtype, tolerance):
    path = str(build_tiny_reward_model(tmp_path / "rm", build_tiny_policy(tmp_path / "policy")))
    shared = RewardModel(path, device="cuda", dtype=dtype, max_wait_ms=0, min_shared_tokens=1)
    plain = RewardModel(path, device="cuda", dtype=dtype, max_wait_ms=0, share_prefixes=False)
    rows = agent_like_rows(shared.vocab)
    scored, expected = shared._forward(rows), plain._forward(rows)
    assert scored == pytest.approx(expected, abs=tolerance)
    assert len({round(s, 3) for s in expected}) > 6
