import asyncio
import math
import time

import pytest
from prometheus_client import CollectorRegistry

from services.common.config import RewardConfig
from services.common.errors import DeadlineExceeded, Internal, InvalidArgument
from services.common.registry import Registry
from services.reward.base import RewardFunction
from services.reward.client import GrpcRewardClient, InProcessRewardClient
from services.reward.composer import RewardComposer
from services.reward.env_return import EnvReturn
from services.reward.format_reward import FormatReward
from services.reward.goal import GoalReward
from services.reward.length_penalty import LengthPenalty
from services.reward.registry import REWARDS
from services.reward.service import RewardService
from tests.support.service_fakes import trajectory


def test_goal():
    assert GoalReward()(trajectory((3, True), success=True)) == 1.0
    assert GoalReward()(trajectory((3, True))) == 0.0


def test_env_return_is_the_trajectory_return():
    traj = trajectory((3, True), success=True)
    traj.env_return = 0.37
    assert EnvReturn()(traj) == pytest.approx(0.37)
    assert RewardComposer({"env_return": {"weight": 2.0}}).score(traj)[0] == pytest.approx(0.74)


def test_format():
    assert FormatReward()(trajectory()) == 0.0
    assert FormatReward()(trajectory((2, True), (2, False), (2, True), (2, True))) == 0.75


@pytest.mark.parametrize(
    "tokens, expected",
    [((10,), 0.0), ((20,), 0.0), ((15, 10), -0.25), ((30,), -0.5), ((40,), -1.0), ((100, 100), -1.0)],
)
def test_length_penalty(tokens, expected):
    traj = trajectory(*[(n, True) for n in tokens])
    assert LengthPenalty(max_tokens=20)(traj) == pytest.approx(expected)


@pytest.mark.parametrize("bad", [0, -5, 2.5, "64", True])
def test_length_penalty_rejects_bad_max_tokens(bad):
    with pytest.raises(ValueError):
        LengthPenalty(max_tokens=bad)


def test_functions_without_params_reject_params():
    with pytest.raises(TypeError, match="takes no params"):
        GoalReward(scale=2)


def test_composer_sums_weighted_components():
    composer = RewardComposer(
        {
            "goal": {"weight": 2.0},
            "format": {"weight": 0.5},
            "length_penalty": {"weight": 0.1, "params": {"max_tokens": 4}},
        }
    )
    total, parts, _ = composer.score(trajectory((6, True), (2, False), success=True))
    assert parts == pytest.approx({"goal": 2.0, "format": 0.25, "length_penalty": -0.1})
    assert total == pytest.approx(2.15) and total == pytest.approx(sum(parts.values()))
    assert composer.names == ["goal", "format", "length_penalty"]


def test_one_function_runs_as_several_components_by_type():
    composer = RewardComposer(
        {
            "goal": {"weight": 1.0},
            "goal_x2": {"type": "goal", "weight": 2.0},
            "short": {"type": "length_penalty", "weight": 1.0, "params": {"max_tokens": 4}},
        }
    )
    total, parts, _ = composer.score(trajectory((6, True), success=True))
    assert parts == pytest.approx({"goal": 1.0, "goal_x2": 2.0, "short": -0.5}) and total == pytest.approx(2.5)
    config = RewardConfig.model_validate({"components": {"rm_b": {"type": "reward_model", "params": {"path": "/m"}}}})
    assert config.components["rm_b"].function("rm_b") == "reward_model"
    with pytest.raises(ValueError, match=r"components\.x\.type\n  'nope' is not one of: bleu, chrf"):
        RewardConfig.model_validate({"components": {"x": {"type": "nope"}}})
    with pytest.raises(ValueError, match=r"components\.nope\.\[key\]\n  'nope' is not one of: bleu, chrf"):
        RewardConfig.model_validate({"components": {"nope": {}}})
    with pytest.raises(ValueError, match="unknown param 'max_token' of reward function 'length_penalty'"):
        RewardConfig.model_validate({"components": {"short": {"type": "length_penalty", "params": {"max_token": 4}}}})
    with pytest.raises(ValueError, match="should match pattern"):
        RewardConfig.model_validate({"components": {"a b": {"type": "goal"}}})
    with pytest.raises(ValueError, match=r"unknown reward component\(s\) nope"):
        RewardComposer({"x": {"type": "nope"}})


