"""The env service's side of tool calling: which toolsets an episode has, each episode's workspace folder,
and one model turn's calls run concurrently under deadlines.

Every call ends in a `ToolResult` the model reads, whatever went wrong: a name no toolset of the episode
offers (`unknown`), arguments that are not a JSON object or fail the tool's schema (`invalid`), the tool's
own failure (`error` where it ran and reported one, else the `ToolError` kind), or its deadline (`timeout`).
A toolset is started once per type and options, on the first episode that needs it, and shared; one that
fails to start fails that create (UNAVAILABLE, so the episode is retried) and is tried again next time. A
call's deadline is `call_timeout_s` times the queue waves ahead of it where the toolset serves a limited
number of calls at once, as env-call deadlines scale (services.envs.deadlines)."""

from __future__ import annotations

import asyncio
import json
import logging
import shutil
import tempfile
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry
from pydantic import ValidationError

from services.common import metrics
from services.common.errors import InvalidArgument, Unavailable
from services.envs.messages import ToolCall, ToolResult
from services.envs.tools import TOOLSETS, ToolContext, ToolError, Toolset, ToolSpec

log = logging.getLogger(__name__)

TRUNCATED = "\n[tool output truncated]"
ANSWER_MARGIN_S = 1.0
"""Each call ends this long before the CallTools deadline, so its caller gets the results, a timeout among them."""


@dataclass(frozen=True)
class _Tool:
    toolset: Toolset
    spec: ToolSpec
    validator: Any


@dataclass
class EpisodeTools:
    """The tools of one episode, by the name the model calls them."""

    tools: dict[str, _Tool] = field(default_factory=dict)
    workspace: Path | None = None

    def schemas(self) -> list[dict[str, Any]]:
        return [tool.spec.as_function() for tool in self.tools.values()]


def toolset_key(entry: Mapping[str, Any]) -> str:
    return json.dumps({"type": entry.get("type"), "options": entry.get("options") or {}}, sort_keys=True)


