"""The tool-calling agent loop against the real env service core (in process), a scripted policy and throwaway
toolsets: tools reach the prompt, calls run (concurrently) and come back as masked tool messages, the model's
mistakes are answered and counted, and the answer steps the env."""

import asyncio
import json
import re
from typing import Any, ClassVar

import pytest

from services.common.config import EnvConfig, RolloutConfig
from services.common.trajectory import check_invariants
from services.envs.base import StepResult, TextEnv
from services.envs.client import InProcessEnvClient
from services.envs.registry import ENVS
from services.envs.service import EnvService
from services.envs.tools import TOOLSETS, ToolError, ToolOutput, Toolset, ToolSpec
from services.rollout.action_parsers import PARSERS
from services.rollout.agent_loops import AGENT_LOOPS
from services.rollout.prompting import ChatFormatter
from tests.support.scripted_policy import ScriptedPolicy, tokenizer  # noqa: F401 - fixture


class Adder(Toolset):
    """`add(a, b)`; `meet()` returns once two calls of it are running at the same time."""

    type = "test_adder"
    met: ClassVar[asyncio.Event | None] = None
    waiting = 0

    def specs(self):
        return [
            ToolSpec(
                "add",
                "Adds two integers.",
                {
                    "type": "object",
                    "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                    "required": ["a", "b"],
                    "additionalProperties": False,
                },
            ),
            ToolSpec("meet", "Waits for a second caller.", {"type": "object", "properties": {}}),
            ToolSpec("refuse", "Always refuses.", {"type": "object", "properties": {}}),
        ]

    async def call(self, name: str, arguments: dict[str, Any], ctx) -> ToolOutput:
        if name == "refuse":
            raise ToolError("not today", "refused")
        if name == "meet":
            Adder.waiting += 1
            if Adder.waiting == 2:
                Adder.met.set()
            await asyncio.wait_for(Adder.met.wait(), 5)
            return ToolOutput("met")
        return ToolOutput(str(arguments["a"] + arguments["b"]))


class SumTask(TextEnv):
    """Answer a + b for two numbers given in the prompt; the answer ends the episode."""

    tools: ClassVar[dict] = {"adder": {"type": "test_adder"}}
    runs_inline = True

    def reset(self, task_index, options):
        self.answer = 1000 + task_index * 7 + 123
        return f"What is {1000 + task_index * 7} + 123? <action>N</action>"

    def step(self, action):
        ok = action.strip() == str(self.answer)
        return StepResult("done", float(ok), True, ok)


@pytest.fixture(autouse=True)
def registered():
    TOOLSETS.register("test_adder")(Adder)
    ENVS.register("test_sum")(SumTask)
    Adder.met, Adder.waiting = asyncio.Event(), 0
    yield
    TOOLSETS.unregister("test_adder")
    ENVS.unregister("test_sum")


def call(name, **arguments):
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


def make_loop(tokenizer, reply, max_turns=4, max_tool_calls=4):
    policy = ScriptedPolicy(tokenizer, reply)
    loop = AGENT_LOOPS.get("tools")(
        policy,
        InProcessEnvClient(EnvService()),
        ChatFormatter(tokenizer),
        PARSERS.create("xml_action"),
        RolloutConfig(group_size=2, max_new_tokens=256, agent_loop="tools"),
        EnvConfig(name="test_sum", max_turns=max_turns, max_tool_calls=max_tool_calls),
        max_model_len=8192,
    )
    return loop, policy


def solver(obs):
    """Calls add with the prompt's numbers, then answers with what it returned."""
    if "<tool_response>" in obs:
        result = re.search(r"<tool_response> (\d+)", obs).group(1)
        return f"<action>{result}</action>"
    a, b = map(int, re.search(r"What is (\d+) \+ (\d+)", obs).groups())
    return call("add", a=a, b=b)


def test_a_call_runs_its_result_comes_back_masked_and_the_answer_ends_the_episode(tokenizer):
    loop, policy = make_loop(tokenizer, solver)
    group = asyncio.run(loop.run_group(task_index=3, group_id="g"))
    for traj in group:
        check_invariants(traj)
        assert traj.success and traj.stop_reason == "done" and len(traj.turns) == 2
        first, answer = traj.turns
        assert (first.tool_calls, first.invalid_tool_calls, first.action_valid) == (1, 0, True)
        assert first.action == 'add({"a":1021,"b":123})' and answer.action == "1144"
        assert answer.anchor == first.anchor + "\n[add] 1144"  # GiGPO tells the states apart by what the tools said
        tool_tokens = traj.token_ids[first.start + first.model_tokens : answer.start]
        assert "<tool_response> 1144</tool_response>" in tokenizer.decode(tool_tokens)
        assert set(traj.loss_mask[first.start + first.model_tokens : answer.start]) == {0}
        assert set(traj.loss_mask[answer.start : answer.start + answer.model_tokens]) == {1}
        for turn in traj.turns:  # every prompt the engine saw is the record's prefix: nothing re-tokenised
            assert any(list(traj.token_ids[: turn.start]) == p for p in policy.prompts)
    assert '"name": "add"' in tokenizer.decode(policy.prompts[0])  # the schemas reached the template


def test_the_models_mistakes_are_answered_counted_and_the_episode_goes_on(tokenizer):
    replies = iter(
        [
            call("subtract", a=1, b=2) + call("add", a="1", b=2) + "<tool_call>{oops}</tool_call>",
            call("add", a=1, b=2) * 3,
            call("refuse"),
            "<action>1144</action>",
        ]
    )
    loop, policy = make_loop(tokenizer, lambda obs: next(replies), max_tool_calls=2)
    traj = asyncio.run(loop.run_episode(task_index=3, group_id="g"))
    seen = [
        tokenizer.decode(prompt[prompt_end:])
        for prompt_end, prompt in zip([0, *map(len, policy.prompts)], policy.prompts)
    ]
    assert traj.success and [t.tool_calls for t in traj.turns] == [3, 3, 1, 0]
    assert [t.invalid_tool_calls for t in traj.turns] == [3, 1, 0, 0]
    assert [t.action_valid for t in traj.turns] == [False, True, True, True]
    assert "unknown tool 'subtract'" in seen[1] and "do not match its schema at a" in seen[1]
    assert "could not read a tool call" in seen[1]
    assert seen[2].count("<tool_response> 3</tool_response>") == 2 and "at most 2 tool calls" in seen[2]
    assert "Error (refused): not today" in seen[3]


def test_the_calls_of_one_turn_run_concurrently(tokenizer):
    replies = iter([call("meet") + call("meet"), "<action>1144</action>"])
    loop, _ = make_loop(tokenizer, lambda obs: next(replies))
    traj = asyncio.run(loop.run_episode(task_index=3, group_id="g"))
    assert traj.success and traj.turns[0].tool_calls == 2 and traj.turns[0].invalid_tool_calls == 0


def test_an_env_without_tools_plays_as_in_the_text_loop(tokenizer):
    loop, policy = make_loop(tokenizer, lambda obs: "<action>left</action>")
    loop.env, loop.limits.max_turns = EnvConfig(name="corridor", max_turns=2), 2
    traj = asyncio.run(loop.run_episode(task_index=1, group_id="g"))
    assert len(traj.turns) == 2 and all(t.action == "left" and t.tool_calls == 0 for t in traj.turns)
    assert "Tools" not in tokenizer.decode(policy.prompts[0])
