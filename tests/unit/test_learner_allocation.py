import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.common.trajectory import TrajectoryBuilder, model_segments
from services.learner.allocation import ALLOCATIONS, allocate, trajectory_token_rewards

# (prompt, [(model tokens, env tokens), ...]) as a loss mask and its model segments
layouts = st.tuples(st.integers(1, 4), st.lists(st.tuples(st.integers(0, 5), st.integers(0, 4)), max_size=5))
rewards = st.floats(-5, 5, allow_nan=False)
gammas = st.floats(0, 1)


def build(layout):
    prompt, turns = layout
    mask, segments = [0] * prompt, []
    for model, env in turns:
        if model:
            segments.append((len(mask), len(mask) + model))
        mask += [1] * model + [0] * env
    return mask, segments


def ref_last(mask, reward):
    out = [0.0] * len(mask)
    model = [i for i, m in enumerate(mask) if m]
    if model:
        out[model[-1]] = reward
    return out


def ref_discounted(mask, segments, reward, gamma):
    out = [0.0] * len(mask)
    for k, (start, end) in enumerate(segments):
        later = sum(e - s for s, e in segments[k + 1 :])
        for i in range(start, end):
            out[i] = reward * gamma**later / (end - start)
    return out


@settings(max_examples=200, deadline=None)
@given(layouts, rewards, gammas)
def test_matches_reference(layout, reward, gamma):
    mask, segments = build(layout)
    assert allocate("last_token", mask, segments, reward, gamma) == ref_last(mask, reward)
    n = sum(mask)
    uniform = allocate("uniform_positive", mask, segments, reward, gamma)
    if reward > 0 and n:
        assert uniform == [reward / n if m else 0.0 for m in mask]
        assert math.isclose(sum(uniform), reward, rel_tol=1e-9, abs_tol=1e-12)
    else:
        assert uniform == ref_last(mask, reward)
    disc = allocate("discounted", mask, segments, reward, gamma)
    assert disc == pytest.approx(ref_discounted(mask, segments, reward, gamma), rel=1e-9, abs=1e-12)
    for out in (uniform, disc):
        assert len(out) == len(mask)
        assert all(v == 0.0 for v, m in zip(out, mask) if not m)


def test_discounted_worked_example():
    # prompt 2, turn A: 2 model + 1 env, turn B: 1 model
    mask = [0, 0, 1, 1, 0, 1]
    out = allocate("discounted", mask, [(2, 4), (5, 6)], 1.0, 0.5)
    assert out == [0.0, 0.0, 0.25, 0.25, 0.0, 1.0]
    assert allocate("discounted", mask, [(2, 4), (5, 6)], 1.0, 1.0) == [0.0, 0.0, 0.5, 0.5, 0.0, 1.0]


def test_no_model_tokens_gives_zeros():
    for name in ALLOCATIONS.names():
        assert allocate(name, [0, 0, 0], [], 3.0, 0.9) == [0.0, 0.0, 0.0]


def test_from_trajectory_record():
    b = TrajectoryBuilder(env="e", task_index=0, group_id="g", prompt_ids=[5, 6])
    b.add_model_turn(
        [7, 8], [-0.1, -0.2], policy_version=0, text="", action="", action_valid=True, finish_reason="stop"
    )
    b.add_observation([9], env_reward=0.0)
    b.add_model_turn([10], [-0.3], policy_version=0, text="", action="", action_valid=True, finish_reason="stop")
    traj = b.finish(env_return=1.0, success=True, stop_reason="done")
    traj.reward = 2.0
    assert model_segments(traj) == [(2, 4), (5, 6)]
    assert trajectory_token_rewards(traj, "uniform_positive") == pytest.approx([0, 0, 2 / 3, 2 / 3, 0, 2 / 3])
    assert trajectory_token_rewards(traj, "last_token") == [0, 0, 0, 0, 0, 2.0]


def test_unknown_allocation():
    with pytest.raises(KeyError, match="known: discounted, last_token, uniform_positive"):
        allocate("nope", [1], [(0, 1)], 1.0)


def three_turns(process: list[float], reward: float, model_tokens=(2, 1, 2)):
    """Prompt 2, then turns of `model_tokens` model tokens each followed by one env token, with these process
    rewards and the total `reward`."""
    b = TrajectoryBuilder(env="e", task_index=0, group_id="g", prompt_ids=[5, 6])
    for n in model_tokens:
        b.add_model_turn([7] * n, [-0.1] * n, policy_version=0, text="", action="", action_valid=True, finish_reason="")
        b.add_observation([9], env_reward=0.0)
    traj = b.finish(env_return=0.0, success=False, stop_reason="done")
    for turn, value in zip(traj.turns, process):
        turn.process_reward = value
    traj.reward = reward
    return traj


def test_process_rewards_land_on_their_turns_and_the_outcome_on_the_episode():
    # tokens: 0-1 prompt, 2-3 turn A, 4 env, 5 turn B, 6 env, 7-8 turn C, 9 env; outcome = 3 - (0.5 + 1 - 0.5) = 2
    traj = three_turns([0.5, 1.0, -0.5], reward=3.0)
    assert trajectory_token_rewards(traj, "last_token") == [0, 0, 0, 0.5, 0, 1.0, 0, 0, 2.0 - 0.5, 0]
    uniform = trajectory_token_rewards(traj, "uniform_positive")
    assert uniform == pytest.approx([0, 0, 0.25 + 0.4, 0.25 + 0.4, 0, 1.0 + 0.4, 0, 0.4, 0.4 - 0.5, 0])
    # discounted, gamma 0.5: a turn's reward spread over it, then discounted back by 0.5 per token of each turn
    disc = trajectory_token_rewards(traj, "discounted", gamma=0.5)
    outcome = allocate("discounted", list(traj.loss_mask), model_segments(traj), 2.0, 0.5)
    a = [0, 0, 0.25, 0.25, 0, 0, 0, 0, 0, 0]
    b = [0, 0, 0.5 / 2, 0.5 / 2, 0, 1.0, 0, 0, 0, 0]  # B's 1.0 on B, then 0.5 (one token back) spread over A
    c = [0, 0, -0.5 * 0.125 / 2, -0.5 * 0.125 / 2, 0, -0.5 * 0.25, 0, -0.25, -0.25, 0]
    assert disc == pytest.approx([sum(v) for v in zip(outcome, a, b, c)])
    for name in ALLOCATIONS.names():
        if name != "discounted":
            assert sum(trajectory_token_rewards(traj, name)) == pytest.approx(3.0)


def test_a_turn_without_model_tokens_gives_its_process_reward_to_the_outcome():
    traj = three_turns([0.0, 2.0, 0.0], reward=3.0, model_tokens=(2, 0, 1))
    assert trajectory_token_rewards(traj, "last_token") == [0, 0, 0, 0, 0, 0, 3.0, 0]


def test_without_process_rewards_the_allocation_is_the_episodes():
    traj = three_turns([0.0, 0.0, 0.0], reward=3.0)
    for name in ALLOCATIONS.names():
        assert trajectory_token_rewards(traj, name, 0.9) == allocate(
            name, list(traj.loss_mask), model_segments(traj), 3.0, 0.9
        )
