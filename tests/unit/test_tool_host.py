"""The env service's tool calls (services.envs.tool_host) with throwaway toolsets: every failure is the call's own
result, deadlines grow with the queue, workspaces live exactly as long as their episode, and the gRPC client
returns what the in-process one does."""

import asyncio
import json
from typing import Any, ClassVar

import pytest
from prometheus_client import CollectorRegistry

from services.common.errors import FailedPrecondition, InvalidArgument, Unavailable
from services.envs.base import StepResult, TextEnv
from services.envs.client import GrpcEnvClient, InProcessEnvClient
from services.envs.messages import ToolCall
from services.envs.registry import ENVS
from services.envs.server import add_env_service
from services.envs.service import EnvService
from services.envs.tool_host import ToolHost
from services.envs.tools import TOOLSETS, ToolError, ToolOutput, Toolset, ToolSpec
from tests.support.envs_grpc import running

SCHEMA = {"type": "object", "properties": {"x": {"type": "integer"}}, "additionalProperties": False}


class Probe(Toolset):
    """Tools that echo, fail in each way a tool can, and report the deadline they were given."""

    type = "test_probe"
    capacity = 1
    starts: ClassVar[int] = 0
    broken: ClassVar[bool] = False

    async def start(self):
        Probe.starts += 1
        if Probe.broken:
            raise RuntimeError("server down")

    def specs(self):
        return [ToolSpec(name, name, SCHEMA) for name in ("echo", "deadline", "hang", "crash", "refuse", "ws")]

    async def call(self, name: str, arguments: dict[str, Any], ctx) -> ToolOutput:
        if name == "deadline":
            await asyncio.sleep(0)
            return ToolOutput(f"{ctx.time_left:g}")
        if name == "hang":
            await asyncio.sleep(60)
        if name == "crash":
            raise RuntimeError("secret internals")
        if name == "refuse":
            raise ToolError("outside the workspace", "refused")
        if name == "ws":
            return ToolOutput((ctx.workspace / "task.txt").read_text(), error=True)
        return ToolOutput("x" * arguments.get("x", 1))


class Workbench(TextEnv):
    tools: ClassVar[dict] = {"probe": {"type": "test_probe"}}
    runs_inline = True

    def reset(self, task_index, options):
        (self.workspace / "task.txt").write_text(f"task {task_index}")
        return "go"

    def step(self, action):
        return StepResult("done", 1.0, True, True)


@pytest.fixture(autouse=True)
def registered():
    TOOLSETS.register("test_probe")(Probe)
    ENVS.register("test_bench")(Workbench)
    Probe.starts, Probe.broken = 0, False
    yield
    TOOLSETS.unregister("test_probe")
    ENVS.unregister("test_bench")


def service(**host):
    registry = CollectorRegistry()
    return EnvService(tools=ToolHost(metrics_registry=registry, **host), metrics_registry=registry), registry


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 30))


def calls(*names, arguments="{}"):
    return [ToolCall(f"c{i}", name, arguments) for i, name in enumerate(names)]


def test_each_failure_is_its_calls_own_result_and_counted():
    svc, registry = service(call_timeout_s=0.2, max_output_chars=100)

    async def main():
        state = await svc.create("test_bench", 4)
        assert [t["function"]["name"] for t in state.tools] == ["echo", "deadline", "hang", "crash", "refuse", "ws"]
        results = await svc.call_tools(
            state.episode_id,
            calls("nope", "hang", "crash", "refuse", "ws")
            + [ToolCall("j", "echo", "{x"), ToolCall("s", "echo", '{"x": "1"}'), ToolCall("l", "echo", '{"x": 500}')],
        )
        return [(r.id, r.kind) for r in results], {r.id: r.content for r in results}

    kinds, content = run(main())
    assert kinds == [
        ("c0", "unknown"),
        ("c1", "timeout"),
        ("c2", "failed"),
        ("c3", "refused"),
        ("c4", "error"),
        ("j", "invalid"),
        ("s", "invalid"),
        ("l", ""),
    ]
    assert (
        content["c0"].startswith("unknown tool 'nope'; the tools are: echo, deadline")
        and "within 0.2s" in content["c1"]
    )
    assert content["c2"] == "crash failed: RuntimeError"  # a tool's internals stay in the log
    assert content["c4"] == "task 4" and "not valid JSON" in content["j"] and "at x: '1' is not" in content["s"]
    assert len(content["l"]) == 100 and content["l"].endswith("[tool output truncated]")
    count = registry.get_sample_value
    assert count("omrl_envs_tool_calls_total", {"tool": "unknown", "kind": "unknown"}) == 1
    assert count("omrl_envs_tool_calls_total", {"tool": "echo", "kind": "invalid"}) == 2
    assert count("omrl_envs_tool_call_seconds_count", {"tool": "hang"}) == 1


