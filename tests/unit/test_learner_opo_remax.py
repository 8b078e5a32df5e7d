"""OPO and ReMax against plain float64 loops (verl's compute_opo_outcome_advantage and
compute_remax_outcome_advantage semantics), and ReMax's greedy baseline episode through the learner's batch."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from services.common.config import AlgorithmConfig
from services.common.trajectory import RecordError, TrajectoryBuilder
from services.learner.advantages import build_estimator
from services.learner.advantages.base import AdvantageInputs
from services.learner.advantages.opo import OPO
from services.learner.advantages.remax import ReMax
from services.learner.batch import baseline_scores, split_baselines

batches = st.tuples(st.integers(0, 2**31), st.integers(1, 12), st.integers(1, 9), st.integers(1, 5))


def rand_batch(seed, batch, length, n_groups):
    gen = torch.Generator().manual_seed(seed)
    rewards = torch.randn(batch, length, generator=gen, dtype=torch.float64)
    mask = (torch.rand(batch, length, generator=gen) < 0.6).double()
    groups = torch.randint(0, n_groups, (batch,), generator=gen) * 5 + 11
    return rewards, mask, groups


def reference_opo(rewards, mask, groups, singleton):
    r, m, g = rewards.tolist(), mask.tolist(), groups.tolist()
    scores = [sum(a * b for a, b in zip(rr, mm)) for rr, mm in zip(r, m)]
    lengths = [sum(mm) for mm in m]
    out = torch.zeros_like(rewards)
    for i in range(len(r)):
        members = [j for j in range(len(r)) if g[j] == g[i]]
        if len(members) == 1:
            adv = scores[i] if singleton == "score" else 0.0
        else:
            total = sum(lengths[j] for j in members)
            baseline = sum(lengths[j] * scores[j] for j in members) / total if total else 0.0
            adv = scores[i] - baseline
        for t in range(len(r[i])):
            out[i, t] = adv * m[i][t]
    return out


def reference_remax(rewards, mask, baselines):
    r, m, b = rewards.tolist(), mask.tolist(), baselines.tolist()
    out = torch.zeros_like(rewards)
    for i in range(len(r)):
        for t in range(len(r[i])):
            if m[i][t]:
                to_go = sum(r[i][s] * m[i][s] for s in range(t, len(r[i])))
                out[i, t] = to_go - b[i]
    return out


@settings(max_examples=80, deadline=None)
@given(batches, st.sampled_from(["zero", "score"]))
def test_opo_matches_reference(args, singleton):
    rewards, mask, groups = rand_batch(*args)
    got = OPO(singleton=singleton).compute(AdvantageInputs(rewards, mask, groups))
    torch.testing.assert_close(got, reference_opo(rewards, mask, groups, singleton))


def test_opo_weights_the_baseline_by_length():
    rewards = torch.tensor([[0.0, 0.0, 1.0], [2.0, 0.0, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]], dtype=torch.float64)
    adv = OPO().compute(AdvantageInputs(rewards, mask, torch.tensor([0, 0])))
    baseline = (3 * 1.0 + 1 * 2.0) / 4
    torch.testing.assert_close(adv, torch.tensor([[1 - baseline] * 3, [2 - baseline, 0, 0]], dtype=torch.float64))


def test_opo_equal_scores_give_zero_and_singletons_follow_the_setting():
    rewards = torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.0, 1.0], [0.0, 3.0]])
    mask = torch.tensor([[1.0, 1.0], [1.0, 1.0], [0.0, 1.0], [1.0, 1.0]])
    groups = torch.tensor([0, 0, 0, 1])
    zero = OPO().compute(AdvantageInputs(rewards, mask, groups))
    assert zero.abs().max() == 0
    score = OPO(singleton="score").compute(AdvantageInputs(rewards, mask, groups))
    assert score[:3].abs().max() == 0 and score[3].tolist() == [3.0, 3.0]


@settings(max_examples=80, deadline=None)
@given(batches)
def test_remax_matches_reference(args):
    rewards, mask, groups = rand_batch(*args)
    _, dense = torch.unique(groups, return_inverse=True)
    baselines = torch.randn(int(dense.max()) + 1, generator=torch.Generator().manual_seed(args[0]), dtype=torch.float64)
    got = ReMax().compute(AdvantageInputs(rewards, mask, groups, baselines=baselines[dense]))
    torch.testing.assert_close(got, reference_remax(rewards, mask, baselines[dense]))


def test_remax_reward_equal_to_the_baseline_gives_zero_on_the_last_token():
    rewards = torch.tensor([[0.0, 0.0, 1.0], [0.0, 1.0, 0.0]], dtype=torch.float64)  # last_token allocation
    mask = torch.tensor([[1.0, 0.0, 1.0], [1.0, 1.0, 0.0]], dtype=torch.float64)
    adv = ReMax().compute(AdvantageInputs(rewards, mask, torch.tensor([0, 1]), baselines=torch.tensor([1.0, 1.0])))
    torch.testing.assert_close(adv, torch.zeros(2, 3, dtype=torch.float64))


def test_remax_needs_baselines_and_both_come_from_config():
    with pytest.raises(ValueError, match="baseline"):
        ReMax().compute(AdvantageInputs(torch.zeros(1, 2), torch.ones(1, 2), torch.zeros(1)))
    remax = build_estimator(AlgorithmConfig(advantage="remax"))
    assert isinstance(remax, ReMax) and remax.needs_baseline and not remax.needs_values
    opo = build_estimator(AlgorithmConfig(advantage="opo", singleton_group_advantage="score"))
    assert isinstance(opo, OPO) and opo.singleton == "score" and not opo.needs_baseline


def episode(group, reward, baseline=False, turns=1):
    b = TrajectoryBuilder(env="t", task_index=0, group_id=group, prompt_ids=[3, 4])
    for _ in range(turns):
        b.add_model_turn(
            [5, 6], [-0.5, -0.5], policy_version=0, text="", action="", action_valid=True, finish_reason=""
        )
        b.add_observation([7], env_reward=0.0)
    traj = b.finish(env_return=reward, success=reward > 0, stop_reason="done")
    traj.reward, traj.baseline = reward, baseline
    return traj


def test_baseline_episodes_leave_the_batch_and_give_their_group_its_score():
    batch = [episode("a", 1.0), episode("a", 0.5, baseline=True), episode("b", 0.0), episode("b", 2.0, True, turns=2)]
    rows, greedy = split_baselines(batch)
    assert [t.reward for t in rows] == [1.0, 0.0] and not any(t.baseline for t in rows)
    assert baseline_scores(rows, greedy, "last_token", 1.0).tolist() == [0.5, 2.0]
    # as a row's score: the sum of its allocated token rewards (`discounted`: the earlier turn's share is
    # discounted by gamma per token of the later turn)
    assert baseline_scores(rows, greedy, "discounted", 0.5).tolist() == [0.5, 2.0 + 2.0 * 0.5**2]
    with pytest.raises(RecordError, match="b have no baseline"):
        baseline_scores(rows, {"a": greedy["a"]}, "last_token", 1.0)


def test_the_step_summary_and_prometheus_leave_the_baseline_episodes_out(redis_url, run_name, tmp_path):
    """LearnerService's own step metrics (`trajectories`, the reward components) and the trained trajectories
    counter count the sampled episodes only, as the trainer's metrics do."""
    from types import SimpleNamespace

    from prometheus_client import REGISTRY

    from services.common.config import TrainConfig
    from services.common.run_state import RunState
    from services.common.stream import TrajectoryStream
    from services.learner.service import LearnerService
    from services.weightsync.buckets import TensorWeights
    from services.weightsync.none import NoPush
    from tests.support.claims import publish_claimed

    class Trainer:
        """Trains nothing: the summary's own counts are under test, not the trainer's."""

        policy_version = 0
        latest_checkpoint = staticmethod(lambda directory: None)
        export_hf = staticmethod(lambda out_dir: None)
        weight_set_for_push = staticmethod(lambda: TensorWeights.of([]))

        def start_checkpoint(self, directory, extra, background=False):
            return SimpleNamespace(commit=lambda: None)

        def train_step(self, trajectories):
            return {"reward_mean": 0.0, "success_rate": 0.0}

    cfg = TrainConfig.model_validate(
        {
            "run": run_name,
            "rollout": {"groups_per_step": 2, "group_size": 2},
            "algorithm": {"advantage": "remax"},
            "stream": {"redis_url": redis_url, "read_block_ms": 50},
            "learner": {
                "steps": 1,
                "step_timeout_s": 5,
                "weight_push": "none",
                "checkpoint_dir": str(tmp_path / "ckpt"),
            },
        }
    )
    state = RunState.connect(cfg)
    stream = TrajectoryStream(state.client, state.trajectories_key)
    trained_before = REGISTRY.get_sample_value("omrl_learner_trained_trajectories_total") or 0
    try:
        stream.ensure_group()
        for gid in ("a", "b"):
            members = [episode(gid, 0.0), episode(gid, 0.0), episode(gid, 1.0, baseline=True)]
            for member in members:
                member.reward_components["goal"] = member.reward
            publish_claimed(state, members, gid)
        (summary,) = LearnerService(cfg, Trainer(), NoPush(), state, stream).run()
    finally:
        state.reset()
    assert summary["trajectories"] == 4 and summary["groups"] == 2
    assert summary["reward/goal"] == 0.0  # the greedy episodes scored 1.0
    assert REGISTRY.get_sample_value("omrl_learner_trained_trajectories_total") == trained_before + 4
