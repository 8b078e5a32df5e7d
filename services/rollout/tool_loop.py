"""The tool-calling agent loop (`rollout.agent_loop: tools`). The episode's tools (from the env service's Create)
go to the model's chat template; each reply is read by the run's tool-call parser (`rollout.tool_parser`). A reply
with calls has them run on the env service, concurrently, and their results come back as `tool` messages rendered
by the same template, masked out of the loss like any observation. A reply without a call is the agent's answer:
the run's action parser reads it and the env steps, as in the text loop.

What the model gets wrong never ends the episode: a call that does not parse, names no tool of the episode, fails
its tool's schema or goes past `env.max_tool_calls` in one turn is answered with an error message it can read,
and counted on its turn (`invalid_tool_calls`, which the `tool_calls` reward component can penalise)."""

from __future__ import annotations

import json
from typing import Any

from services.common import metrics
from services.common.trajectory import Trajectory, TrajectoryBuilder
from services.envs.messages import MODEL_MISTAKES, ToolCall, ToolResult
from services.rollout.agent_loop import AgentLoop
from services.rollout.agent_loops import AGENT_LOOPS
from services.rollout.tool_parsers import TOOL_PARSERS, ParsedCall, ParsedReply, ToolCallParser

TOOL_CALLS = metrics.preset(
    metrics.counter(
        "rollout",
        "tool_calls_total",
        "Tool calls the policy made, by result: ok, the model's mistake (unparsed, unknown, invalid, over_limit), "
        "or the tool's failure (error, failed, timeout, limit, refused, unavailable)",
        ["result"],
    ),
    *((r,) for r in ("ok", "unparsed", "unknown", "invalid", "over_limit", "error", "timeout")),
)


@AGENT_LOOPS.register("tools")
class ToolCallingLoop(AgentLoop):
    def __init__(self, *args: Any, tool_parser: ToolCallParser | None = None, **kwargs: Any):
        """AgentLoop's arguments; `tool_parser` replaces the one `rollout.tool_parser` names."""
        super().__init__(*args, **kwargs)
        self.tool_parser = tool_parser or TOOL_PARSERS.create(self.rollout.tool_parser)

    async def _play(self, state: Any, task_index: int, group_id: str, seed: int | None, baseline: bool) -> Trajectory:
        tools = list(state.tools)
        builder = TrajectoryBuilder(
            env=self.env.name,
            task_index=task_index,
            group_id=group_id,
            prompt_ids=self.formatter.initial(state.observation, tools=tools or None),
            rollout_server=self.server_name,
        )
        builder.record.baseline = baseline
        env_return, lim, anchor, clock = 0.0, self.limits, state.anchor, self.clock
        for turn in range(lim.max_turns):
            budget = min(lim.max_new_tokens, lim.max_model_len - builder.length)
            if budget <= 0:
                return builder.finish(env_return=env_return, success=False, stop_reason="max_length")
            with clock.time("generate"):
                out = await self.generator.generate(
                    f"{builder.record.trajectory_id}-{turn}",
                    builder.record.token_ids,
                    self._sampling(budget, None if seed is None else seed + turn, greedy=baseline),
                )
            gen = out.generation
            with clock.time("detokenize"):
                text = self.formatter.decode(gen.token_ids)
            with clock.time("parse"):
                reply = self.tool_parser.parse(text) if tools else ParsedReply()
                parsed = self.parser.parse(text) if reply.final else None
            record = builder.add_model_turn(
                gen.token_ids,
                gen.logprobs,
                policy_version=out.policy_version,
                text=text,
                action=parsed.action if parsed is not None else _calls_text(reply.calls),
                action_valid=parsed.valid if parsed is not None else not reply.errors,
                finish_reason=gen.finish_reason,
                anchor=anchor,
            )
            if parsed is None:
                results = await self._call_tools(state.episode_id, reply)
                record.tool_calls = len(results)
                record.invalid_tool_calls = sum(r.kind in MODEL_MISTAKES for r in results)
                with clock.time("tokenize"):
                    obs_ids = self.formatter.tool_results([tool_message(r) for r in results])
                reward = 0.0
                # the env has not moved, but what the agent knows has: GiGPO groups the next turn by both
                anchor = "\n".join([anchor, *(f"[{r.name or 'call'}] {r.content}" for r in results)])[-ANCHOR_CHARS:]
            else:
                if parsed.valid:
                    with clock.time("env_step"):
                        state = await self.envs.step(state.episode_id, parsed.action)
                    env_return += state.reward
                    record.action_rejected = state.info.get("action_valid") is False
                    anchor = state.anchor
                    if state.done:
                        record.env_reward = state.reward
                        return builder.finish(env_return=env_return, success=state.success, stop_reason="done")
                    observation, reward = state.observation, state.reward
                else:
                    observation, reward = f"{self.parser.format_hint()} ({parsed.error})", 0.0
                with clock.time("tokenize"):
                    obs_ids = self.formatter.observation(observation)
            if builder.length + len(obs_ids) >= lim.max_model_len:
                return builder.finish(env_return=env_return, success=False, stop_reason="max_length")
            builder.add_observation(obs_ids, env_reward=reward)
        return builder.finish(env_return=env_return, success=False, stop_reason="max_turns")

    async def _call_tools(self, episode_id: str, reply: ParsedReply) -> list[ToolResult]:
        """Results for every call the reply made or tried, in order: the well-formed ones within the turn's limit
        run on the env service; the rest are answered here."""
        limit = self.env.max_tool_calls
        run, over = reply.calls[:limit], reply.calls[limit:]
        calls = [ToolCall(f"call_{i}", call.name, call.arguments_json) for i, call in enumerate(run)]
        results: list[ToolResult] = []
        if calls:
            with self.clock.time("tool_calls"):
                results = await self.envs.call_tools(episode_id, calls)
        results += [
            ToolResult(f"call_{limit + i}", call.name, f"not run: at most {limit} tool calls a turn", "over_limit")
            for i, call in enumerate(over)
        ]
        results += [
            ToolResult(f"error_{i}", "", f"could not read a tool call: {error}", "unparsed")
            for i, error in enumerate(reply.errors)
        ]
        for result in results:
            TOOL_CALLS.labels(result.kind or "ok").inc()
        return results


ANCHOR_CHARS = 4096
"""A tool turn's anchor keeps this much of its end (the env's anchor, then the results so far)."""


def tool_message(result: ToolResult) -> dict[str, str]:
    """A `tool` message (name and call id kept for the templates that render them)."""
    content = result.content if result.ok else f"Error ({result.kind}): {result.content}"
    return {"role": "tool", "content": content, "name": result.name, "tool_call_id": result.id}


def _calls_text(calls: list[ParsedCall]) -> str:
    """The turn's calls as one line, the `action` the inspector and the records show."""
    return "; ".join(f"{call.name}({_compact(call.arguments_json)})" for call in calls)


def _compact(arguments_json: str) -> str:
    try:
        return json.dumps(json.loads(arguments_json), separators=(",", ":"))
    except ValueError:
        return arguments_json
