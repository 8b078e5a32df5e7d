"""Anchor observations (GiGPO's state keys): every built-in env and the AgentGym adapter report one per reset and
step, equal for equal states and untouched by what only the last action caused; they cross the wire, and the agent
loop records each turn's anchor (the state it acted from) in the trajectory."""

import asyncio
import random

import pytest
from prometheus_client import CollectorRegistry
from starlette.testclient import TestClient

from services.common.config import EnvConfig, RolloutConfig
from services.common.registry import Registry
from services.envs.agentgym import env as agentgym_env
from services.envs.agentgym.servers import ServerPool
from services.envs.agentgym.tasks import TaskGate
from services.envs.client import InProcessEnvClient
from services.envs.messages import EpisodeState
from services.envs.registry import ENVS
from services.envs.service import EnvService
from services.rollout.action_parsers import PARSERS
from services.rollout.agent_loop import AgentLoop
from services.rollout.prompting import ChatFormatter
from tests.support.agentgym_fake import build
from tests.support.scripted_policy import ScriptedPolicy, tokenizer, toward_exit  # noqa: F401 - fixture

BUILTINS = ["corridor", "guess_number", "maze", "wordle", "crafting", "reasoning", "babyai"]


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 30))


async def play(service, name, task, actions, options=None):
    """The states of one episode: the created one, then one per action until done."""
    states = [await service.create(name, task, options)]
    for action in actions:
        states.append(await service.step(states[0].episode_id, action))
        if states[-1].done:
            break
    await service.close(states[0].episode_id)
    return states


@pytest.mark.parametrize("name", BUILTINS)
def test_every_builtin_env_reports_anchors_that_name_the_state(name):
    rng = random.Random(7)
    env = ENVS.create(name)
    env.reset(5, {})
    actions = ["no such action !"] + [env.random_action(rng) for _ in range(env.max_turns)]
    service = EnvService()
    first = run(play(service, name, 5, actions))
    again = run(play(service, name, 5, actions))
    assert all(isinstance(s.anchor, str) and s.anchor for s in first), name
    assert [s.anchor for s in first] == [s.anchor for s in again], name  # same task and actions, same states
    if not first[1].done:  # an invalid action changes the observation, not the state
        assert first[1].observation != first[0].observation and first[1].anchor == first[0].anchor, name
    assert "<action>" not in first[0].anchor or name == "reasoning", name  # no instructions (a one-turn question)


def test_coming_back_to_a_state_gives_its_anchor_again():
    service = EnvService()
    states = run(play(service, "corridor", 5, ["left", "right"], {"length": 12, "distance": 5, "max_turns": 9}))
    assert states[0].observation != states[2].observation and states[0].anchor == states[2].anchor
    assert states[1].anchor != states[0].anchor


def test_anchors_cross_the_wire_and_old_servers_fall_back_to_the_observation():
    state = EpisodeState("e", "You see a door.", anchor="door")
    assert EpisodeState.from_proto(state.to_proto()).anchor == "door"
    old = state.to_proto()
    old.ClearField("anchor")
    assert EpisodeState.from_proto(old).anchor == "You see a door."


def test_anchors_are_capped_like_observations():
    class Long(ENVS.get("corridor")):
        def anchor_observation(self):
            return "x" * 10_000

    envs = Registry("environment")
    envs.register("long")(Long)
    service = EnvService(max_observation_chars=100, envs=envs, metrics_registry=CollectorRegistry())
    assert len(run(service.create("long", 1)).anchor) == 100


@pytest.fixture
def agentgym(monkeypatch):
    """AgentGym episodes against the fake servers, in process (their ASGI apps behind a test client)."""
    pools = {}

    def pool_for(opts, profile):
        if opts.family not in pools:
            pool = ServerPool(opts.urls, 5.0, family=opts.family, tasks=TaskGate())
            shape = "lmrl" if opts.family in ("maze", "wordle") else opts.family
            pool.servers[0].client = TestClient(build(shape), base_url=opts.urls[0])
            pools[opts.family] = pool
        return pools[opts.family]

    monkeypatch.setattr(agentgym_env, "pool_for", pool_for)
    return lambda family: {"family": family, "base_url": f"http://{family}.fake:1", "task_range": [0, 13]}


def test_agentgym_anchors_are_the_servers_observations(agentgym):
    service = EnvService()
    states = run(play(service, "agentgym", 2, ["move forward", "turn around"], agentgym("babyai")))
    assert states[0].anchor == "babyai task: 2 to go. Next: move forward"
    assert "Answer with" in states[0].observation and "Answer with" not in states[0].anchor  # the help is not state
    assert states[1].anchor == "babyai task: 1 to go. Next: move forward" == states[1].observation


def test_an_agentgym_action_refused_before_the_server_leaves_the_anchor(agentgym):
    service = EnvService()
    states = run(play(service, "agentgym", 1, ["jump", "move up"], agentgym("maze")))
    assert "not understood" in states[1].observation and states[1].anchor == states[0].anchor
    assert states[2].anchor != states[0].anchor


def test_the_agent_loop_records_the_state_each_turn_acted_from(tokenizer):
    replies = iter(["<action>jump</action>", "no tags", "<action>left</action>"])
    policy = ScriptedPolicy(tokenizer, lambda obs: next(replies, None) or toward_exit(obs))
    service = EnvService()
    loop = AgentLoop(
        policy,
        InProcessEnvClient(service),
        ChatFormatter(tokenizer),
        PARSERS.create("xml_action"),
        RolloutConfig(group_size=1, max_new_tokens=16),
        EnvConfig(name="corridor", max_turns=8, options={"max_turns": 8}),
        max_model_len=1024,
    )
    traj = run(loop.run_episode(task_index=5, group_id="g"))
    reference = run(play(service, "corridor", 5, ["left"] * 8, {"max_turns": 8}))
    start = reference[0].anchor
    turns = traj.turns
    assert [t.anchor for t in turns[:3]] == [start, start, start]  # rejected, then unparsed: the state stays
    assert turns[0].action_valid and turns[0].action_rejected  # the env refused `jump`
    assert not turns[1].action_valid and not turns[1].action_rejected
    assert turns[3].anchor == reference[1].anchor != start  # after the move left
    assert all(t.anchor for t in turns)