class ToolHost:
    def __init__(
        self,
        configured: Mapping[str, Mapping[str, Any]] | None = None,
        *,
        call_timeout_s: float = 10.0,
        max_output_chars: int = 4096,
        max_calls: int = 16,
        workspace_root: str | None = None,
        metrics_registry: CollectorRegistry | None = None,
    ):
        """`configured`: the run's `env.tools` ({instance name: {"type", "options"}}), added to every env's own
        toolsets (and replacing one of the same name). `max_calls`: calls one turn may make."""
        self.configured = {name: dict(entry) for name, entry in (configured or {}).items()}
        self.call_timeout_s, self.max_output_chars, self.max_calls = call_timeout_s, max_output_chars, max_calls
        self.workspace_root = workspace_root
        self._started: dict[str, Toolset] = {}
        self._starting: dict[str, asyncio.Lock] = {}
        self._in_flight: Counter[int] = Counter()
        reg = metrics_registry
        self._m_calls = metrics.counter(
            "envs",
            "tool_calls_total",
            "Tool calls by tool and result kind (ok, or why not)",
            ["tool", "kind"],
            registry=reg,
        )
        self._m_seconds = metrics.histogram(
            "envs", "tool_call_seconds", "Tool call latency, queueing for a slot included", ["tool"], registry=reg
        )

    def wanted(self, toolsets: Mapping[str, Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
        """An env's own toolsets with the configured ones added."""
        return {**{name: dict(entry) for name, entry in toolsets.items()}, **self.configured}

    async def for_episode(self, wanted: Mapping[str, Mapping[str, Any]]) -> EpisodeTools:
        """The episode's tools (its toolsets started where they were not) and a fresh workspace folder."""
        tools: dict[str, _Tool] = {}
        for instance, entry in wanted.items():
            toolset = await self._toolset(instance, entry)
            for spec in toolset.specs():
                if spec.name in tools:
                    raise InvalidArgument(f"tool {spec.name!r} of toolset {instance!r} is offered by another toolset")
                tools[spec.name] = _Tool(toolset, spec, _validator(spec))
        workspace = Path(tempfile.mkdtemp(prefix="omrl-ws-", dir=self.workspace_root)) if tools else None
        return EpisodeTools(tools, workspace)

    async def _toolset(self, instance: str, entry: Mapping[str, Any]) -> Toolset:
        key = toolset_key(entry)
        started = self._started.get(key)
        if started is not None:
            return started
        async with self._starting.setdefault(key, asyncio.Lock()):
            if key in self._started:
                return self._started[key]
            kind = entry.get("type")
            try:
                cls = TOOLSETS.get(str(kind))
                options = cls.Options.model_validate(entry.get("options") or {})
            except (KeyError, ImportError) as exc:
                raise InvalidArgument(f"toolset {instance!r}: {exc.args[0] if exc.args else exc}") from None
            except ValidationError as exc:
                raise InvalidArgument(f"toolset {instance!r} ({kind}): bad options: {exc}") from None
            toolset = cls(options)
            try:
                await toolset.start()
            except Exception as exc:  # noqa: BLE001 - a toolset that cannot start fails this create, not the service
                log.warning("toolset %s (%s) failed to start: %s", instance, kind, exc)
                raise Unavailable(f"toolset {instance!r} ({kind}) could not start: {exc}") from None
            self._started[key] = toolset
            return toolset

    async def call(
        self, tools: EpisodeTools, episode_id: str, calls: Sequence[ToolCall], time_left: float | None = None
    ) -> list[ToolResult]:
        """`time_left`: what the caller's deadline leaves; each call ends `ANSWER_MARGIN_S` before it."""
        if len(calls) > self.max_calls:
            raise InvalidArgument(f"{len(calls)} tool calls in one turn; at most {self.max_calls}")
        cap = None if time_left is None else max(0.1, time_left - ANSWER_MARGIN_S)
        return list(await asyncio.gather(*(self._one(tools, episode_id, call, cap) for call in calls)))

    async def _one(self, tools: EpisodeTools, episode_id: str, call: ToolCall, cap: float | None) -> ToolResult:
        start = time.perf_counter()
        tool = tools.tools.get(call.name)
        label = call.name if tool is not None else "unknown"
        content, kind = await self._run(tools, episode_id, call, tool, cap)
        seconds = time.perf_counter() - start
        self._m_calls.labels(label, kind or "ok").inc()
        self._m_seconds.labels(label).observe(seconds)
        if len(content) > self.max_output_chars:
            content = content[: self.max_output_chars - len(TRUNCATED)] + TRUNCATED
        return ToolResult(call.id, call.name, content, kind, seconds)

    async def _run(
        self, tools: EpisodeTools, episode_id: str, call: ToolCall, tool: _Tool | None, cap: float | None
    ) -> tuple[str, str]:
        if tool is None:
            offered = ", ".join(tools.tools) or "none"
            return f"unknown tool {call.name[:100]!r}; the tools are: {offered}", "unknown"
        try:
            arguments = json.loads(call.arguments_json or "{}")
        except (ValueError, RecursionError) as exc:
            return f"arguments of {call.name} are not valid JSON: {exc}", "invalid"
        if not isinstance(arguments, dict):
            return f"arguments of {call.name} must be a JSON object, got {type(arguments).__name__}", "invalid"
        if tool.validator is not None:
            problem = next(iter(sorted(tool.validator.iter_errors(arguments), key=lambda e: list(e.path))), None)
            if problem is not None:
                where = f" at {'/'.join(map(str, problem.path))}" if problem.path else ""
                return f"arguments of {call.name} do not match its schema{where}: {problem.message}", "invalid"
        toolset = tool.toolset
        deadline = self.call_timeout_s * (
            1 + self._in_flight[id(toolset)] // toolset.capacity if toolset.capacity else 1
        )
        deadline = deadline if cap is None else min(deadline, cap)
        self._in_flight[id(toolset)] += 1
        try:
            ctx = ToolContext(episode_id, tools.workspace or Path(tempfile.gettempdir()), deadline)
            output = await asyncio.wait_for(toolset.call(call.name, arguments, ctx), deadline)
        except ToolError as exc:
            return str(exc), exc.kind
        except TimeoutError:
            return f"{call.name} did not answer within {deadline:g}s", "timeout"
        except Exception as exc:  # noqa: BLE001 - a tool's bug is that call's error, never the episode's
            log.exception("tool %s failed", call.name)
            return f"{call.name} failed: {type(exc).__name__}", "failed"
        finally:
            self._in_flight[id(toolset)] -= 1
        return output.content, "error" if output.error else ""

    @staticmethod
    def remove_workspace(tools: EpisodeTools | None) -> None:
        if tools is not None and tools.workspace is not None:
            shutil.rmtree(tools.workspace, ignore_errors=True)

    async def aclose(self) -> None:
        for toolset in self._started.values():
            try:
                await toolset.aclose()
            except Exception as exc:  # noqa: BLE001 - closing is best effort
                log.warning("toolset %s did not close cleanly: %s", toolset.type, exc)
        self._started.clear()


def _validator(spec: ToolSpec) -> Any:
    """A JSON-schema validator of the tool's arguments; None (arguments unchecked, with a warning) where the
    schema itself is broken (an MCP server's, say)."""
    import jsonschema

    cls = jsonschema.validators.validator_for(spec.parameters, default=jsonschema.Draft202012Validator)
    try:
        cls.check_schema(spec.parameters)
    except jsonschema.SchemaError as exc:
        log.warning("tool %s has an invalid argument schema, calls go unchecked: %s", spec.name, exc.message)
        return None
    return cls(spec.parameters)
