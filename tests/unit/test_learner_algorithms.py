"""The learner's algorithm options through PolicyTrainer on a tiny random Llama: critic (GAE), every
estimator, KL to the reference (in the reward and as a loss), entropy bonus, truncated importance
sampling, LR schedule, and checkpoints that carry all of it."""

import json
from functools import partial

import pytest
import torch

from services.learner.advantages import ADVANTAGES
from services.learner.batch import collate
from services.learner.kl import kl_estimate
from services.learner.model import token_logprobs
from services.learner.trainer import PolicyTrainer
from tests.support.learner import BAD, GOOD, PROMPT, episode, good_bad_batch, logprob_of, untimed
from tests.support.learner import make_config as learner_config
from tests.support.smoke import build_tiny_llama, synthetic_trajectories

make_config = partial(learner_config, {"steps": 10}, entropy_coeff=0.0)
"""The shared learner config without its entropy bonus, over a 10-step LR schedule."""


def full_params(module):
    return {k: v.full_tensor().clone() for k, v in module.state_dict().items()}


@pytest.mark.parametrize(
    "name", ["grpo", "rloo", "gae", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "gigpo", "opo"]
)
def test_every_estimator_learns_the_good_token(model_dir, name):
    trainer = PolicyTrainer(make_config(advantage=name, critic_lr=1e-2), model_dir)
    good0, bad0 = logprob_of(trainer, GOOD), logprob_of(trainer, BAD)
    for _ in range(6):
        metrics = trainer.train_step(good_bad_batch())
    assert logprob_of(trainer, GOOD) - good0 > 0.3 and logprob_of(trainer, BAD) - bad0 < -0.3, name
    assert all(torch.isfinite(torch.tensor(v)) for v in metrics.values() if isinstance(v, float))
    assert ("vf_loss" in metrics) == (name == "gae")


def test_remax_learns_against_the_greedy_baseline_and_never_trains_on_it(model_dir):
    trainer = PolicyTrainer(make_config(advantage="remax"), model_dir)
    good0, bad0 = logprob_of(trainer, GOOD), logprob_of(trainer, BAD)
    for _ in range(6):
        greedy = [episode(f"g{g}", BAD, 0.9) for g in range(3)]
        for traj in greedy:
            traj.baseline = True
        metrics = trainer.train_step(good_bad_batch() + greedy)
    assert logprob_of(trainer, GOOD) - good0 > 0.3 and logprob_of(trainer, BAD) - bad0 < -0.3
    assert metrics["num_trajectories"] == 12.0 and metrics["reward_mean"] == 0.5 and metrics["success_rate"] == 0.5


def test_critic_fits_the_returns(model_dir):
    trainer = PolicyTrainer(make_config(advantage="gae", critic_lr=1e-2, lr=1e-9, value_clip=10.0), model_dir)
    assert trainer.critic is not None and ADVANTAGES.get("gae").needs_values
    batch = good_bad_batch()
    history = [trainer.train_step(batch) for _ in range(25)]
    assert history[0]["values_mean"] == 0.0 and history[0]["vf_loss"] == pytest.approx(0.25)  # zero head
    # returns are 1 on both tokens of a GOOD episode, 0 on a BAD one; before the first token the outcome is
    # a coin flip, so the best critic predicts 0.5 there and the loss floor is 0.5 * (0.25 + 0) / 2
    assert history[-1]["vf_loss"] < 0.075
    collated = collate(batch, pad_id=0)
    values = trainer.critic.values(collated.input_ids, collated.attention_mask)
    good = [i for i, t in enumerate(batch) if t.token_ids[3] == GOOD]
    bad = [i for i, t in enumerate(batch) if t.token_ids[3] == BAD]
    assert values[:, 3].sub(0.5).abs().max() < 0.15  # V(prompt)
    assert values[good, 4].min() > 0.8 and values[bad, 4].abs().max() < 0.2  # V(prompt + GOOD / BAD)


def test_kl_to_reference_starts_at_zero_and_the_loss_term_holds_the_policy_back(model_dir):
    runs = {}
    for coef in (0.0, 5.0):
        trainer = PolicyTrainer(make_config(use_kl_loss=True, kl_loss_coef=coef, kl_loss_type="low_var_kl"), model_dir)
        history = [trainer.train_step(good_bad_batch()) for _ in range(6)]
        assert history[0]["kl_ref"] == 0.0 and history[0]["kl_loss"] == 0.0
        runs[coef] = history[-1]["kl_ref"]
    assert runs[0.0] > 2 * runs[5.0] > 0