def test_a_calls_deadline_grows_with_the_calls_queued_ahead_of_it():
    svc, _ = service(call_timeout_s=2)

    async def main():
        state = await svc.create("test_bench", 0)
        return await svc.call_tools(state.episode_id, calls("deadline", "deadline", "deadline"))

    assert sorted(float(r.content) for r in run(main())) == [2, 4, 6]


def test_the_workspace_lives_as_long_as_its_episode_and_the_toolset_starts_once():
    svc, _ = service()

    async def main():
        first, second = await svc.create("test_bench", 1), await svc.create("test_bench", 2)
        folders = [svc._episodes[s.episode_id].tools.workspace for s in (first, second)]
        assert folders[0] != folders[1] and all(f.is_dir() for f in folders)
        assert await svc.close(first.episode_id)
        await asyncio.sleep(0.2)  # the close runs on a worker
        return folders

    folders = run(main())
    assert not folders[0].exists() and folders[1].exists() and Probe.starts == 1
    svc.reap_idle(now=float("inf"))
    for _ in range(50):
        if not folders[1].exists():
            break
        run(asyncio.sleep(0.05))
    assert not folders[1].exists()


def test_a_toolset_that_cannot_start_fails_the_create_and_is_tried_again():
    svc, _ = service()
    Probe.broken = True
    with pytest.raises(Unavailable, match="could not start: server down"):
        run(svc.create("test_bench", 0))
    Probe.broken = False
    assert run(svc.create("test_bench", 0)).tools and Probe.starts == 2


def test_too_many_calls_and_calls_on_a_finished_episode_fail_the_rpc():
    svc, _ = service(max_calls=2)

    async def main():
        state = await svc.create("test_bench", 0)
        with pytest.raises(InvalidArgument, match="at most 2"):
            await svc.call_tools(state.episode_id, calls("echo", "echo", "echo"))
        await svc.step(state.episode_id, "done")
        with pytest.raises(FailedPrecondition, match="is done"):
            await svc.call_tools(state.episode_id, calls("echo"))

    run(main())


def test_an_env_without_toolsets_gets_no_tools_and_no_workspace():
    svc, _ = service()
    state = run(svc.create("corridor", 0))
    assert state.tools == [] and svc._episodes[state.episode_id].tools is None


def test_grpc_and_in_process_clients_agree_on_tools():
    svc, _ = service()

    async def play(client):
        state = await client.create("test_bench", 7)
        results = await client.call_tools(state.episode_id, calls("echo", "nope", "ws") + calls("echo", arguments="[]"))
        await client.close(state.episode_id)
        return json.dumps(state.tools), [(r.id, r.name, r.content, r.kind) for r in results]

    async def main():
        async with running(add_env_service(svc)) as address, GrpcEnvClient(address, timeout_s=5) as remote:
            assert await play(remote) == await play(InProcessEnvClient(svc))

    run(main())


def test_hostile_arguments_and_a_malformed_tool_list_are_refused_by_name():
    from services.common.errors import Internal
    from services.common.protos import envs_pb2
    from services.envs.messages import EpisodeState

    svc, _ = service()

    async def main():
        state = await svc.create("test_bench", 0)
        deep = "[" * 100_000 + "]" * 100_000
        return await svc.call_tools(state.episode_id, [ToolCall("d", "echo", deep)])

    assert run(main())[0].kind == "invalid"
    for tools_json in ('{"not": "a list"}', "[1, 2]", "[" * 100_000):
        with pytest.raises(Internal, match="tools_json"):
            EpisodeState.from_proto(envs_pb2.EpisodeState(episode_id="e", tools_json=tools_json))


def test_no_call_outlives_what_the_callers_deadline_leaves():
    svc, _ = service(call_timeout_s=30)

    async def main():
        state = await svc.create("test_bench", 0)
        return await svc.call_tools(state.episode_id, calls("deadline", "hang"), time_left=1.5)

    given, hung = run(main())
    assert float(given.content) == 0.5 and hung.kind == "timeout" and "within 0.5s" in hung.content
