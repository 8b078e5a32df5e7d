"""The agent loop against the real env service core (in-process) and a scripted policy."""

import asyncio

import pytest

from services.common.config import EnvConfig, RolloutConfig
from services.common.errors import Unavailable
from services.common.trajectory import check_invariants
from services.envs.client import InProcessEnvClient
from services.envs.service import EnvService
from services.rollout.action_parsers import PARSERS
from services.rollout.agent_loop import AgentLoop, EpisodeFailed
from services.rollout.prompting import ChatFormatter
from tests.support.scripted_policy import ScriptedPolicy, tokenizer, toward_exit  # noqa: F401 - fixture


def make_loop(tokenizer, reply, env_client=None, max_turns=6, group_size=3):
    policy = ScriptedPolicy(tokenizer, reply)
    loop = AgentLoop(
        policy,
        env_client or InProcessEnvClient(EnvService()),
        ChatFormatter(tokenizer),
        PARSERS.create("xml_action"),
        RolloutConfig(group_size=group_size, max_new_tokens=16),
        EnvConfig(name="corridor", max_turns=max_turns),
        max_model_len=512,
    )
    return loop, policy


def test_optimal_policy_succeeds_with_exact_tokens_and_masks(tokenizer):
    loop, policy = make_loop(tokenizer, toward_exit)
    group = asyncio.run(loop.run_group(task_index=5, group_id="g"))
    assert len(group) == 3
    for traj in group:
        check_invariants(traj)
        assert traj.success and traj.stop_reason == "done" and len(traj.turns) == 3
        assert all(t.action_valid and t.policy_version == 3 for t in traj.turns)
        # every prompt the engine saw is exactly the record's prefix: nothing was re-tokenised
        for turn in traj.turns:
            assert any(list(traj.token_ids[: turn.start]) == p for p in policy.prompts)
        assert traj.turns[-1].env_reward == 1.0 and traj.env_return == 1.0


def test_unparseable_replies_get_a_format_hint_and_run_out_of_turns(tokenizer):
    loop, _ = make_loop(tokenizer, lambda obs: "left", max_turns=3)
    traj = asyncio.run(loop.run_episode(task_index=1, group_id="g"))
    assert traj.stop_reason == "max_turns" and not traj.success and len(traj.turns) == 3
    assert not any(t.action_valid for t in traj.turns)
    assert "Invalid format" in tokenizer.decode(
        traj.token_ids[traj.turns[1].start - traj.turns[0].env_tokens : traj.turns[1].start]
    )


def test_context_limit_stops_the_episode(tokenizer):
    loop, _ = make_loop(tokenizer, lambda obs: "<action>up</action>", max_turns=50)
    loop.limits.max_model_len = 200
    traj = asyncio.run(loop.run_episode(task_index=1, group_id="g"))
    assert traj.stop_reason in {"max_length", "done"} and len(traj.token_ids) <= 200


class BrokenEnvClient(InProcessEnvClient):
    async def step(self, episode_id, action):
        raise Unavailable("env replica gone")


def test_infrastructure_failure_fails_the_whole_group(tokenizer):
    loop, _ = make_loop(tokenizer, toward_exit, env_client=BrokenEnvClient(EnvService()))
    with pytest.raises(EpisodeFailed, match="env replica gone"):
        asyncio.run(loop.run_group(task_index=2, group_id="g"))


def test_on_episode_sees_each_episode_as_it_ends_and_its_error_fails_the_group(tokenizer):
    loop, _ = make_loop(tokenizer, toward_exit)
    ended = []

    async def note(i, traj):
        ended.append((i, traj.trajectory_id, len(traj.turns)))

    group = asyncio.run(loop.run_group(task_index=5, group_id="g", on_episode=note))
    assert sorted(ended) == sorted((i, t.trajectory_id, 3) for i, t in enumerate(group))

    async def reward_down(i, traj):
        raise Unavailable("reward service restarting")

    with pytest.raises(EpisodeFailed, match="reward service restarting"):
        asyncio.run(loop.run_group(task_index=5, group_id="g", on_episode=reward_down))


