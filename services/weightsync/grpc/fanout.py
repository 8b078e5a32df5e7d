"""One bucket producer feeding several pushes: each bucket is built once (in a thread, so an FSDP
gather or a copy overlaps the sends of the previous bucket) and handed to every live push.

Memory: the bucket being sent and the one being built, never more. The producer always runs to its
end, even when every push has failed: an FSDP source gathers with collectives, and the other ranks
walk the same source in lockstep."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator

from services.weightsync.buckets import Bucket

_END = object()


class _Consumer:
    def __init__(self) -> None:
        self.queue: asyncio.Queue = asyncio.Queue(maxsize=1)
        self.alive = True
        self._holding = False

    async def buckets(self) -> AsyncIterator[Bucket]:
        """Each bucket counts as sent once the push asks for the next one."""
        while True:
            item = await self.queue.get()
            self._holding = True
            if item is _END:
                self._release()
                return
            if isinstance(item, BaseException):
                self._release()
                raise RuntimeError(f"weight source failed: {item}") from item
            yield item
            self._release()

    def _release(self) -> None:
        if self._holding:
            self._holding = False
            self.queue.task_done()

    def drop(self) -> None:
        """The push ended (done or failed): release anything queued for it and stop feeding it."""
        self.alive = False
        self._release()
        while not self.queue.empty():
            self.queue.get_nowait()
            self.queue.task_done()


class BucketFanout:
    def __init__(self, source: Iterator[Bucket], consumers: int):
        self._source = source
        self.consumers = [_Consumer() for _ in range(consumers)]

    async def run(self) -> None:
        """Feeds every live consumer; returns once the source is exhausted (re-raises its error after
        telling the consumers)."""
        building = asyncio.ensure_future(asyncio.to_thread(next, self._source, _END))
        try:
            while True:
                try:
                    item = await building
                except Exception as exc:  # noqa: BLE001 - handed to every push, then re-raised
                    await self._hand(exc)
                    raise
                await self._wait_sent()
                await self._hand(item)
                if item is _END:
                    return
                building = asyncio.ensure_future(asyncio.to_thread(next, self._source, _END))
        finally:
            if not building.done():
                await asyncio.shield(building)

    async def _wait_sent(self) -> None:
        for c in self.consumers:
            if c.alive:
                await c.queue.join()

    async def _hand(self, item) -> None:
        for c in self.consumers:
            if c.alive:
                c.queue.put_nowait(item)
