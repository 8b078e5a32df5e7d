"""GiGPO (services.learner.advantages.gigpo) against a straightforward loop over episodes and turns, the edge cases
of its two levels, and the turns the learner reads from trajectory records."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from services.common.config import AlgorithmConfig
from services.common.trajectory import TrajectoryBuilder
from services.learner.advantages import build_estimator
from services.learner.advantages.base import AdvantageInputs, Turns
from services.learner.advantages.gigpo import GiGPO, anchor_groups
from services.learner.advantages.grpo import GRPO
from services.learner.batch import collate, turns_of

EPS = 1e-6


def episode(task, turns, prompt=1, env_tokens=1):
    """turns: (model tokens, reward, invalid, anchor) each."""
    return {"task": task, "turns": turns, "prompt": prompt, "env_tokens": env_tokens}


def layout(episodes, seed=0):
    """(token_rewards, mask, group_index, Turns): every row's prompt, then per turn its model and env tokens."""
    spans, length = [], 0
    for ep in episodes:
        pos, row = ep["prompt"], []
        for tokens, *_ in ep["turns"]:
            row.append((pos, pos + tokens))
            pos += tokens + ep["env_tokens"]
        spans.append(row)
        length = max(length, pos)
    gen = torch.Generator().manual_seed(seed)
    rewards = torch.randn(len(episodes), max(length, 1), generator=gen, dtype=torch.float64).round(decimals=1)
    mask = torch.zeros_like(rewards)
    for i, row in enumerate(spans):
        for s, e in row:
            mask[i, s:e] = 1
    flat = [(i, s, e, t) for i, (ep, row) in enumerate(zip(episodes, spans)) for (s, e), t in zip(row, ep["turns"])]
    turns = Turns(
        row=torch.tensor([f[0] for f in flat], dtype=torch.long),
        start=torch.tensor([f[1] for f in flat], dtype=torch.long),
        end=torch.tensor([f[2] for f in flat], dtype=torch.long),
        reward=torch.tensor([f[3][1] for f in flat], dtype=torch.float32),
        invalid=torch.tensor([f[3][2] for f in flat], dtype=torch.bool),
        anchor=tuple(f[3][3] for f in flat),
    )
    groups = torch.tensor([ep["task"] for ep in episodes], dtype=torch.long)
    return rewards, mask, groups, turns


def normalise(value, pool, use_std):
    if not pool:
        mean = var = 0.0
    else:
        mean = sum(pool) / len(pool)
        var = sum((v - mean) ** 2 for v in pool) / max(len(pool) - 1, 1)
    return (value - mean) / (math.sqrt(var) + EPS) if use_std else value - mean


def reference_gigpo(episodes, rewards, mask, *, norm, stats, gamma, weight, penalty):
    """The algorithm read off the paper, one loop per quantity, with this project's convention that a group of one
    member (a task played once, an anchor state met once) contributes 0."""
    use_std = norm == "mean_std_norm"
    n = len(episodes)
    scores = [
        float((rewards[i] * mask[i]).sum()) - penalty * sum(bool(t[2]) for t in episodes[i]["turns"]) for i in range(n)
    ]
    episode_adv = []
    for i in range(n):
        same = [j for j in range(n) if episodes[j]["task"] == episodes[i]["task"]]
        if len(same) < 2:
            episode_adv.append(0.0)
            continue
        counted = [scores[j] for j in same for _ in (episodes[j]["turns"] if stats == "steps" else [None])]
        episode_adv.append(normalise(scores[i], counted, use_std))
    returns = []  # (episode, turn index) -> G_t
    for ep in episodes:
        step_rewards = [r - penalty * bool(bad) for _, r, bad, _ in ep["turns"]]
        returns.append(
            [
                sum(gamma ** (k - t) * step_rewards[k] for k in range(t, len(step_rewards)))
                for t in range(len(step_rewards))
            ]
        )
    out = torch.zeros_like(rewards)
    for i, ep in enumerate(episodes):
        pos = ep["prompt"]
        for t, (tokens, _, _, anchor) in enumerate(ep["turns"]):
            members = [
                returns[j][u]
                for j, other in enumerate(episodes)
                if other["task"] == ep["task"]
                for u, turn in enumerate(other["turns"])
                if anchor and turn[3] == anchor
            ]
            step = normalise(returns[i][t], members, use_std) if len(members) > 1 else 0.0
            out[i, pos : pos + tokens] = episode_adv[i] + weight * step
            pos += tokens + ep["env_tokens"]
    return out