def test_kl_in_reward_with_adaptive_coefficient(model_dir):
    trainer = PolicyTrainer(
        make_config(
            use_kl_in_reward=True, kl_penalty="kl", kl_ctrl="adaptive", kl_coef=0.1, kl_target=1e-6, kl_horizon=100
        ),
        model_dir,
    )
    history = [trainer.train_step(good_bad_batch()) for _ in range(4)]
    assert history[0]["kl_in_reward"] == 0.0 and history[0]["kl_coef"] == 0.1
    # the first step saw KL 0 < target: the coefficient shrank by 20% * 12 / 100; later KL >> target grows it
    assert history[1]["kl_coef"] == pytest.approx(0.1 * (1 - 0.2 * 12 / 100))
    assert history[3]["kl_in_reward"] > 0 and history[3]["kl_coef"] > history[2]["kl_coef"]
    assert trainer.kl_ctrl.value > history[3]["kl_coef"]


def test_kl_penalty_changes_the_advantages(model_dir):
    """With rewards all equal, GRPO advantages come only from the penalty: tokens the policy now likes more
    than the reference does are pushed down."""
    config = make_config(use_kl_in_reward=True, kl_penalty="kl", kl_coef=1.0, norm_adv_by_std=False)
    trainer = PolicyTrainer(config, model_dir)
    plain = PolicyTrainer(make_config(), model_dir)
    for t in (trainer, plain):
        t.train_step(good_bad_batch())  # move away from the reference
    same = [episode(f"g{g}", tok, 1.0) for g in range(2) for tok in (GOOD, BAD)]
    assert plain.train_step(same)["advantage_abs_mean"] == 0.0
    metrics = trainer.train_step(same)
    assert metrics["advantage_abs_mean"] > 0 and metrics["kl_in_reward"] != 0


def test_entropy_bonus_keeps_entropy_up(model_dir):
    entropies = {}
    for coeff in (0.0, 0.5):
        trainer = PolicyTrainer(make_config(entropy_coeff=coeff), model_dir)
        history = [trainer.train_step(good_bad_batch()) for _ in range(5)]
        entropies[coeff] = (history[0]["entropy"], history[-1]["entropy"])
        if coeff:
            assert history[0]["entropy_loss"] == pytest.approx(history[0]["entropy"], rel=1e-5)  # token-mean
    (start, plain), (_, bonus) = entropies[0.0], entropies[0.5]
    assert plain < start - 0.03 and bonus > plain + 0.015


def test_truncated_importance_weights(model_dir):
    trainer = PolicyTrainer(make_config(tis_cap=1.5), model_dir)
    lp_good = logprob_of(trainer, GOOD)
    batch = [episode(f"g{g}", GOOD, float(g % 2), logprob=lp_good - 5.0) for g in range(4)]  # rollout far less sure
    metrics = trainer.train_step(batch)
    assert metrics["tis_clip_frac"] > 0.4 and 1.0 < metrics["tis_weight_mean"] <= 1.5
    off = PolicyTrainer(make_config(tis_cap=0.0), model_dir).train_step(batch)
    assert "tis_weight_mean" not in off


def test_lr_schedule_warmup_is_reported_and_applied(model_dir):
    trainer = PolicyTrainer(
        make_config(lr=1e-3, lr_warmup_steps=4, lr_schedule="cosine", advantage="gae", critic_lr=2e-3), model_dir
    )
    lrs = [(m["lr"], m["critic_lr"]) for m in (trainer.train_step(good_bad_batch()) for _ in range(6))]
    # 4 warm-up steps, then cosine over the remaining 6 of learner.steps = 10
    assert [a for a, _ in lrs] == pytest.approx(
        [2.5e-4, 5e-4, 7.5e-4, 1e-3, 1e-3, 1e-3 * 0.5 * (1 + 3**0.5 / 2)], rel=1e-6
    )
    assert [b for _, b in lrs] == pytest.approx([2 * a for a, _ in lrs])


CHECKPOINT_FILES = {
    "full": {"model.pt", "optimizer.pt", "critic_model.pt", "critic_optimizer.pt"},
    "sharded": {"shards"},
}


