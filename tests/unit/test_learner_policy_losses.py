"""The policy-loss registry: `ppo_clip` is registered and is `losses.policy_loss` as the config sets it, the
config refuses a name no registry holds, and the trainer calls whatever loss the config names."""

import pytest
import torch
from pydantic import ValidationError

from services.common.config import AlgorithmConfig, TrainConfig, load_config
from services.learner.losses import AGG_MODES, policy_loss
from services.learner.policy_losses import POLICY_LOSSES, build_policy_loss
from services.learner.policy_losses.base import POLICY_STATS, PolicyLoss, PolicyLossInputs
from services.learner.policy_losses.ppo_clip import PPOClip
from services.learner.trainer import PolicyTrainer
from tests.support.smoke import synthetic_trajectories


def test_ppo_clip_is_registered_and_the_default():
    assert "ppo_clip" in POLICY_LOSSES.names()
    assert AlgorithmConfig().policy_loss == "ppo_clip"
    loss = build_policy_loss(AlgorithmConfig(clip_ratio_low=0.1, clip_ratio_high=0.3, clip_ratio_c=5.0))
    assert isinstance(loss, PPOClip) and isinstance(loss, PolicyLoss) and loss.name == "ppo_clip"
    assert (loss.clip_low, loss.clip_high, loss.clip_ratio_c, loss.agg_mode) == (0.1, 0.3, 5.0, "token-mean")


@pytest.mark.parametrize("mode", AGG_MODES)
@pytest.mark.parametrize("weighted", [False, True])
def test_ppo_clip_gives_policy_loss_exactly(mode, weighted):
    gen = torch.Generator().manual_seed(3)
    old = -torch.rand(4, 7, generator=gen, dtype=torch.float64) * 4
    lp = (old + torch.randn(4, 7, generator=gen, dtype=torch.float64) * 0.5).requires_grad_()
    adv = torch.randn(4, 7, generator=gen, dtype=torch.float64)
    mask = (torch.rand(4, 7, generator=gen) < 0.6).double()
    weights = torch.rand(4, 7, generator=gen, dtype=torch.float64) * 2 if weighted else None
    config = AlgorithmConfig(clip_ratio_low=0.15, clip_ratio_high=0.28, clip_ratio_c=2.5, loss_agg_mode=mode)
    divisors = {"num_tokens": 40.0, "num_seqs": 6.0, "loss_scale_factor": 9.0}
    inputs = PolicyLossInputs(lp, old, adv, mask, is_weights=weights, **divisors)
    got, got_stats = build_policy_loss(config)(inputs)
    want, want_stats = policy_loss(
        lp, old, adv, mask, 0.15, 0.28, mode, clip_ratio_c=2.5, is_weights=weights, **divisors
    )
    assert torch.equal(got, want)
    assert set(got_stats) == set(POLICY_STATS)
    for key in POLICY_STATS:
        assert torch.equal(got_stats[key], want_stats[key]), key


def test_an_unknown_loss_is_refused_when_the_config_is_parsed():
    with pytest.raises(ValidationError, match="'gspoo' is not one of: cispo, gspo, ppo_clip"):
        AlgorithmConfig(policy_loss="gspoo")
    with pytest.raises(ValidationError) as info:
        load_config(None, ["algorithm.policy_loss=gspoo"])
    error = info.value.errors()[0]
    assert (
        error["loc"] == ("algorithm", "policy_loss") and "'gspoo' is not one of: cispo, gspo, ppo_clip" in error["msg"]
    )
    with pytest.raises(KeyError, match="unknown policy loss 'gspoo'; known: cispo, gspo, ppo_clip"):
        build_policy_loss(AlgorithmConfig.model_construct(policy_loss="gspoo"))


class ZeroLoss(PolicyLoss):
    """A throwaway loss: zero (so no gradient), recording what the trainer hands it."""

    name = "zero_for_test"

    def __init__(self):
        self.calls: list[PolicyLossInputs] = []

    def __call__(self, inputs):
        self.calls.append(inputs)
        zero = (inputs.logprobs * 0).sum()
        return zero, {key: torch.zeros((), dtype=inputs.logprobs.dtype) for key in POLICY_STATS}


@pytest.fixture
def zero_loss():
    POLICY_LOSSES.register(ZeroLoss.name)(ZeroLoss)
    yield ZeroLoss.name
    POLICY_LOSSES.unregister(ZeroLoss.name)


def test_the_trainer_calls_the_configured_loss(model_dir, zero_loss):
    config = TrainConfig.model_validate(
        {
            "seed": 1,
            "rollout": {"group_size": 4},
            "learner": {"device": "cpu", "steps": 10},
            "algorithm": {"lr": 3e-3, "micro_batch_size": 3, "policy_loss": zero_loss},
        }
    )
    trainer = PolicyTrainer(config, model_dir)
    assert isinstance(trainer.policy_loss, ZeroLoss)
    before = {k: v.full_tensor().clone() for k, v in trainer.model.state_dict().items()}
    metrics = trainer.train_step(synthetic_trajectories(8, 4, seed=7))
    calls = trainer.policy_loss.calls
    assert len(calls) == 3  # 8 sequences in micro-batches of 3
    assert sum(c.response_mask.sum().item() for c in calls) == metrics["num_tokens"] == calls[0].num_tokens
    assert all(c.logprobs.requires_grad and c.is_weights is not None for c in calls)
    assert metrics["pg_loss"] == 0.0 and metrics["grad_norm"] == 0.0
    after = trainer.model.state_dict()
    for name, weight in before.items():
        torch.testing.assert_close(after[name].full_tensor(), weight, rtol=0, atol=0, msg=name)