def gigpo(episodes, seed=0, **options):
    rewards, mask, groups, turns = layout(episodes, seed)
    return GiGPO(**options).compute(AdvantageInputs(rewards, mask, groups, turns=turns)), (rewards, mask, groups)


OPTIONS = {"norm": "mean_norm", "episode_stats": "steps", "gamma": 0.9, "step_weight": 1.0, "invalid_action_penalty": 0}

turn_st = st.tuples(
    st.integers(0, 3), st.sampled_from([-1.0, 0.0, 0.5, 1.0]), st.booleans(), st.sampled_from(["", "a", "b", "c"])
)
episode_st = st.builds(
    episode,
    st.integers(0, 3).map(lambda t: t * 7 + 2),
    st.lists(turn_st, max_size=5),
    st.integers(1, 3),
    st.integers(0, 2),
)


@settings(max_examples=150, deadline=None)
@given(
    st.lists(episode_st, min_size=1, max_size=10),
    st.sampled_from(["mean_norm", "mean_std_norm"]),
    st.sampled_from(["steps", "episodes"]),
    st.sampled_from([0.0, 0.5, 0.95, 1.0]),
    st.sampled_from([0.0, 0.5, 1.0, 2.0]),
    st.sampled_from([0.0, 0.1]),
    st.integers(0, 2**31),
)
def test_gigpo_matches_the_reference_loop(episodes, norm, stats, gamma, weight, penalty, seed):
    got, (rewards, mask, _) = gigpo(
        episodes,
        seed,
        norm=norm,
        episode_stats=stats,
        gamma=gamma,
        step_weight=weight,
        invalid_action_penalty=penalty,
    )
    want = reference_gigpo(episodes, rewards, mask, norm=norm, stats=stats, gamma=gamma, weight=weight, penalty=penalty)
    torch.testing.assert_close(got, want)
    assert got.shape == mask.shape and not got[mask == 0].any()


@pytest.mark.parametrize("norm, norm_by_std", [("mean_norm", False), ("mean_std_norm", True)])
def test_every_anchor_unique_gives_the_episode_advantage(norm, norm_by_std):
    episodes = [episode(t, [(2, 1.0, False, f"{t}-{i}-{k}") for k in range(3)]) for i in range(4) for t in (0, 1)]
    episodes.append(episode(9, [(1, 1.0, False, "alone")]))  # a task played once
    got, (rewards, mask, groups) = gigpo(episodes, norm=norm, episode_stats="episodes")
    torch.testing.assert_close(got, GRPO(norm_adv_by_std=norm_by_std).compute(AdvantageInputs(rewards, mask, groups)))


def test_repeated_anchors_within_one_episode_share_a_group():
    # turns 0 and 2 act from state `a`: returns 0.25 and 1 (gamma 0.5), mean 0.625; `b` is met once
    rewards, mask, groups, turns = layout(
        [episode(0, [(1, 0.0, False, "a"), (1, 0.0, False, "b"), (1, 1.0, False, "a")])]
    )
    estimator = GiGPO(gamma=0.5)
    got = estimator.compute(AdvantageInputs(torch.zeros_like(rewards), mask, groups, turns=turns))
    torch.testing.assert_close(got[0, [1, 3, 5]], torch.tensor([-0.375, 0.0, 0.375], dtype=torch.float64))
    assert estimator.step_metrics() == pytest.approx(
        {"gigpo/anchor_grouped_frac": 2 / 3, "gigpo/step_advantage_abs_mean": 0.25}
    )


