"""Process rewards: per-turn reward components, their scores in the composer's result and the record, and their
way over gRPC."""

import asyncio

import pytest

from services.common.errors import Internal
from services.common.protos import reward_pb2
from services.common.registry import Registry
from services.common.trajectory import TrajectoryBuilder
from services.reward.base import RewardFunction, TurnRewardFunction
from services.reward.client import InProcessRewardClient, _checked
from services.reward.composer import RewardComposer, Scored
from services.reward.hinted_action import HintedAction
from services.reward.service import RewardService

HINTS = {"exit is to the left": "left", "exit is to the right": "right"}


def corridor_episode(*moves: tuple[str, str], success: bool = False, tid: str = "t"):
    """`moves`: (the hint side the turn acted under, or "" for none; the action taken, "" for an unparsed one)."""
    b = TrajectoryBuilder(env="corridor", task_index=0, group_id="g", prompt_ids=[1, 2], trajectory_id=tid)
    for side, action in moves:
        anchor = f"You are in cell 3. The exit is to the {side}." if side else "You are in cell 3."
        b.add_model_turn(
            [5, 6], [-0.5, -0.5], policy_version=0, text=action, action=action, action_valid=bool(action),
            finish_reason="stop", anchor=anchor,
        )  # fmt: skip
        b.add_observation([7], env_reward=0.0)
    return b.finish(env_return=float(success), success=success, stop_reason="done")


def test_hinted_action_scores_each_turn_by_the_hint_of_the_state_it_acted_from():
    rule = HintedAction(HINTS, match=1.0, mismatch=-0.5)
    traj = corridor_episode(("left", "left"), ("right", "left"), ("left", ""), ("", "right"), ("left", "LEFT "))
    assert rule.score_turns(traj) == [1.0, -0.5, -0.5, 0.0, 1.0]
    assert rule(traj) == pytest.approx(1.0)
    both = HintedAction({"exit": "left", "to the right": "right"})  # two phrases calling for different actions
    assert both.score_turns(corridor_episode(("right", "right"), ("left", "left"))) == [0.0, 1.0]


@pytest.mark.parametrize(
    "params, error",
    [
        ({"hints": {}}, "at least one phrase"),
        ({"hints": {"exit": " "}}, "non-empty"),
        ({"hints": HINTS, "match": "1"}, "match must be a number"),
    ],
)
def test_hinted_action_refuses_bad_params(params, error):
    with pytest.raises(ValueError, match=error):
        HintedAction(**params)


def test_the_composer_keeps_each_turns_weighted_process_reward_beside_the_outcome():
    composer = RewardComposer({"goal": {"weight": 2.0}, "hinted_action": {"weight": 0.5, "params": {"hints": HINTS}}})
    assert composer.per_turn
    traj = corridor_episode(("left", "left"), ("right", "left"), ("right", "right"), success=True)
    scored = composer.score(traj)
    assert scored.turns == [0.5, 0.0, 0.5]
    assert scored.components == {"goal": 2.0, "hinted_action": 1.0} and scored.total == pytest.approx(3.0)
    scored.apply_to(traj)
    assert traj.reward == pytest.approx(3.0) and [t.process_reward for t in traj.turns] == [0.5, 0.0, 0.5]
    assert dict(traj.reward_components) == {"goal": 2.0, "hinted_action": 1.0}
    outcome_only = RewardComposer({"goal": {}})
    assert not outcome_only.per_turn and outcome_only.score(traj).turns == []


class Miscounting(TurnRewardFunction):
    name = "miscounting"

    def score_turns(self, traj):
        return [1.0] * (len(traj.turns) + 1)


class NotFinite(TurnRewardFunction):
    name = "not_finite"

    def score_turns(self, traj):
        return [float("nan")] * len(traj.turns)


class Outcome(RewardFunction):
    name = "outcome"

    def __call__(self, traj):
        return 1.0


def test_a_process_reward_must_give_one_finite_score_per_turn():
    registry = Registry("reward function")
    for cls in (Miscounting, NotFinite, Outcome):
        registry.register(cls.name)(cls)
    traj = corridor_episode(("left", "left"), ("left", "left"), tid="bad")
    with pytest.raises(RuntimeError, match="'miscounting' gave 3 turn scores for trajectory 'bad' of 2 turns"):
        RewardComposer({"miscounting": {}}, registry=registry).score(traj)
    with pytest.raises(RuntimeError, match="'not_finite' gave nan for trajectory 'bad'"):
        RewardComposer({"not_finite": {}}, registry=registry).score(traj)
    with pytest.raises(NotImplementedError, match="scores whole episodes"):
        Outcome().score_turns(traj)


def test_the_in_process_client_returns_turn_rewards():
    service = RewardService(RewardComposer({"hinted_action": {"params": {"hints": HINTS}}}))
    trajs = [corridor_episode(("left", "left"), ("right", "left"), tid="a"), corridor_episode(("left", "right"))]
    scores = asyncio.run(InProcessRewardClient(service).score(trajs))
    assert [s.turns for s in scores] == [[1.0, 0.0], [0.0]]


def test_a_reply_over_grpc_is_checked_before_its_turn_rewards_are_used():
    traj = corridor_episode(("left", "left"), ("left", "left"), tid="x")
    good = reward_pb2.RewardBreakdown(trajectory_id="x", total=2.0, components={"h": 2.0}, turn_rewards=[1.0, 1.0])
    assert _checked(good, traj) == Scored(2.0, {"h": 2.0}, [1.0, 1.0])
    assert _checked(reward_pb2.RewardBreakdown(total=1.0), traj).turns == []
    with pytest.raises(Internal, match="3 turn rewards for trajectory 'x' of 2 turns"):
        _checked(reward_pb2.RewardBreakdown(total=1.0, turn_rewards=[1, 1, 1]), traj)
    with pytest.raises(Internal, match="non-finite"):
        _checked(reward_pb2.RewardBreakdown(total=1.0, turn_rewards=[1, float("inf")]), traj)
    with pytest.raises(ValueError, match="1 turn rewards"):
        Scored(1.0, {}, [1.0]).apply_to(traj)
