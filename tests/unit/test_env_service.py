import asyncio
import re
import threading
import time

import pytest
from prometheus_client import CollectorRegistry

from services.common.errors import (
    DeadlineExceeded,
    FailedPrecondition,
    Internal,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
)
from services.common.registry import Registry
from services.envs.base import InvalidTask, StepResult, TaskRejected, TextEnv
from services.envs.builtin.corridor import Corridor
from services.envs.builtin.guess_number import GuessNumber
from services.envs.client import InProcessEnvClient
from services.envs.registry import ENVS
from services.envs.service import TRUNCATION_MARK, EnvService


class SlowEnv(TextEnv):
    name = "slow"
    max_turns = 3
    closed = threading.Event()
    gate = threading.Event()
    """A step with the action "hold" returns once this is set."""

    def reset(self, task_index, options):
        if options.get("slow_reset"):
            time.sleep(0.6)
        return "slow start"

    def step(self, action):
        if action == "hold":
            SlowEnv.gate.wait(30)
            return StepResult("held")
        time.sleep(float(action))
        return StepResult(f"slept {action}")

    def close(self):
        SlowEnv.closed.set()


class BrokenEnv(TextEnv):
    name = "broken"

    def reset(self, task_index, options):
        if options.get("fail_reset"):
            raise RuntimeError("reset exploded")
        return "ready"

    def step(self, action):
        if action == "boom":
            raise ZeroDivisionError("step exploded")
        if action == "nonsense":
            return "not a StepResult"
        return StepResult("fine", info={"shape": (1, 2), "obj": object.__name__})


class VerboseEnv(TextEnv):
    name = "verbose"

    def reset(self, task_index, options):
        return "x" * 10_000

    def step(self, action):
        return StepResult("y" * 50)


def make_client(**kwargs) -> tuple[InProcessEnvClient, CollectorRegistry]:
    envs = Registry("environment")
    for cls in (Corridor, GuessNumber, SlowEnv, BrokenEnv, VerboseEnv):
        envs.register(cls.name)(cls)
    metrics = CollectorRegistry()
    return InProcessEnvClient(EnvService(envs=envs, metrics_registry=metrics, **kwargs)), metrics


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 30))


def test_list_envs():
    client, _ = make_client()
    infos = {info.name: info for info in run(client.list_envs())}
    assert set(infos) == {"corridor", "guess_number", "slow", "broken", "verbose"}
    assert infos["corridor"].max_turns == 4 and infos["guess_number"].max_turns == 5
    assert infos["corridor"].description


async def play_corridor(client, task_index: int) -> bool:
    state = await client.create("corridor", task_index, {})
    while not state.done:
        await asyncio.sleep(0)  # interleave episodes
        side = re.search(r"exit is to the (left|right)", state.observation).group(1)
        state = await client.step(state.episode_id, side)
    assert await client.close(state.episode_id)
    return state.success


def test_many_concurrent_episodes():
    client, metrics = make_client()

    async def main():
        results = await asyncio.gather(*(play_corridor(client, i) for i in range(200)))
        assert all(results)
        assert client.service.active == 0

    run(main())
    assert metrics.get_sample_value("omrl_envs_active_episodes") == 0
    assert metrics.get_sample_value("omrl_envs_episodes_finished_total", {"env": "corridor", "success": "true"}) == 200
    assert metrics.get_sample_value("omrl_envs_call_seconds_count", {"env": "corridor", "op": "step"}) == 600


def test_step_timeout_breaks_only_that_episode():
    SlowEnv.closed.clear()
    SlowEnv.gate.clear()
    client, metrics = make_client(step_timeout_s=1.0)

    async def main():
        slow = await client.create("slow")
        other = await client.create("corridor", 0)
        slow_step = asyncio.ensure_future(client.step(slow.episode_id, "hold"))
        await asyncio.sleep(0.05)
        assert (await client.step(other.episode_id, "left")).episode_id == other.episode_id
        assert not slow_step.done(), "a slow env must not block other episodes"
        with pytest.raises(DeadlineExceeded, match="slow: env call timed out after 1s"):
            await slow_step
        with pytest.raises(FailedPrecondition, match="unusable"):
            await client.step(slow.episode_id, "0")
        with pytest.raises(FailedPrecondition, match="unusable"):
            await client.reset(slow.episode_id, 0)
        assert await client.close(slow.episode_id)
        await asyncio.sleep(0.05)
        assert not SlowEnv.closed.is_set(), "closing waits for the abandoned call"
        SlowEnv.gate.set()
        await asyncio.to_thread(SlowEnv.closed.wait, 10)
        assert SlowEnv.closed.is_set()
        assert (await client.step(other.episode_id, "right")).info["turn"] == 2

    try:
        run(main())
    finally:
        SlowEnv.gate.set()  # a failed test must not leave the call holding
    assert metrics.get_sample_value("omrl_envs_errors_total", {"env": "slow", "kind": "DeadlineExceeded"}) == 1