def test_identical_anchors_of_two_tasks_are_never_grouped():
    two_tasks = [episode(0, [(1, 1.0, False, "s")]), episode(1, [(1, 0.0, False, "s")])]
    got, _ = gigpo(two_tasks)
    assert not got.any()  # each task played once, each state met once
    one_task = [episode(0, [(1, 1.0, False, "s")]), episode(0, [(1, 0.0, False, "s")])]
    got, (rewards, mask, groups) = gigpo(one_task, step_weight=1.0)
    episode_only, _ = gigpo(one_task, step_weight=0.0)
    torch.testing.assert_close((got - episode_only)[:, 1], torch.tensor([0.5, -0.5], dtype=torch.float64))
    assert anchor_groups(["s", "s", "s", "s"], [0, 1, 0, 1]).tolist() == [0, 1, 0, 1]


def test_singleton_and_unnamed_states_contribute_nothing_at_the_step_level():
    episodes = [episode(0, [(1, 1.0, False, "x"), (1, 0.0, False, "")]), episode(0, [(1, 0.0, False, "")] * 2)]
    got, _ = gigpo(episodes, step_weight=1.0)
    episode_only, _ = gigpo(episodes, step_weight=0.0)
    torch.testing.assert_close(got, episode_only)
    assert anchor_groups(["", "", "x"], [0, 0, 0]).tolist() == [0, 1, 2]


@pytest.mark.parametrize("norm", ["mean_norm", "mean_std_norm"])
@pytest.mark.parametrize("stats", ["steps", "episodes"])
def test_all_equal_rewards_give_zero(norm, stats):
    # the same rewards everywhere: each state's turns come at the same point of their episodes, so equal returns
    episodes = [episode(0, [(2, 1.0, False, s) for s in "abc"], env_tokens=0) for _ in range(4)]
    rewards, mask, groups, turns = layout(episodes)
    rewards = torch.where(mask > 0, 0.5, 0.0).double()
    got = GiGPO(norm=norm, episode_stats=stats).compute(AdvantageInputs(rewards, mask, groups, turns=turns))
    assert not got.any()


@pytest.mark.parametrize(
    "stats, norm, want",
    [
        ("episodes", "mean_norm", [0.5, -0.5]),
        ("steps", "mean_norm", [0.75, -0.25]),  # scores counted as [1, 0, 0, 0]
        ("steps", "mean_std_norm", [0.75 / (0.5 + EPS), -0.25 / (0.5 + EPS)]),
        ("episodes", "mean_std_norm", [0.5 / (math.sqrt(0.5) + EPS), -0.5 / (math.sqrt(0.5) + EPS)]),
    ],
)
def test_episode_statistics_over_steps_or_episodes(stats, norm, want):
    episodes = [episode(0, [(1, 0.0, False, "u")]), episode(0, [(1, 0.0, False, v) for v in "xyz"])]
    rewards, mask, groups, turns = layout(episodes)
    rewards = torch.zeros_like(rewards)
    rewards[0, 1] = 1.0  # scores 1 (one turn) and 0 (three turns)
    got = GiGPO(norm=norm, episode_stats=stats).compute(AdvantageInputs(rewards, mask, groups, turns=turns))
    torch.testing.assert_close(got[:, 1], torch.tensor(want, dtype=torch.float64))


def test_step_normalisations_by_hand():
    # four turns from state `s` with returns 0, 1, 1, 2 (gamma 0: the turn's own reward): mean 1, std sqrt(2/3)
    episodes = [episode(0, [(1, r, False, "s")]) for r in (0.0, 1.0, 1.0, 2.0)]
    rewards, mask, groups, turns = layout(episodes)
    inputs = AdvantageInputs(torch.zeros_like(rewards), mask, groups, turns=turns)
    centred = torch.tensor([-1.0, 0.0, 0.0, 1.0], dtype=torch.float64)
    torch.testing.assert_close(GiGPO(gamma=0.0).compute(inputs)[:, 1], centred)
    got = GiGPO(gamma=0.0, norm="mean_std_norm").compute(inputs)[:, 1]
    torch.testing.assert_close(got, centred / (math.sqrt(2 / 3) + EPS))


def test_invalid_actions_are_penalised_at_both_levels():
    episodes = [episode(0, [(1, 0.0, True, "s")]), episode(0, [(1, 0.0, False, "s")])]
    rewards, mask, groups, turns = layout(episodes)
    inputs = AdvantageInputs(torch.zeros_like(rewards), mask, groups, turns=turns)
    torch.testing.assert_close(
        GiGPO(invalid_action_penalty=0.2).compute(inputs)[:, 1], torch.tensor([-0.2, 0.2], dtype=torch.float64)
    )  # each level: -0.1 for the invalid turn, +0.1 for the other


