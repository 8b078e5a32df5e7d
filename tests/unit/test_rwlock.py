import asyncio

from services.rollout.rwlock import ReadWriteLock


def test_writer_waits_for_readers_and_blocks_new_ones():
    async def scenario():
        lock, events = ReadWriteLock(), []
        first_in = asyncio.Event()

        async def reader(name, hold):
            async with lock.read():
                events.append(f"{name}+")
                first_in.set()
                await asyncio.sleep(hold)
                events.append(f"{name}-")

        async def writer():
            await first_in.wait()
            async with lock.write():
                events.append("W")

        async def late_reader():
            await first_in.wait()
            await asyncio.sleep(0.01)  # arrives while the writer waits
            await reader("late", 0)

        await asyncio.gather(reader("r1", 0.05), writer(), late_reader())
        return events

    events = asyncio.run(scenario())
    assert events.index("W") > events.index("r1-"), "no update while a request is in flight"
    assert events.index("late+") > events.index("W"), "a waiting update is not starved by new requests"