def test_every_stage_between_two_engine_requests_is_timed(tokenizer):
    from prometheus_client import REGISTRY

    def observed(stage):
        return REGISTRY.get_sample_value("omrl_rollout_loop_stage_seconds_count", {"stage": stage}) or 0.0

    before = {stage: observed(stage) for stage in ("generate", "env_step", "tokenize")}
    loop, _ = make_loop(tokenizer, toward_exit)
    asyncio.run(loop.run_group(task_index=5, group_id="g"))
    calls = loop.clock.calls  # 3 episodes of 3 turns; the last turn ends the episode before any new observation
    assert calls["generate"] == calls["detokenize"] == calls["parse"] == calls["env_step"] == 9
    assert calls["tokenize"] == 6 and calls["env_close"] == 3
    assert calls["env_create"] == 1  # the group's three environments in one create_batch call
    assert all(loop.clock.seconds[stage] >= 0 for stage in calls)
    assert {stage: observed(stage) - before[stage] for stage in before} == {"generate": 9, "env_step": 9, "tokenize": 6}


class HungStepEnvClient(InProcessEnvClient):
    def __init__(self, service):
        super().__init__(service)
        self.hung, self.release = asyncio.Event(), asyncio.Event()

    async def step(self, episode_id, action):
        self.hung.set()
        await self.release.wait()
        return await super().step(episode_id, action)


def test_a_hung_env_step_shows_in_flight_until_it_returns(tokenizer):
    from prometheus_client import REGISTRY

    def in_flight(stage):
        return REGISTRY.get_sample_value("omrl_rollout_loop_stage_in_flight", {"stage": stage})

    async def scenario():
        client = HungStepEnvClient(EnvService())
        loop, _ = make_loop(tokenizer, toward_exit, env_client=client)
        group = asyncio.create_task(loop.run_group(task_index=5, group_id="g"))
        await asyncio.wait_for(client.hung.wait(), 30)
        await asyncio.sleep(0.05)  # every episode of the group reaches its first step
        seen = in_flight("env_step")
        client.release.set()
        await asyncio.wait_for(group, 30)
        return seen

    assert asyncio.run(scenario()) == 3  # the group's three episodes, each waiting on its step
    assert in_flight("env_step") == in_flight("env_create") == in_flight("generate") == 0


def test_formatter_initial_prompts_are_cached_and_equal_to_a_fresh_render(tokenizer, monkeypatch):
    import services.rollout.prompting as prompting

    monkeypatch.setattr(prompting, "INITIAL_CACHE", 2)
    formatter, fresh = ChatFormatter(tokenizer), ChatFormatter(tokenizer)
    renders = []
    render = formatter._render
    monkeypatch.setattr(formatter, "_render", lambda *a: renders.append(a) or render(*a))
    first = formatter.initial("You are in cell 3.")
    first.append(-1)  # the caller owns the list it gets: the cached ids stay as they were
    assert formatter.initial("You are in cell 3.") == fresh.initial("You are in cell 3.")
    assert len(renders) == 1
    formatter.initial("You are in cell 4.")
    formatter.initial("You are in cell 3.")  # most recently used: kept when cell 5 comes in
    formatter.initial("You are in cell 5.")
    assert list(formatter._initial) == [("You are in cell 3.", ""), ("You are in cell 5.", "")]
    assert len(renders) == 3
    assert formatter.observation("cell 9") == fresh.observation("cell 9")


def test_a_remax_group_adds_one_greedy_episode_marked_as_its_baseline(tokenizer):
    policy = ScriptedPolicy(tokenizer, toward_exit)
    temperatures: dict[str, set[float]] = {}
    generate = policy.generate

    async def recording(request_id, prompt_ids, sampling):
        temperatures.setdefault(request_id.rsplit("-", 1)[0], set()).add(sampling.temperature)
        return await generate(request_id, prompt_ids, sampling)

    policy.generate = recording
    loop = AgentLoop(
        policy,
        InProcessEnvClient(EnvService()),
        ChatFormatter(tokenizer),
        PARSERS.create("xml_action"),
        RolloutConfig(group_size=2, max_new_tokens=16, temperature=0.7),
        EnvConfig(name="corridor", max_turns=6),
        max_model_len=512,
        greedy_baseline=True,
    )
    group = asyncio.run(loop.run_group(task_index=5, group_id="g", seed=1))
    assert [t.baseline for t in group] == [False, False, True]
    assert {t.group_id for t in group} == {"g"} and len({t.task_index for t in group}) == 1
    assert [temperatures[t.trajectory_id] for t in group] == [{0.7}, {0.7}, {0.0}]
    plain, _ = make_loop(tokenizer, toward_exit, group_size=2)
    assert not any(t.baseline for t in asyncio.run(plain.run_group(task_index=5, group_id="g")))