def test_similar_anchors_group_above_the_threshold_only():
    near = ["You are at row 1, column 2.", "You are at row 1, column 3.", "Something else entirely."]
    assert anchor_groups(near, [0, 0, 0], 1.0).tolist() == [0, 1, 2]
    assert anchor_groups(near, [0, 0, 0], 0.95).tolist() == [0, 0, 1]
    assert anchor_groups(near[:2], [0, 1], 0.5).tolist() == [0, 1]  # never across tasks


def test_without_turns_gigpo_refuses():
    rewards, mask, groups, _ = layout([episode(0, [(1, 0.0, False, "a")])])
    with pytest.raises(ValueError, match="turns"):
        GiGPO().compute(AdvantageInputs(rewards, mask, groups))


def record(group, turns):
    """A trajectory with one model turn per (reward, parsed, refused, anchor), each followed by an observation."""
    b = TrajectoryBuilder(env="maze", task_index=0, group_id=group, prompt_ids=[1, 2])
    for reward, parsed, refused, anchor in turns:
        turn = b.add_model_turn(
            [3, 4],
            [-0.1, -0.2],
            policy_version=0,
            text="",
            action="",
            action_valid=parsed,
            finish_reason="stop",
            anchor=anchor,
        )
        turn.action_rejected = refused
        b.add_observation([5], env_reward=reward)
    traj = b.finish(env_return=0.0, success=False, stop_reason="max_turns")
    traj.reward = sum(t[0] for t in turns)
    return traj


def test_the_learner_reads_each_turn_from_the_records():
    trajs = [
        record("g1", [(0.0, True, False, "start"), (1.0, True, True, "next")]),
        record("g2", [(0.5, False, False, "start")]),
    ]
    turns = turns_of(trajs)
    assert turns.row.tolist() == [0, 0, 1] and turns.anchor == ("start", "next", "start")
    assert turns.start.tolist() == [2, 5, 2] and turns.end.tolist() == [4, 7, 4]
    assert turns.reward.tolist() == [0.0, 1.0, 0.5] and turns.invalid.tolist() == [False, True, True]
    batch = collate(trajs, pad_id=0)
    estimator = build_estimator(AlgorithmConfig(advantage="gigpo", gigpo_norm="mean_std_norm", gigpo_gamma=0.5))
    assert estimator.needs_turns and estimator.use_std and estimator.gamma == 0.5
    adv = estimator.compute(AdvantageInputs(batch.token_rewards, batch.response_mask, batch.group_index, turns=turns))
    assert adv.shape == batch.response_mask.shape and not adv[batch.response_mask == 0].any()
    assert not adv.any()  # two tasks played once each, and no state met twice within a task
    assert estimator.step_metrics() == {"gigpo/anchor_grouped_frac": 0.0, "gigpo/step_advantage_abs_mean": 0.0}


@pytest.mark.parametrize(
    "step_reward, want", [("env", [-1.0, 1.0]), ("process", [1.5, -1.5]), ("env+process", [0.5, -0.5])]
)
def test_step_returns_use_the_env_reward_the_process_reward_or_both(step_reward, want):
    # two turns from state `s`: env rewards 0 and 2, process rewards 3 and 0 (gamma 0: the turn's own reward)
    trajs = [record("g", [(0.0, True, False, "s")]), record("g", [(2.0, True, False, "s")])]
    trajs[0].turns[0].process_reward = 3.0
    turns = turns_of(trajs)
    assert turns.process.tolist() == [3.0, 0.0]
    mask = torch.zeros(2, 4, dtype=torch.float64)
    mask[:, 2:4] = 1
    inputs = AdvantageInputs(torch.zeros_like(mask), mask, torch.tensor([0, 0]), turns=turns)
    got = GiGPO(gamma=0.0, step_reward=step_reward).compute(inputs)[:, 2]
    torch.testing.assert_close(got, torch.tensor(want, dtype=torch.float64))
    estimator = build_estimator(AlgorithmConfig(advantage="gigpo", gigpo_step_reward=step_reward))
    assert estimator.step_reward == step_reward
