"""Background tasks of the rollout server: a failure stops the server (to exit non-zero) instead of
dying quietly; a transient Redis error in the heartbeat is retried."""

import asyncio
import contextlib
import subprocess
import sys
import threading
import time

import redis

from services.rollout.supervision import TaskSupervisor, retrying, watch_engine


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 10))


def test_a_task_that_raises_stops_the_server_and_is_recorded():
    async def scenario():
        stop = asyncio.Event()
        tasks = TaskSupervisor(stop)

        async def broken():
            raise KeyError("boom")

        tasks.start("producer", broken())
        tasks.start("heartbeat", asyncio.Event().wait())
        await stop.wait()
        await tasks.cancel_all()
        return tasks.failure

    assert run(scenario()) == "producer died: KeyError: 'boom'"


def test_cancelled_or_finished_tasks_are_not_failures():
    async def scenario():
        stop = asyncio.Event()
        tasks = TaskSupervisor(stop)
        done = tasks.start("producer", asyncio.sleep(0))
        await done
        tasks.start("heartbeat", asyncio.Event().wait())
        await tasks.cancel_all()
        return stop.is_set(), tasks.failure

    assert run(scenario()) == (False, None)


def test_transient_redis_errors_are_retried_and_other_errors_end_the_loop():
    calls = []

    async def beat():
        calls.append(len(calls))
        if len(calls) <= 2:
            raise redis.exceptions.ConnectionError("redis restarting")
        if len(calls) == 4:
            raise ValueError("bug")

    async def scenario():
        try:
            await retrying(beat, "heartbeat", every_s=0.001, max_backoff_s=0.004)
        except ValueError as exc:
            return str(exc)

    assert run(scenario()) == "bug" and len(calls) == 4


def test_engine_watch_reports_the_death_once():
    deaths = []

    async def check():
        raise RuntimeError("EngineDeadError")

    run(watch_engine(check, deaths.append, every_s=0.001))
    assert [str(d) for d in deaths] == ["EngineDeadError"]


def test_the_heartbeat_survives_a_redis_outage_and_reports_the_served_version():
    from services.rollout.app import heartbeat

    class Core:
        policy_version, serving = 3, False

        def status(self):
            return {"policy_version": 3, "waiting_for_version": 5}

        async def wait_for_new_version(self, seen, timeout_s):
            await asyncio.sleep(timeout_s)

    class State:
        def __init__(self):
            self.calls, self.registered = 0, asyncio.Event()

        async def register_rollout(self, address, info):
            self.calls += 1
            if self.calls == 1:
                raise redis.exceptions.TimeoutError("redis failing over")
            self.info = (address, info)
            self.registered.set()

    async def scenario():
        state = State()
        task = asyncio.create_task(heartbeat(state, "10.0.0.1:50051", Core(), every_s=0.001))
        await state.registered.wait()
        task.cancel()
        return state.info

    address, info = run(scenario())
    assert address == "10.0.0.1:50051"
    assert (info["version"], info["serving"], info["waiting_for_version"]) == (3, False, 5)


def test_the_heartbeat_reports_a_landed_push_at_once_not_a_beat_later():
    """The learner pushes the servers its registry shows behind: a registry still showing the version before a push
    that landed would have it push that version again."""
    from services.rollout.app import heartbeat

    class Core:
        serving = True

        def __init__(self):
            self.policy_version, self.landed = 3, asyncio.Event()

        def status(self):
            return {"policy_version": self.policy_version}

        async def wait_for_new_version(self, seen, timeout_s):  # RolloutCore's: until the version is not `seen`
            if self.policy_version == seen:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.landed.wait(), timeout_s)
                self.landed.clear()

    class State:
        def __init__(self):
            self.versions = []

        async def register_rollout(self, address, info):
            self.versions.append(info["version"])

    async def scenario():
        core, state = Core(), State()
        task = asyncio.create_task(heartbeat(state, "10.0.0.1:50051", core, every_s=60.0))
        await asyncio.sleep(0.05)
        core.policy_version = 4
        core.landed.set()
        pushed = time.monotonic()
        while state.versions[-1] != 4 and time.monotonic() - pushed < 5.0:
            await asyncio.sleep(0.001)
        task.cancel()
        return state.versions, time.monotonic() - pushed

    versions, seconds = run(scenario())
    assert versions == [3, 4] and seconds < 1.0  # one beat at start, the next when v4 landed, not 60 s on


HUNG_CLEANUP = """
import asyncio, time
from services.rollout.supervision import TaskSupervisor

async def main():
    tasks = TaskSupervisor(asyncio.Event(), exit_deadline_s=0.5)

    async def engine_watch():
        raise RuntimeError("engine dead")

    tasks.start("engine watch", engine_watch())
    await tasks.stop.wait()
    time.sleep(60)  # a cleanup that never returns

asyncio.run(main())
"""


def test_a_failed_server_whose_cleanup_hangs_exits_1_with_the_thread_stacks():
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-c", HUNG_CLEANUP], capture_output=True, text=True, timeout=50)
    assert done.returncode == 1, done.stderr
    assert time.monotonic() - start < 30
    assert "still running after 0.5s; exiting 1 now" in done.stderr
    assert 'File "<string>", line 13 in main' in done.stderr  # the hung line, in the stacks


def test_a_supervisor_without_a_deadline_leaves_the_exit_to_its_caller():
    async def scenario():
        tasks = TaskSupervisor(asyncio.Event())

        async def broken():
            raise KeyError("boom")

        tasks.start("producer", broken())
        await tasks.stop.wait()
        await asyncio.sleep(0.2)
        return threading.active_count()

    before = threading.active_count()
    assert run(scenario()) == before
