import random
import re

import pytest

from services.envs.base import InvalidTask
from services.envs.builtin.corridor import Corridor
from services.envs.builtin.guess_number import GuessNumber, turn_limit
from services.envs.registry import ENVS

SEEDS = range(500)


def corridor(task_index: int, **options) -> tuple[Corridor, str]:
    env = Corridor()
    return env, env.reset(task_index, options)


def test_registry_lists_builtins():
    assert {"corridor", "guess_number"} <= set(ENVS.names())
    assert ENVS.get("corridor") is Corridor and Corridor.name == "corridor"
    assert ENVS.get("guess_number") is GuessNumber and GuessNumber.name == "guess_number"


@pytest.mark.parametrize("cls", [Corridor, GuessNumber])
def test_first_observation_states_the_action_format(cls):
    observation = cls().reset(0, {})
    assert "<action>" in observation and "</action>" in observation


def test_corridor_following_the_hint_always_succeeds():
    for seed in SEEDS:
        env, observation = corridor(seed)
        for turn in range(1, 4):
            side = re.search(r"exit is to the (left|right)", observation).group(1)
            result = env.step(side)
            observation = result.observation
            if result.done:
                break
        assert (result.done, result.success, result.reward, turn) == (True, True, 1.0, 3), seed


def test_corridor_task_layout():
    sides = []
    for seed in SEEDS:
        env, _ = corridor(seed)
        assert abs(env.exit - env.position) == 3
        behind = env.position - 1 if env.exit > env.position else env.position + 1
        assert 0 <= behind < 8, "the start never touches the wall behind it"
        sides.append(env.exit > env.position)
    assert 0.4 < sum(sides) / len(sides) < 0.6


def test_corridor_same_seed_same_task():
    for seed in (0, 7, 123456789):
        a, obs_a = corridor(seed)
        b, obs_b = corridor(seed)
        assert (obs_a, a.position, a.exit) == (obs_b, b.position, b.exit)
    assert len({(e.position, e.exit) for e in (corridor(s)[0] for s in SEEDS)}) > 5


def test_corridor_actions_are_case_insensitive_and_stripped():
    env, _ = corridor(1)
    start = env.position
    result = env.step("  LeFT\n")
    assert result.info == {"turn": 1, "position": start - 1, "action_valid": True}


def test_corridor_invalid_action_counts_as_a_turn():
    env, _ = corridor(2)
    start = env.position
    for turn in range(1, 5):
        result = env.step("jump")
        assert "Invalid action 'jump'" in result.observation and "left or right" in result.observation
        assert result.info["action_valid"] is False and env.position == start
    assert (result.done, result.success, result.reward, turn) == (True, False, 0.0, 4)


def test_corridor_wall_keeps_the_agent_in_place():
    seed = next(s for s in SEEDS if corridor(s)[0].position == 1 and corridor(s)[0].exit == 4)
    env, _ = corridor(seed, max_turns=10)
    assert env.step("left").info["position"] == 0
    result = env.step("left")
    assert result.observation.startswith("You hit the wall.") and result.info["position"] == 0
    assert not result.done


def test_corridor_without_hint_hides_the_side():
    env, observation = corridor(3, hint=False)
    assert "exit is to the" not in observation
    assert "exit is to the" not in env.step("left").observation


def test_corridor_options():
    env, observation = corridor(5, length=20, distance=6, max_turns=9)
    assert abs(env.exit - env.position) == 6 and env.max_turns == 9 and "cells 0 to 19" in observation
    for bad in ({"bogus": 1}, {"length": 4, "distance": 3}, {"length": "long"}, {"max_turns": 0}):
        with pytest.raises(InvalidTask):
            corridor(0, **bad)


MIXED = {"length": 8, "distances": [1, 3, 5], "max_turns": 3}


def follow_the_hint(env: Corridor, observation: str):
    while True:
        result = env.step(re.search(r"exit is to the (left|right)", observation).group(1))
        if result.done:
            return result
        observation = result.observation


