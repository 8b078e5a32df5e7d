"""What every weight push transport is: a `WeightPusher` registered by name in `PUSHERS` (the config's
`learner.weight_push`), delivering a set to rollout servers and reporting a `PushResult` per server. The
transports register lazily (their modules load torch, grpc, torch.distributed only when chosen)."""

from __future__ import annotations

import abc
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from services.common.registry import Registry

if TYPE_CHECKING:  # the table is read when a config is parsed, which must not import torch
    from services.weightsync.buckets import WeightSet


@dataclass
class PushResult:
    address: str
    ok: bool
    policy_version: int = -1
    checksum: str = ""
    seconds: float = 0.0
    error: str = ""
    sent_checksum: str = ""
    """The checksum of what was sent when the transport has its own (`nccl`: over the bucket digests);
    empty: the set's own `checksum`."""


class WeightPusher(abc.ABC):
    """Delivers a full named-tensor set with its version to rollout servers; each server applies it
    atomically or not at all, and reports the checksum of what it applied. A pusher reads the set once,
    bucket by bucket (`WeightSet.buckets`), to the end even when every server failed (an FSDP source
    gathers collectively); it never holds the whole set."""

    needs_servers: bool = True
    """Whether the learner waits for a registered rollout server before it starts."""

    @abc.abstractmethod
    def push(
        self, version: int, weights: WeightSet, addresses: Sequence[str], *, rollback: bool = False, run: str = ""
    ) -> list[PushResult]:
        """`rollback` (with this `run`'s name) lets a server at a later version go back to `version`: the
        first push of a learner resumed from a checkpoint older than what the servers hold."""


PUSHERS: Registry[WeightPusher] = Registry("weight push transport", choice="weight_push")
PUSHERS.register_lazy("grpc", "services.weightsync.grpc.send")
PUSHERS.register_lazy("nccl", "services.weightsync.nccl.send")
PUSHERS.register_lazy("none", "services.weightsync.none")