def test_create_timeout():
    client, _ = make_client(step_timeout_s=0.2)
    with pytest.raises(DeadlineExceeded):
        run(client.create("slow", 0, {"slow_reset": True}))
    assert client.service.active == 0


def test_env_exception_fails_that_call_only():
    client, metrics = make_client()

    async def main():
        broken = await client.create("broken")
        other = await client.create("guess_number", 3)
        with pytest.raises(Internal, match="broken: ZeroDivisionError: step exploded"):
            await client.step(broken.episode_id, "boom")
        with pytest.raises(Internal, match="not a StepResult"):
            await client.step(broken.episode_id, "nonsense")
        state = await client.step(broken.episode_id, "ok")
        assert state.observation == "fine" and state.info == {"shape": [1, 2], "obj": "object"}
        assert (await client.step(other.episode_id, "8")).info["action_valid"]
        with pytest.raises(Internal, match="reset exploded"):
            await client.create("broken", 0, {"fail_reset": True})

    run(main())
    assert metrics.get_sample_value("omrl_envs_errors_total", {"env": "broken", "kind": "Internal"}) == 3


def test_observation_truncation():
    client, _ = make_client(max_observation_chars=100)
    state = run(client.create("verbose"))
    assert len(state.observation) == 100 and state.observation.endswith(TRUNCATION_MARK)
    assert state.info == {"observation_truncated": True}
    state = run(client.step(state.episode_id, "go"))
    assert state.observation == "y" * 50 and state.info == {}


def test_error_types():
    client, metrics = make_client(max_episodes=2)

    async def main():
        with pytest.raises(NotFound, match="known: broken, corridor, guess_number, slow, verbose"):
            await client.create("nope")
        for missing in (client.step("nope", "left"), client.reset("nope", 0)):
            with pytest.raises(NotFound, match="unknown episode 'nope'"):
                await missing
        assert await client.close("nope") is False
        for task_index in (-1, 1.5, True, "3"):
            with pytest.raises(InvalidArgument, match="task_index"):
                await client.create("corridor", task_index)
        with pytest.raises(InvalidArgument, match="bogus"):
            await client.create("corridor", 0, {"bogus": 1})
        with pytest.raises(InvalidArgument, match="mapping"):
            await client.create("corridor", 0, ["length", 3])

        state = await client.create("guess_number", 0, {"max_number": 1})
        done = await client.step(state.episode_id, "1")
        assert done.done and done.success
        with pytest.raises(FailedPrecondition, match="is done"):
            await client.step(state.episode_id, "1")
        with pytest.raises(InvalidArgument, match="action must be a string"):
            await client.step(state.episode_id, 1)
        with pytest.raises(InvalidArgument, match="task_index"):
            await client.reset(state.episode_id, -2)
        again = await client.reset(state.episode_id, 1)
        assert not again.done and (await client.step(state.episode_id, "1")).success

        await client.create("corridor")
        with pytest.raises(ResourceExhausted, match="max 2"):
            await client.create("corridor")
        assert await client.close(state.episode_id) and not await client.close(state.episode_id)
        await client.create("corridor")

    run(main())
    assert metrics.get_sample_value("omrl_envs_errors_total", {"env": "unknown", "kind": "NotFound"}) == 1
    assert metrics.get_sample_value("omrl_envs_errors_total", {"env": "", "kind": "NotFound"}) == 2


def test_reset_is_reproducible_through_the_service():
    client, _ = make_client()

    async def main():
        a = await client.create("corridor", 42, {"length": 12, "distance": 4})
        b = await client.create("corridor", 42, {"length": 12, "distance": 4})
        assert a.observation == b.observation and a.episode_id != b.episode_id
        await client.step(a.episode_id, "left")
        assert (await client.reset(a.episode_id, 42)).observation == b.observation

    run(main())


def test_idle_episodes_are_closed():
    client, _ = make_client(idle_ttl_s=0.0)

    async def main():
        old = await client.create("corridor")
        client.service._last_sweep = 0.0
        await client.create("corridor")
        with pytest.raises(NotFound):
            await client.step(old.episode_id, "left")

    run(main())