def test_corridor_distances_cycle_by_task_index():
    for seed in SEEDS:
        env, _ = corridor(seed, **MIXED)
        assert abs(env.exit - env.position) == [1, 3, 5][seed % 3], seed
        behind = env.position - 1 if env.exit > env.position else env.position + 1
        assert 0 <= behind < 8, "the start never touches the wall behind it"
    a, obs_a = corridor(7, **MIXED)
    b, obs_b = corridor(7, **MIXED)
    assert (obs_a, a.position, a.exit) == (obs_b, b.position, b.exit)


def test_corridor_distances_out_of_reach_always_fail():
    for seed in SEEDS:
        env, observation = corridor(seed, **MIXED)
        distance = abs(env.exit - env.position)
        assert follow_the_hint(env, observation).success == (distance <= 3), seed


def test_corridor_without_distances_is_unchanged():
    for seed in (0, 1, 2, 99):
        a, obs_a = corridor(seed, length=8, distance=3)
        b, obs_b = corridor(seed, length=8, distances=[3])
        assert (obs_a, a.position, a.exit) == (obs_b, b.position, b.exit)


@pytest.mark.parametrize(
    "bad",
    [
        {"distances": []},
        {"distances": [0, 1]},
        {"distances": [1, "far"]},
        {"distances": 3},
        {"length": 6, "distances": [1, 5]},
        {"distance": 3, "distances": [1, 3]},
    ],
)
def test_corridor_bad_distances_are_refused(bad):
    with pytest.raises(InvalidTask):
        corridor(0, **bad)


def test_corridor_random_policy_succeeds_one_time_in_eight():
    rng = random.Random(0)
    episodes, wins = 2000, 0
    for seed in range(episodes):
        env, _ = corridor(seed)
        result = env.step(rng.choice(["left", "right"]))
        while not result.done:
            result = env.step(rng.choice(["left", "right"]))
        wins += result.success
    assert abs(wins / episodes - 0.125) < 0.025  # documented rate; 0.025 is over 3 standard errors


def binary_search(env: GuessNumber, n: int):
    low, high = 1, n
    while True:
        guess = (low + high) // 2
        result = env.step(str(guess))
        if result.done:
            return result
        if "higher" in result.observation:
            low = guess + 1
        else:
            assert "lower" in result.observation
            high = guess - 1


@pytest.mark.parametrize("n", [1, 2, 16, 100, 1000])
def test_guess_number_binary_search_always_succeeds(n):
    for seed in SEEDS:
        env = GuessNumber()
        env.reset(seed, {"max_number": n})
        result = binary_search(env, n)
        assert (result.success, result.reward) == (True, 1.0), (n, seed)
        assert "correct" in result.observation and result.info["turn"] <= env.max_turns


def test_guess_number_turn_limit():
    assert [turn_limit(n) for n in (1, 2, 3, 16, 17, 100)] == [1, 2, 3, 5, 6, 8]
    assert GuessNumber.max_turns == 5
    env = GuessNumber()
    env.reset(0, {"max_number": 16, "max_turns": 2})
    assert env.max_turns == 2


def test_guess_number_same_seed_same_secret():
    secrets = []
    for seed in SEEDS:
        a, b = GuessNumber(), GuessNumber()
        a.reset(seed, {})
        b.reset(seed, {})
        assert a.secret == b.secret and 1 <= a.secret <= 16
        secrets.append(a.secret)
    assert set(secrets) == set(range(1, 17))


def test_guess_number_feedback_and_invalid_guesses():
    env = GuessNumber()
    env.reset(11, {})
    low = env.step(str(env.secret - 1)) if env.secret > 1 else None
    if low:
        assert "higher" in low.observation and low.info["action_valid"]
    for bad in ("abc", "0", "17", "3.5"):
        result = env.step(bad)
        assert "Invalid guess" in result.observation and result.info["action_valid"] is False
        if result.done:
            break
    assert result.done and not result.success and str(env.secret) in result.observation
    with pytest.raises(InvalidTask):
        GuessNumber().reset(0, {"max_number": 0})
