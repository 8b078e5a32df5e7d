"""The rollout core counts the time its engine had no request in flight, and only that time."""

import asyncio

from services.engines.base import Generation, RolloutBackend, SamplingSpec
from services.rollout.core import RolloutCore


class GatedEngine(RolloutBackend):
    """Answers once `gate` is set."""

    name = "gated"

    def __init__(self):
        self.gate = asyncio.Event()

    async def start(self): ...

    async def shutdown(self): ...

    async def generate(self, request_id, prompt_token_ids, sampling):
        await self.gate.wait()
        return Generation([1], [-0.1], "length")

    async def load_weights(self, named_tensors): ...


SAMPLING = SamplingSpec(max_tokens=1)


def test_idle_is_the_gap_between_requests_not_the_time_they_overlap():
    async def scenario():
        engine = GatedEngine()
        engine.gate.set()
        core = RolloutCore(engine, "fake")
        await core.generate("a", [1], SAMPLING)
        assert core.engine_idle_s == 0.0  # before the first request the engine is starting, not idle
        await asyncio.sleep(0.2)
        await core.generate("b", [1], SAMPLING)
        gap = core.engine_idle_s
        engine.gate.clear()
        first = asyncio.create_task(core.generate("c", [1], SAMPLING))
        await asyncio.sleep(0.5)
        second = asyncio.create_task(core.generate("d", [1], SAMPLING))  # "c" still in flight: not idle
        await asyncio.sleep(0.01)
        engine.gate.set()
        await asyncio.gather(first, second)
        return gap, core.engine_idle_s

    gap, total = asyncio.run(asyncio.wait_for(scenario(), 30))
    assert gap >= 0.2
    assert total - gap < 0.25  # only the instant between "b" ending and "c" arriving, not the 0.5 s after