def test_aclose_closes_every_episode():
    SlowEnv.closed.clear()
    client, _ = make_client()

    async def main():
        await client.create("slow")
        await client.create("corridor")
        await client.service.aclose()
        assert client.service.active == 0

    run(main())
    assert SlowEnv.closed.wait(2)


def test_calls_on_one_episode_are_serialised_and_close_wins():
    client, _ = make_client()

    async def main():
        state = await client.create("slow")
        first = asyncio.ensure_future(client.step(state.episode_id, "0.3"))
        await asyncio.sleep(0.05)
        queued = asyncio.ensure_future(client.step(state.episode_id, "0"))
        await asyncio.sleep(0.05)
        assert await client.close(state.episode_id)
        assert (await first).observation == "slept 0.3"
        with pytest.raises(NotFound, match="was closed"):
            await queued

    run(main())


def test_malformed_step_result_is_internal():
    client, _ = make_client()

    async def main():
        state = await client.create("broken")
        client.service._episodes[state.episode_id].env.step = lambda action: StepResult("x", reward="lots")
        with pytest.raises(Internal, match="malformed StepResult"):
            await client.step(state.episode_id, "go")

    run(main())


class EveryOtherReset(TextEnv):
    """Its builds fail in turn (the 2nd, 4th, ... reset raises): per-episode failures inside one batch."""

    name = "every_other"
    resets = 0
    lock = threading.Lock()

    def reset(self, task_index, options):
        with EveryOtherReset.lock:
            EveryOtherReset.resets += 1
            if EveryOtherReset.resets % 2 == 0:
                raise RuntimeError("reset exploded")
        return "ready"

    def step(self, action):
        return StepResult("fine")


def test_create_batch_builds_a_group_and_fails_per_episode_or_as_a_whole():
    client, metrics = make_client(max_episodes=6)
    client.service._envs.register("every_other")(EveryOtherReset)

    async def main():
        single = await client.create("corridor", 7, {"length": 8})
        batch = await client.create_batch("corridor", 7, {"length": 8}, 3)
        assert len({s.episode_id for s in batch} | {single.episode_id}) == 4 and client.service.active == 4
        assert all((s.observation, s.info) == (single.observation, single.info) for s in batch)
        moved = await client.step(batch[1].episode_id, "left")  # each is an episode of its own
        assert (await client.step(batch[2].episode_id, "left")).observation == moved.observation
        for state in (single, *batch):
            assert await client.close(state.episode_id)

        EveryOtherReset.resets = 0
        mixed = await client.create_batch("every_other", 0, None, 4)
        assert [type(s).__name__ for s in mixed] == ["EpisodeState", "Internal"] * 2
        assert "reset exploded" in str(mixed[1]) and client.service.active == 2  # the built ones stay open

        with pytest.raises(NotFound, match="nope"):
            await client.create_batch("nope", 0, None, 2)
        with pytest.raises(InvalidArgument, match="task_index"):
            await client.create_batch("corridor", -1, None, 2)
        with pytest.raises(InvalidArgument, match="mapping"):
            await client.create_batch("corridor", 0, ["length"], 2)
        for count in (0, -1, 7, 1.0, True):
            with pytest.raises(InvalidArgument, match="count must be an int in 1..6"):
                await client.create_batch("corridor", 0, None, count)
        with pytest.raises(ResourceExhausted, match="2 episodes open, 5 more asked for"):
            await client.create_batch("corridor", 0, None, 5)  # all or nothing: none of them is built
        assert client.service.active == 2
        rejected = await client.create_batch("corridor", 0, {"bogus": 1}, 2)  # the env's own check, per episode
        assert all(isinstance(s, InvalidArgument) and "bogus" in str(s) for s in rejected)

    run(main())
    assert metrics.get_sample_value("omrl_envs_errors_total", {"env": "every_other", "kind": "Internal"}) == 2
    assert metrics.get_sample_value("omrl_envs_errors_total", {"env": "corridor", "kind": "InvalidArgument"}) == 9


class Staggered(TextEnv):
    """The first build of a batch is quick, the others take a while."""

    name = "staggered"
    resets = 0
    closed = 0

    def reset(self, task_index, options):
        Staggered.resets += 1
        if Staggered.resets > 1:
            time.sleep(2.0)
        return "ready"

    def step(self, action):
        return StepResult("fine")

    def close(self):
        Staggered.closed += 1


