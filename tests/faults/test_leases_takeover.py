"""Drill: a rollout server dies holding claimed groups. Its leases lapse and a live server replays the
lost groups on the same tasks; every group of the run reaches the stream exactly once."""

import asyncio

import pytest

from services.common.trajectory import decode_batch
from tests.support.producers import FlakyRewards, ScriptedLoop, play, run, seen, task_per_key  # noqa: F401

pytestmark = pytest.mark.faults


def test_groups_of_a_dead_producer_are_taken_over_and_published_once(run):  # noqa: F811
    async def main():
        hung = ScriptedLoop(gate=asyncio.Event())  # plays until killed
        doomed = run(hung, FlakyRewards(), "doomed", lease_ttl_s=1.0)
        survivor = run(ScriptedLoop(), FlakyRewards(), "survivor", lease_ttl_s=1.0)
        dying = asyncio.create_task(play(doomed))
        while len(hung.played) < 2:  # it holds both groups of step 0
            assert not dying.done()
            await asyncio.sleep(0.01)
        dying.cancel()  # killed: it renews nothing from now on
        await asyncio.gather(dying, return_exceptions=True)
        await play(survivor)  # returns once every group of the run is published
        return doomed, survivor

    doomed, survivor = asyncio.run(asyncio.wait_for(main(), 30))
    entries = seen(survivor).client.xrange(survivor.state.trajectories_key)
    batch_ids = [decode_batch(fields[b"batch"]).batch_id for _, fields in entries]
    assert sorted(batch_ids) == ["g0", "g1", "g2", "g3"]
    replayed = {group: task for group, task in survivor.loop.played if group in ("g0", "g1")}
    assert replayed == dict(doomed.loop.played)  # the same tasks
    counters = seen(survivor).rollout_counters()
    assert counters["groups_taken_over"] == 2 and counters["groups_published"] == 4
    assert seen(survivor).leases.held() == {}