def test_composer_from_default_config():
    composer = RewardComposer.from_config(RewardConfig())
    total, parts, _ = composer.score(trajectory((3, True), success=True))
    assert parts == {"goal": 1.0, "format": 0.1, "length_penalty": 0.0} and total == pytest.approx(1.1)


def test_unknown_components_fail_at_construction():
    with pytest.raises(
        ValueError,
        match=r"unknown reward component\(s\) bogus, nope; known: bleu, chrf, env_return, exact_match, format, goal, "
        r"hinted_action, invalid_tool_calls, length_penalty, ",
    ):
        RewardComposer({"goal": {}, "nope": {}, "bogus": {}})
    with pytest.raises(ValueError, match="'length_penalty': bad params .*unexpected keyword"):
        RewardComposer({"length_penalty": {"params": {"max_token": 3}}})
    with pytest.raises(ValueError, match="'length_penalty': bad params"):
        RewardComposer({"length_penalty": {}})
    with pytest.raises(ValueError, match="no reward components"):
        RewardComposer({})


def test_builtin_registry():
    assert REWARDS.names() == sorted(REWARDS.names())
    assert set(REWARDS.names()) >= {
        "bleu",
        "chrf",
        "env_return",
        "exact_match",
        "format",
        "goal",
        "hinted_action",
        "length_penalty",
        "math_equiv",
        "overlong_penalty",
        "reward_model",
        "token_f1",
    }
    assert isinstance(REWARDS.create("goal"), GoalReward)


class Flaky(RewardFunction):
    name = "flaky"

    def __call__(self, traj):
        if traj.env == "nan":
            return math.nan
        if traj.env == "slow":
            time.sleep(0.5)
        if traj.env == "boom":
            raise KeyError("missing")
        return 0.5


def service(**kwargs) -> tuple[InProcessRewardClient, CollectorRegistry]:
    registry = Registry("reward function")
    registry.register("goal")(GoalReward)
    registry.register("flaky")(Flaky)
    metrics = CollectorRegistry()
    composer = RewardComposer({"goal": {"weight": 1.0}, "flaky": {"weight": 2.0}}, registry=registry)
    return InProcessRewardClient(RewardService(composer, metrics_registry=metrics, **kwargs)), metrics


def test_service_scores_a_batch_in_order():
    client, metrics = service()
    batch = [trajectory((2, True), success=i % 2 == 0, trajectory_id=str(i)) for i in range(5)]
    scores = asyncio.run(client.score(batch))
    assert [s.total for s in scores] == [2.0, 1.0, 2.0, 1.0, 2.0]
    assert scores[1] == (1.0, {"goal": 0.0, "flaky": 1.0}, [])
    assert asyncio.run(client.score([])) == []
    assert metrics.get_sample_value("omrl_reward_trajectories_total") == 5
    assert metrics.get_sample_value("omrl_reward_score_seconds_count") == 1
    assert metrics.get_sample_value("omrl_reward_component_score_count", {"component": "flaky"}) == 5
    assert metrics.get_sample_value("omrl_reward_component_score_bucket", {"component": "goal", "le": "0.0"}) == 2


def test_service_errors():
    client, metrics = service(timeout_s=0.2)
    for env, error, message in [
        ("boom", Internal, "component 'flaky' failed on trajectory 't': KeyError"),
        ("nan", Internal, "'flaky' gave nan"),
        ("slow", DeadlineExceeded, "took over 0.2s"),
    ]:
        traj = trajectory((1, True))
        traj.env = env
        with pytest.raises(error, match=message):
            asyncio.run(client.score([trajectory((1, True)), traj]))
    assert metrics.get_sample_value("omrl_reward_component_failures_total", {"component": "flaky"}) == 2
    broken = trajectory((2, True))
    broken.loss_mask[0] = 1
    with pytest.raises(InvalidArgument, match="loss_mask does not match"):
        asyncio.run(client.score([broken]))
    with pytest.raises(InvalidArgument, match="expected Trajectory"):
        asyncio.run(client.score([{"trajectory_id": "x"}]))


def test_grpc_client_splits_large_batches():
    client = GrpcRewardClient("127.0.0.1:1", max_request_bytes=1000)
    batch = [trajectory((100, True), trajectory_id=str(i)) for i in range(5)]
    chunks = client._chunks(batch)
    assert [t for chunk in chunks for t in chunk] == batch and len(chunks) > 1
    assert all(sum(t.ByteSize() for t in chunk) <= 1000 or len(chunk) == 1 for chunk in chunks)
