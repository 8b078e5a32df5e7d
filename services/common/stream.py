"""The trajectory stream on Redis: rollout servers append batches, the learner reads them through a
consumer group and acknowledges them only once they are part of a committed update."""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Iterable

import redis

from services.common.trajectory import RecordError, Trajectory, TrajectoryBatch, decode_batch, encode_batch

log = logging.getLogger(__name__)


def entry_fields(trajectories: Iterable[Trajectory], batch_id: str | None = None) -> dict[str, bytes | int]:
    """The fields of one stream entry, as `TrajectoryStream.publish` writes them and `read` decodes them."""
    trajectories = list(trajectories)
    return {"batch": encode_batch(trajectories, batch_id), "n": len(trajectories)}


@dataclass
class StreamEntry:
    entry_id: str
    batch: TrajectoryBatch


class TrajectoryStream:
    def __init__(self, client: redis.Redis, key: str, group: str = "learner", max_len: int = 10000):
        self.client, self.key, self.group, self.max_len = client, key, group, max_len
        self.dead_letter_key = f"{key}:dead"

    @classmethod
    def from_url(cls, url: str, key: str, group: str = "learner", max_len: int = 10000,
                 timeout_s: float = 10.0) -> "TrajectoryStream":
        from services.common.run_state import redis_client

        return cls(redis_client(url, timeout_s), key, group, max_len)

    def publish(self, trajectories: Iterable[Trajectory], batch_id: str | None = None) -> str:
        entry_id = self.client.xadd(self.key, entry_fields(trajectories, batch_id), maxlen=self.max_len,
                                    approximate=True)
        return entry_id.decode() if isinstance(entry_id, bytes) else entry_id

    def ensure_group(self) -> None:
        """Creates the consumer group reading from the stream's start, so nothing written before the
        learner came up is missed."""
        try:
            self.client.xgroup_create(self.key, self.group, id="0", mkstream=True)
        except redis.ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise

    def read(self, consumer: str, count: int, block_ms: int, pending: bool = False) -> list[StreamEntry]:
        """New entries for this consumer, or (pending=True) the ones it was given before and never acked."""
        reply = self.client.xreadgroup(self.group, consumer, {self.key: "0" if pending else ">"},
                                       count=count, block=None if pending else block_ms)
        entries = []
        for _, items in reply or []:
            for raw_id, fields in items:
                entry_id = raw_id.decode() if isinstance(raw_id, bytes) else raw_id
                if not fields:  # pending entry already trimmed from the stream
                    self.ack([entry_id])
                    continue
                try:
                    entries.append(StreamEntry(entry_id, decode_batch(fields[b"batch"])))
                except (RecordError, KeyError, ValueError) as exc:
                    log.error("stream entry %s is unreadable (%s); moved to %s", entry_id, exc, self.dead_letter_key)
                    self.client.xadd(self.dead_letter_key, {**fields, b"error": str(exc)}, maxlen=1000)
                    self.ack([entry_id])
        return entries

    def ack(self, entry_ids: Iterable[str]) -> int:
        ids = list(entry_ids)
        return self.client.xack(self.key, self.group, *ids) if ids else 0

    def pending_count(self) -> int:
        try:
            return int(self.client.xpending(self.key, self.group)["pending"])
        except redis.ResponseError:
            return 0

    def length(self) -> int:
        return int(self.client.xlen(self.key))

    def lag(self) -> int:
        """Entries not yet delivered to the group (Redis 7 reports it in XINFO GROUPS)."""
        for info in self.client.xinfo_groups(self.key):
            if info["name"] in (self.group, self.group.encode()):
                return int(info.get("lag") or 0)
        return 0
