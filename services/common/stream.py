"""The trajectory stream on Redis: rollout servers append batches, the learner reads them through a
consumer group and acknowledges them only once they are part of a committed update.

An entry the learner must not train on (undecodable, larger than `max_entry_bytes`, or rejected by the
learner's poison guard) is copied to the dead-letter stream `<key>:dead` with its reason and error, and
acknowledged: it never stays pending and never comes back after a restart."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass

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


DEFAULT_MAX_ENTRY_BYTES = 16 * 1024 * 1024
DEAD_LETTER_MAX_LEN = 1000


class TrajectoryStream:
    def __init__(
        self,
        client: redis.Redis,
        key: str,
        group: str = "learner",
        max_len: int = 10000,
        max_entry_bytes: int = DEFAULT_MAX_ENTRY_BYTES,
    ):
        self.client, self.key, self.group, self.max_len = client, key, group, max_len
        self.max_entry_bytes = max_entry_bytes
        self.dead_letter_key = f"{key}:dead"
        self.on_dead_letter: Callable[[str, str, list[str]], None] | None = None
        """Called with (entry id, reason, group ids) after each dead letter: the learner counts lost groups."""

    @classmethod
    def from_url(
        cls, url: str, key: str, group: str = "learner", max_len: int = 10000, timeout_s: float = 10.0
    ) -> TrajectoryStream:
        from services.common.run_state import redis_client

        return cls(redis_client(url, timeout_s), key, group, max_len)

    def publish(self, trajectories: Iterable[Trajectory], batch_id: str | None = None) -> str:
        entry_id = self.client.xadd(
            self.key, entry_fields(trajectories, batch_id), maxlen=self.max_len, approximate=True
        )
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
        reply = self.client.xreadgroup(
            self.group, consumer, {self.key: "0" if pending else ">"}, count=count, block=None if pending else block_ms
        )
        return self._decode([item for _, items in reply or [] for item in items])

    def pending_ids(self, consumer: str, count: int = 100000) -> list[str]:
        """Ids of the entries delivered to `consumer` and not acknowledged (no payload is read)."""
        rows = self.client.xpending_range(self.key, self.group, min="-", max="+", count=count, consumername=consumer)
        return [_text(row["message_id"]) for row in rows]

    def fetch(self, entry_ids: Iterable[str]) -> list[StreamEntry]:
        """Given entries by id (e.g. pending ones whose delivery was lost), checked as `read` checks them."""
        items = []
        for entry_id in entry_ids:
            rows = self.client.xrange(self.key, entry_id, entry_id)
            items.append((entry_id, rows[0][1] if rows else {}))
        return self._decode(items)

    def _decode(self, items: list) -> list[StreamEntry]:
        entries = []
        for raw_id, fields in items:
            entry_id = _text(raw_id)
            if not fields:  # pending entry already trimmed from the stream
                self.ack([entry_id])
                continue
            size = sum(len(value) for value in fields.values())
            if size > self.max_entry_bytes:  # checked before decoding: its tensors could be any size
                self.dead_letter(
                    entry_id,
                    "too_large",
                    f"entry of {size} bytes exceeds the limit of {self.max_entry_bytes} (stream.max_entry_bytes)",
                    extra={b"bytes": size},
                )
                continue
            try:
                entries.append(StreamEntry(entry_id, decode_batch(fields[b"batch"])))
            except (RecordError, KeyError, ValueError) as exc:
                self.dead_letter(entry_id, "undecodable", str(exc), _group_ids(fields), extra=fields)
        return entries

    def dead_letter(
        self,
        entry_id: str,
        reason: str,
        error: str,
        group_ids: Iterable[str] = (),
        extra: dict | None = None,
        ack: bool = True,
    ) -> None:
        """Records an entry (its bytes, or the part named by `extra`, e.g. its rejected groups) in the
        dead-letter stream with `reason`, `error` and `groups`, then acknowledges it unless `ack` is False
        (other groups of the entry are still to be trained on)."""
        groups = sorted(set(group_ids))
        log.error(
            "stream entry %s (groups %s) dead-lettered to %s: %s: %s",
            entry_id,
            ",".join(groups) or "?",
            self.dead_letter_key,
            reason,
            error,
        )
        record = {
            **(extra or {}),
            b"entry_id": entry_id,
            b"reason": reason,
            b"error": error[:4000],
            b"groups": ",".join(groups),
        }
        self.client.xadd(self.dead_letter_key, record, maxlen=DEAD_LETTER_MAX_LEN, approximate=True)
        if ack:
            self.ack([entry_id])
        if self.on_dead_letter is not None:
            self.on_dead_letter(entry_id, reason, groups)

    def dead_letters(self) -> list[dict[str, str]]:
        """The dead-letter stream's records, oldest first, without payload bytes (for tests and tooling)."""
        out = []
        for _, fields in self.client.xrange(self.dead_letter_key):
            out.append({k.decode(): v.decode(errors="replace") for k, v in fields.items() if k != b"batch"})
        return out

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


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _group_ids(fields: dict) -> list[str]:
    """Group ids of an entry that parses but breaks the record's contract (none when it does not parse)."""
    try:
        return [t.group_id for t in TrajectoryBatch.FromString(fields[b"batch"]).trajectories]
    except Exception:  # noqa: BLE001 - only a hint for the dead letter
        return []
