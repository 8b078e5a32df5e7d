"""The vLLM weight-transfer engine of the `nccl` weight push, registered in vLLM's factory as `omrl_nccl`:
the worker joins a process group with the learner's rank 0 (`init_weight_transfer_engine`) and receives
each bucket by broadcast (`update_weights` with `kind="receive"`), on gloo (CPU) or NCCL (GPU): the same
code, only the backend differs (`services/weightsync/nccl/`).

A received bucket is checked (digest, finite values) by the shared `weightsync.nccl.receive.BucketReceiver`
and staged in the rollout server's spool file at the offset the server chose (with `rollout.weight_staging:
memory`, in this worker's host arena instead: `weightsync.nccl.staging`); nothing reaches the model while
the push streams.
Receives are pipelined: `receive` of bucket k starts its broadcast, then checks
and stages bucket k-1 (so on a GPU bucket k's transfer overlaps k-1's checks and its copy to the host,
and the file write runs in `BucketStager`'s threads); `flush` checks and stages the last one and waits
for every write, before the server verifies the commit. The server applies the
spool once the commit verified, as for a gRPC push (`kind="load"`, the `omrl_spool` engine's path this
class inherits). So a receive session does not start vLLM's layerwise reload: it starts at the first
`load`, and `finish_weight_update` finalizes only a session that loaded."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from vllm.distributed.weight_transfer.base import WeightTransferInitInfo
from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

from services.engines.vllm_spool_engine import SpoolUpdateInfo, SpoolWeightTransferEngine
from services.weightsync.nccl.group import Group, Rendezvous
from services.weightsync.nccl.receive import BucketReceiver
from services.weightsync.nccl.staging import BucketStager, HostArena

BACKEND = "omrl_nccl"


@dataclass
class NcclInitInfo(WeightTransferInitInfo):
    host: str = ""
    port: int = 0
    group: str = ""
    backend: str = "gloo"
    timeout_s: float = 60.0

    @property
    def rendezvous(self) -> Rendezvous:
        return Rendezvous(self.host, self.port, self.group, self.backend, self.timeout_s)


@dataclass
class NcclUpdateInfo(SpoolUpdateInfo):
    """`kind="open"`: a push was accepted (counted in the group's store; the learner waits for that
    before its first broadcast). `kind="receive"`: start taking the next bucket from the group (to be
    checked against `digest` and written to `path` at `offset`, by the first worker only), then check and
    write the one before (against `previous_digest` where digests follow their buckets). `kind="flush"`:
    check and write the last received bucket. `kind="load"`: load a
    staged bucket into the model."""

    kind: str = "load"
    digest: str = ""
    previous_digest: str = ""  # where digests follow their buckets: the pending bucket's, checked now
    staging: str = "file"  # with `open`: where this push's buckets are staged, "file" (the spool) or "memory"
    staging_bytes: int = 0  # with `open` and "memory": the arena this push needs (`HostArena.span`)

    def __post_init__(self):
        super().__post_init__()
        if self.kind not in ("open", "receive", "flush", "load"):
            raise ValueError(f"update kind must be open, receive, flush or load, got {self.kind!r}")
        if self.staging not in ("file", "memory"):
            raise ValueError(f"staging must be file or memory, got {self.staging!r}")


class NcclWeightTransferEngine(SpoolWeightTransferEngine):
    init_info_cls = NcclInitInfo
    update_info_cls = NcclUpdateInfo

    group: Group | None = None
    receiver: BucketReceiver | None = None
    _reloading = False
    stager: BucketStager | HostArena | None = None  # this push's: the spool file's or the arena
    arena: HostArena | None = None  # kept from push to push, and across groups (its allocation is slow)
    _posted: tuple[str, int] | None = None  # where the bucket in flight is staged: spool path, offset

    def init_transfer_engine(self, init_info: NcclInitInfo) -> None:
        self.shutdown()
        rdv = init_info.rendezvous
        if rdv.backend == "nccl":
            torch.cuda.set_device(self.device)
        rank = self.parallel_config.rank  # this worker among the engine's workers; the learner is 0
        self.group = Group.join(rdv, rank + 1, self.parallel_config.world_size + 1)
        self.receiver = BucketReceiver(self.group)

    def start_weight_update(self) -> None:
        self._reloading = False

    def update_weights(self, update_info: dict) -> None:
        info = self.parse_update_info(update_info)
        if info.kind == "load" and not self._reloading:
            super().start_weight_update()
            self._reloading = True
        if info.kind == "load":
            super().update_weights(update_info)
            return
        if self.receiver is None:
            raise RuntimeError("no process group: init_weight_transfer_engine first")
        if info.kind == "open":  # the server accepted a push: tell the learner its buckets may come
            if self.receiver.pending:  # an earlier push ended without flush and without leaving the group
                raise RuntimeError("a bucket of an earlier push is still pending: the group is out of step")
            self._open_staging(info)
            if self.parallel_config.rank == 0:
                self.group.open_session()
            return
        if info.kind == "flush":
            self._stage(self._posted, self.receiver.flush(info.previous_digest))
            self._posted = None
            if self.stager is not None:
                self.stager.drain()  # every bucket in the spool before the server verifies the commit
            return
        where, self._posted = self._posted, (info.path, info.offset)
        earlier = self.receiver.post(info.specs, sum(info.sizes), info.digest, info.previous_digest)
        if earlier is not None:
            self._stage(where, earlier)

    def _open_staging(self, info: NcclUpdateInfo) -> None:
        """The push's staging: the spool file (`BucketStager`: from a GPU through pinned buffers and a writer
        thread), or with `memory` this process's `HostArena` (one worker only: the others could not read
        it at the commit)."""
        if info.staging == "memory":
            if self.parallel_config.world_size != 1:
                raise RuntimeError("weight staging in memory needs an engine of one worker (rollout.gpus: 1)")
            if self.arena is None:
                self.arena = HostArena()
            self.arena.begin(info.staging_bytes, pinned=self.group.rdv.backend == "nccl")
            self.stager = self.arena
        elif not isinstance(self.stager, BucketStager):
            self.stager = BucketStager()

    def _stage(self, where: tuple[str, int] | None, tensors: list) -> None:
        """Stages the bucket just checked (the first worker only)."""
        if self.parallel_config.rank == 0 and tensors and where is not None:
            if self.stager is None:  # every push's `open` sets it: a bucket without one is out of protocol
                raise RuntimeError("a weight bucket arrived before its push's open")
            self.stager.stage(*where, self.receiver.last)

    def receive_weights(self, update_info) -> None:
        """A `load` of a bucket this push staged in the arena loads its views of it; any other from the spool."""
        tensors = self.arena.tensors(update_info.path, update_info.offset, update_info.specs) if self.arena else None
        if tensors is None:
            super().receive_weights(update_info)
        else:
            self.model.load_weights(tensors)

    def finish_weight_update(self) -> None:
        if self._reloading:
            self._reloading = False
            super().finish_weight_update()

    def shutdown(self) -> None:
        self._posted = None
        if self.stager is not None:
            self.stager.close()
            self.stager = None
        if self.receiver is not None:
            self.receiver.release()
        if self.group is not None:
            self.group.close()
        self.group, self.receiver = None, None


def register() -> None:
    if BACKEND not in WeightTransferEngineFactory._registry:  # one registration per process
        WeightTransferEngineFactory.register_engine(BACKEND, NcclWeightTransferEngine)
