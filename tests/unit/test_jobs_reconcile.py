"""The supervised reconcile loop: a crash restarts it after a back-off, and its health says when it is down
or has not finished a pass for too long. A fake clock and events make every step happen on purpose."""

import asyncio
import threading

from services.jobs.reconcile import Reconciler


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class ScriptedManager:
    """recover raises while `crash` is set; every tick is counted and can be made to fail."""

    def __init__(self):
        self.crash, self.fail_ticks = threading.Event(), threading.Event()
        self.recovers = self.ticks = 0
        self.ticked = threading.Event()

    def recover(self):
        self.recovers += 1
        if self.crash.is_set():
            raise RuntimeError("store gone")

    def tick(self):
        self.ticks += 1
        self.ticked.set()
        if self.fail_ticks.is_set():
            raise RuntimeError("launcher down")


async def until(condition, timeout_s=10.0):
    async def wait():
        while not condition():
            await asyncio.sleep(0.005)

    await asyncio.wait_for(wait(), timeout_s)


def test_a_crashed_loop_is_reported_and_restarted():
    async def scenario():
        manager, clock = ScriptedManager(), Clock()
        manager.crash.set()
        reconciler = Reconciler(manager, interval_s=0.01, max_pass_age_s=5, backoff_s=0.01, clock=clock)
        stop = asyncio.Event()
        task = asyncio.create_task(reconciler.supervise(stop))
        await until(lambda: reconciler.restarts >= 2)
        ready, why = reconciler.health()
        assert not ready and "reconcile loop crashed: RuntimeError: store gone" in why
        manager.crash.clear()
        await until(lambda: manager.ticks > 0 and reconciler.last_pass is not None)
        assert reconciler.health() == (True, "ok") and manager.recovers >= 3
        stop.set()
        await task
        assert not reconciler.health()[0]

    asyncio.run(scenario())


def test_readiness_goes_when_no_pass_finishes_for_too_long_and_comes_back():
    async def scenario():
        manager, clock = ScriptedManager(), Clock()
        reconciler = Reconciler(manager, interval_s=0.01, max_pass_age_s=5, clock=clock)
        stop = asyncio.Event()
        task = asyncio.create_task(reconciler.supervise(stop))
        await until(lambda: reconciler.last_pass is not None)
        manager.fail_ticks.set()
        failing_from = manager.ticks
        await until(lambda: manager.ticks > failing_from + 1)
        clock.now += 6
        ready, why = reconciler.health()
        assert not ready and "no reconcile pass finished for 6s (reconcile pass failed: RuntimeError" in why
        manager.fail_ticks.clear()
        await until(lambda: reconciler.last_pass == clock.now)
        assert reconciler.health() == (True, "ok")
        stop.set()
        await task

    asyncio.run(scenario())


def test_not_ready_until_the_first_pass_recovered_the_jobs():
    async def scenario():
        manager, clock = ScriptedManager(), Clock()
        release = threading.Event()
        manager.recover = lambda: release.wait(10)
        reconciler = Reconciler(manager, interval_s=0.01, max_pass_age_s=5, clock=clock)
        stop = asyncio.Event()
        task = asyncio.create_task(reconciler.supervise(stop))
        await until(lambda: reconciler.running)
        ready, why = reconciler.health()
        assert not ready and why.startswith("recovering jobs: first reconcile pass not finished")
        release.set()
        await until(lambda: reconciler.last_pass is not None)
        assert reconciler.health() == (True, "ok")
        stop.set()
        await task

    asyncio.run(scenario())