@pytest.mark.parametrize("fmt", sorted(CHECKPOINT_FILES))
def test_checkpoint_with_critic_reference_schedule_and_controller_resumes_exactly(model_dir, tmp_path, fmt):
    config = make_config(
        advantage="gae",
        use_kl_in_reward=True,
        kl_ctrl="adaptive",
        kl_target=0.01,
        kl_horizon=50,
        use_kl_loss=True,
        kl_loss_coef=0.1,
        entropy_coeff=0.01,
        ppo_epochs=2,
        lr_warmup_steps=2,
        lr_schedule="cosine",
        critic_lr=5e-3,
    )
    config.learner.checkpoint_format = fmt
    trainer = PolicyTrainer(config, model_dir)
    for seed in range(3):
        trainer.train_step(synthetic_trajectories(6, 3, seed=seed))
    path = trainer.save_checkpoint(tmp_path, {"k": 1})
    assert {p.name for p in path.iterdir()} == CHECKPOINT_FILES[fmt] | {
        "trainer_state.pt",
        "rng.pt",
        "meta.json",
        "COMMITTED",
    }
    assert json.loads((path / "meta.json").read_text())["format"] == fmt
    fresh = PolicyTrainer(config, model_dir)
    assert fresh.load_checkpoint(path) == {"k": 1}
    assert fresh.kl_ctrl.value == trainer.kl_ctrl.value != config.algorithm.kl_coef
    assert fresh.optimizer.param_groups[0]["lr"] == trainer.optimizer.param_groups[0]["lr"]
    for a, b in ((trainer.model, fresh.model), (trainer.critic.model, fresh.critic.model)):
        pa, pb = full_params(a), full_params(b)
        assert all(torch.equal(pa[k], pb[k]) for k in pa)
    for seed in (7, 8):
        nxt = synthetic_trajectories(6, 3, seed=seed)
        assert untimed(trainer.train_step(nxt)) == untimed(fresh.train_step(nxt))


def test_checkpoint_refuses_other_reference_or_missing_critic(model_dir, tmp_path):
    config = make_config(use_kl_loss=True)
    trainer = PolicyTrainer(config, model_dir)
    trainer.train_step(good_bad_batch())
    path = trainer.save_checkpoint(tmp_path / "a")
    other = build_tiny_llama(tmp_path / "other", seed=5)
    with pytest.raises(ValueError, match="reference model changed"):
        PolicyTrainer(config, str(other)).load_checkpoint(path)
    with pytest.raises(ValueError, match="critic"):
        PolicyTrainer(make_config(advantage="gae"), model_dir).load_checkpoint(path)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
def test_micro_batching_equals_full_batch_with_critic_and_kl(model_dir, mode):
    trajs = synthetic_trajectories(7, 4, seed=5)
    runs = []
    for size in (2, 64):
        config = make_config(
            advantage="gae",
            loss_agg_mode=mode,
            micro_batch_size=size,
            ppo_epochs=2,
            use_kl_loss=True,
            kl_loss_coef=0.5,
            use_kl_in_reward=True,
            entropy_coeff=0.1,
        )
        trainer = PolicyTrainer(config, model_dir)
        trainer.train_step(trajs)
        runs.append((trainer.train_step(trajs), full_params(trainer.critic.model)))
    (m_small, c_small), (m_full, c_full) = runs
    for key in (
        "loss",
        "pg_loss",
        "vf_loss",
        "kl_loss",
        "entropy_loss",
        "kl_in_reward",
        "grad_norm",
        "critic_grad_norm",
        "vf_explained_var",
        "tis_weight_mean",
    ):
        assert m_small[key] == pytest.approx(m_full[key], rel=1e-5, abs=1e-7), key
    for name, value in c_small.items():
        torch.testing.assert_close(value, c_full[name], rtol=1e-4, atol=5e-5)


def test_kl_reference_logprobs_are_the_initial_policy(model_dir):
    trainer = PolicyTrainer(make_config(use_kl_loss=True), model_dir)
    trainer.train_step(good_bad_batch())
    ids = torch.tensor([PROMPT + [GOOD]])
    ref = trainer.reference.logprobs(ids, torch.ones_like(ids))
    fresh = PolicyTrainer(make_config(), model_dir)
    torch.testing.assert_close(ref, token_logprobs(fresh.model, ids, torch.ones_like(ids)))
    now = token_logprobs(trainer.model, ids, torch.ones_like(ids))
    assert kl_estimate(now, ref, "abs")[0, -1] > 0