def test_a_cancelled_create_batch_closes_what_it_built():
    client, _ = make_client()
    client.service._envs.register("staggered")(Staggered)

    async def main():
        call = asyncio.ensure_future(client.create_batch("staggered", 0, None, 3))
        while not client.service.active:  # the quick one is built and open, the others still building
            await asyncio.sleep(0.01)
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call
        assert client.service.active == 0
        deadline = time.monotonic() + 10
        while Staggered.closed < 3 and time.monotonic() < deadline:  # the abandoned builds close once built
            await asyncio.sleep(0.05)
        assert Staggered.closed == 3

    run(main())


class ThreadRecorder(TextEnv):
    """Notes the thread of each call; its steps fail in every way an env can, by action."""

    name = "threaded_recorder"
    threads: list[int] = []

    def reset(self, task_index, options):
        self.threads.append(threading.get_ident())
        return "ready"

    def step(self, action):
        self.threads.append(threading.get_ident())
        failures = {
            "rejected": TaskRejected("task 7 is outside the server's range"),
            "invalid": InvalidTask("no such task"),
            "typed": FailedPrecondition("not now"),
            "boom": ZeroDivisionError("step exploded"),
        }
        if action in failures:
            raise failures[action]
        return StepResult("fine")

    def close(self):
        self.threads.append(threading.get_ident())


class InlineRecorder(ThreadRecorder):
    name = "inline_recorder"
    runs_inline = True


def recorder_client() -> tuple[InProcessEnvClient, CollectorRegistry]:
    client, metrics = make_client()
    for cls in (ThreadRecorder, InlineRecorder):
        client.service._envs.register(cls.name)(cls)
    return client, metrics


@pytest.mark.parametrize("env", [ThreadRecorder, InlineRecorder])
def test_an_inline_env_is_called_on_the_event_loop_and_others_in_a_worker(env):
    client, _ = recorder_client()
    env.threads = []

    async def main():
        loop_thread = threading.get_ident()
        state = await client.create_batch(env.name, 0, None, 2)
        await client.step(state[0].episode_id, "go")
        await client.close(state[0].episode_id)
        await client.service.aclose()
        return loop_thread

    loop_thread = run(main())
    assert len(env.threads) == 5  # two resets, a step, two closes (aclose waits for the workers' closes)
    on_loop = [ident == loop_thread for ident in env.threads]
    assert on_loop == [env.runs_inline] * 5


class SlowCloser(ThreadRecorder):
    name = "slow_closer"
    closed: list[int] = []

    def close(self):
        time.sleep(0.05)
        self.closed.append(1)


def test_aclose_closes_every_episode_also_those_queued_behind_busy_workers():
    """More open episodes than workers: most closes wait in the pool's queue when the service shuts down."""
    client, _ = make_client(workers=2)
    client.service._envs.register(SlowCloser.name)(SlowCloser)
    SlowCloser.closed = []

    async def main():
        await client.create_batch(SlowCloser.name, 0, None, 8)
        await client.service.aclose()

    run(main())
    assert len(SlowCloser.closed) == 8


def test_env_failures_map_to_the_same_errors_inline_or_threaded():
    client, metrics = recorder_client()
    actions = ("rejected", "invalid", "typed", "boom")

    async def failures(env_name):
        state = await client.create(env_name)
        errors = []
        for action in actions:
            with pytest.raises(Exception) as caught:
                await client.step(state.episode_id, action)
            errors.append((type(caught.value).__name__, str(caught.value).replace(env_name, "<env>")))
        return errors

    threaded, inline = run(failures("threaded_recorder")), run(failures("inline_recorder"))
    assert threaded == inline
    assert [kind for kind, _ in inline] == ["InvalidArgument", "InvalidArgument", "FailedPrecondition", "Internal"]
    assert client.service.abandoned_tasks == 2
    for env_name in ("threaded_recorder", "inline_recorder"):
        for kind, count in (("InvalidArgument", 2), ("FailedPrecondition", 1), ("Internal", 1)):
            assert metrics.get_sample_value("omrl_envs_errors_total", {"env": env_name, "kind": kind}) == count
        labels = {"env": env_name, "reason": "invalid"}
        assert metrics.get_sample_value("omrl_envs_tasks_abandoned_total", labels) == 1


def test_builtin_envs_that_never_wait_run_inline_and_the_rest_stay_threaded():
    inline = {name for name in ENVS.names() if ENVS.get(name).runs_inline}
    assert inline == {
        "corridor",
        "crafting",
        "guess_number",
        "maze",
        "wordle",
        "tool_arith",
        "tool_chain",
        "tool_lookup",
    }
    assert not SlowEnv.runs_inline  # so the step timeout above still applies to it
