"""The sending end of an `nccl` weight push, on the learner: bytes by broadcast in a process group per rollout
server (the learner's rank 0 and that server's engine workers; gloo on CPU, NCCL on GPU), control on the
authenticated gRPC stream (header naming the group, per-bucket specs and digest, commit). See the package
docstring; the receiving end is `receive` (data) and `staging` (the server's record).

Each bucket is packed once on the learner's device and broadcast to every live server's group in turn,
while the next one is packed into the other of two buffers; memory beyond the learner's shards is two
buckets. A one-process learner's set is laid out once and re-packed from that layout on every push
(`BucketPacker`). The pass runs to its end even when every server failed (an FSDP source gathers
collectively). A group that failed in any way is closed and replaced by a new one (a new name) at the
next push to that server; one the server left without a failure on this side (it joined another learner's
group, or restarted) is replaced within the push that finds it left."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass, field

import grpc
import torch

from services.common.errors import Unavailable
from services.common.protos import rollout_pb2
from services.weightsync.base import PUSHERS, PushResult, WeightPusher
from services.weightsync.buckets import MiB, WeightSet
from services.weightsync.credential import token_from_env
from services.weightsync.digest import bucket_digest, set_checksum
from services.weightsync.nccl.group import Group, Rendezvous, backend_for, open_store
from services.weightsync.nccl.pack import BucketPacker, DeviceBucket, SendWindow
from services.weightsync.rpc import specs_to_proto, update_header, update_weights
from services.weightsync.wire import TensorSpec

log = logging.getLogger(__name__)
_END = object()


@dataclass
class _Session:
    address: str
    rdv: Rendezvous
    group: Group | None
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    channel: grpc.aio.Channel | None = None
    call: asyncio.Future | None = None
    error: str = ""
    streamed: bool = False  # the server opened a receive session (else it answered at the header)
    start: float = field(default_factory=time.perf_counter)

    @property
    def alive(self) -> bool:
        return not self.error and self.call is not None and not self.call.done()

    def fail(self, error: str) -> None:
        self.error = self.error or error
        if self.call is not None and not self.call.done():
            self.call.cancel()


@PUSHERS.register("nccl")
class NcclWeightPusher(WeightPusher):
    def __init__(
        self,
        timeout_s: float = 120.0,
        token: str | None = None,
        bucket_mb: int = 256,
        *,
        host: str = "127.0.0.1",
        port: int = 29600,
        backend: str = "auto",
        nccl_timeout_s: float = 60.0,
        device: str | None = None,
    ):
        self.timeout_s, self.bucket_bytes = timeout_s, bucket_mb * MiB
        self.token = token if token is not None else token_from_env()
        if backend == "auto":
            backend = "nccl" if torch.cuda.is_available() else "gloo"
        self.host, self.port, self.backend, self.nccl_timeout_s = host, port, backend, nccl_timeout_s
        self.device = torch.device(device or ("cuda" if backend == "nccl" else "cpu"))
        if backend_for(self.device) != backend:
            raise ValueError(f"process-group backend {backend} cannot move tensors on {self.device}")
        self._store = None
        self._groups: dict[str, Group] = {}
        self._packer = BucketPacker(self.bucket_bytes, self.device)  # its layout is kept across pushes

    def push(
        self, version, weights: WeightSet, addresses: Sequence[str], *, rollback: bool = False, run: str = ""
    ) -> list[PushResult]:
        if self._store is None:  # the learner's rank 0 hosts the rendezvous store for the run's lifetime
            self._store = open_store("0.0.0.0", self.port, master=True, timeout_s=self.nccl_timeout_s)
        return asyncio.run(self._push_all(version, weights, list(addresses), rollback, run))

    def close(self) -> None:
        for group in self._groups.values():
            group.close()
        self._groups.clear()
        self._packer.release()

    def _rendezvous(self, address: str) -> tuple[Rendezvous, Group | None]:
        group = self._groups.get(address)
        if group is not None:
            return group.rdv, group
        name = f"{address.replace('/', '_')}-{uuid.uuid4().hex[:12]}"
        return Rendezvous(self.host, self.port, name, self.backend, self.nccl_timeout_s), None

    async def _push_all(self, version, weights, addresses, rollback, run) -> list[PushResult]:
        opened: list[_Session] = []  # every session this push started, a replaced one too: each is closed below

        def start(address: str) -> _Session:
            s = _Session(address, *self._rendezvous(address))
            s.channel, call = self._start_call(s, version, weights.specs, rollback, run)
            s.call = asyncio.ensure_future(call)
            opened.append(s)
            return s

        try:
            sessions = await asyncio.gather(*(self._open(a, start) for a in addresses))
            digests = await self._stream(sessions, self._buckets(weights))
            checksum = set_checksum(weights.specs, digests)
            for s in sessions:
                s.queue.put_nowait(("commit", checksum))
                s.queue.put_nowait(_END)
            return [await self._result(s, checksum) for s in sessions]
        finally:
            for s in opened:
                s.fail("push abandoned")
                await s.channel.close()

    async def _open(self, address: str, start) -> _Session:
        """`address`'s call (`start`), its group and the server's receive session. A group kept from an
        earlier push that the server has left since (for another learner's group, or by a restart) is
        refused at the header with UNAVAILABLE (`Group.join` never joins a group twice): it is dropped and
        the push goes on in a new group, once."""
        s = start(address)
        kept = s.group is not None
        await self._connect(s)
        if kept and _refused_unavailable(s):
            self._drop(address)
            s = start(address)
            await self._connect(s)
        return s

    async def _connect(self, s: _Session) -> None:
        if s.group is None:
            await self._join(s)
        if s.alive:
            await self._wait_session(s)

    def _drop(self, address: str) -> None:
        group = self._groups.pop(address, None)
        if group is not None:
            group.close()

    def _start_call(self, s: _Session, version, specs, rollback, run):
        channel = grpc.aio.insecure_channel(s.address)

        async def declarations():
            while (item := await s.queue.get()) is not _END:
                yield item

        call = push_control(
            channel,
            version,
            specs,
            declarations(),
            rendezvous=s.rdv,
            rollback=rollback,
            run=run,
            bucket_bytes=self.bucket_bytes,
            digests_follow=True,
            timeout_s=self.timeout_s,
            token=self.token,
        )
        return channel, call

    async def _join(self, s: _Session) -> None:
        try:
            s.group = await asyncio.to_thread(Group.host, s.rdv, self._store, lambda: s.call.done())
            self._groups[s.address] = s.group
        except Exception as exc:  # noqa: BLE001 - this server fails, the others go on
            if not _answered_ok(s):
                s.fail(f"forming the process group failed: {exc}")

    async def _wait_session(self, s: _Session) -> None:
        try:
            await asyncio.to_thread(s.group.wait_session, lambda: s.call.done())
            s.streamed = True
        except Exception as exc:  # noqa: BLE001 - this server refused the push (its call says why) or hung
            if not _answered_ok(s):
                s.fail(f"the server opened no receive session: {exc}")

    def _buckets(self, weights) -> Iterator[DeviceBucket]:
        if hasattr(weights, "named_tensors"):
            return self._packer.buckets(weights, digest=False)
        return self._from_host_buckets(weights)

    def _from_host_buckets(self, weights) -> Iterator[DeviceBucket]:
        """A set that only streams host buckets (a spooled re-push): moved to the group's device, digested
        by `_stream` while it moves, as a packed bucket is."""
        for b in weights.buckets(self.bucket_bytes):
            data = torch.frombuffer(b.data, dtype=torch.uint8) if b.nbytes else torch.empty(0, dtype=torch.uint8)
            yield DeviceBucket(b.specs, data.to(self.device), "")

    async def _stream(self, sessions: list[_Session], source: Iterator[DeviceBucket]) -> list[str]:
        """Declares and posts each bucket's broadcast to every live server, digests the bucket while it
        moves and sends the digest after it (the servers check a bucket once the next is declared), then
        waits for the previous bucket's broadcast (`SendWindow`) before the next is packed into that one's
        buffer: the pack of bucket k+1 and the digest of bucket k overlap bucket k's transfer."""
        digests, window = [], SendWindow()
        while (bucket := await asyncio.to_thread(next, source, None)) is not None:
            live = [s for s in sessions if s.alive]
            for s in live:
                s.queue.put_nowait(("bucket", bucket.specs, bucket.nbytes, ""))
            posted = []
            for s in live:
                try:
                    # in a thread: NCCL's first collective on a group sets up its communicator and blocks
                    # until the receivers join, which needs the declarations this loop streams
                    posted.append((s, await asyncio.to_thread(s.group.post, bucket.data)))
                except Exception as exc:  # noqa: BLE001 - the server's side ended (refused, died, timed out)
                    await self._fail_send(s, len(digests) + 1, exc)
            digests.append(bucket.digest or await asyncio.to_thread(bucket_digest, bucket.data))
            for s in live:
                if s.alive:
                    s.queue.put_nowait(("digest", digests[-1]))
            window.add(posted)
            for s, exc in await asyncio.to_thread(window.settle):
                await self._fail_send(s, len(digests) - 1, exc)
            del bucket
        for s, exc in await asyncio.to_thread(window.drain):
            await self._fail_send(s, len(digests), exc)
        return digests

    async def _fail_send(self, s: _Session, bucket: int, exc: Exception) -> None:
        # the call's end brings a refusal's reason; a client still sending when it ends would read gRPC's INTERNAL
        # instead (grpc/grpc#36066), so the declarations end first and the server answers once it has read them
        s.queue.put_nowait(_END)
        await asyncio.wait([s.call], timeout=5.0)
        s.fail(f"broadcast of bucket {bucket} failed: {exc}")

    async def _result(self, s: _Session, checksum: str) -> PushResult:
        try:
            if s.error:
                raise RuntimeError(s.error)
            reply = await s.call
            seconds = time.perf_counter() - s.start
            sent = checksum if s.streamed else ""
            return PushResult(s.address, True, reply.policy_version, reply.checksum, seconds, sent_checksum=sent)
        except BaseException as exc:  # noqa: BLE001 - one failed server must not stop the others' results
            if isinstance(exc, asyncio.CancelledError) and not s.error:
                raise
            reason = s.error
            if s.call is not None and s.call.done() and not s.call.cancelled() and s.call.exception():
                reason = f"{s.call.exception()}" + (f" ({s.error})" if s.error else "")
            self._drop(s.address)
            return PushResult(s.address, False, seconds=time.perf_counter() - s.start, error=reason or str(exc))


def _refused_unavailable(s: _Session) -> bool:
    """The server ended the call UNAVAILABLE before its session opened (it could not join the group)."""
    answered = not s.streamed and s.call.done() and not s.call.cancelled()
    return answered and isinstance(s.call.exception(), Unavailable)


def _answered_ok(s: _Session) -> bool:
    """The server answered before any data: it already serves this set (version and checksum), a success."""
    return s.call.done() and not s.call.cancelled() and s.call.exception() is None


async def push_control(
    channel: grpc.aio.Channel,
    version: int,
    specs: Sequence[TensorSpec],
    declarations: AsyncIterator,
    *,
    rendezvous: Rendezvous,
    rollback: bool = False,
    run: str = "",
    bucket_bytes: int,
    digests_follow: bool = False,
    timeout_s: float,
    token: str | None,
) -> rollout_pb2.UpdateWeightsResponse:
    """An `nccl` push's control stream: the header naming the process group (`Rendezvous`; the proto's field
    is `dist`, a `WeightDistRendezvous`, kept for wire compatibility), then what `declarations` yields
    (`("bucket", specs, nbytes, digest)` as each bucket is broadcast, with `digests_follow` its digest "" and
    `("digest", digest)` after it, then `("commit", checksum)`); the bytes travel in the group."""
    header = update_header(
        version,
        specs,
        rollback=rollback,
        run=run,
        bucket_bytes=bucket_bytes,
        dist=rollout_pb2.WeightDistRendezvous(
            host=rendezvous.host,
            port=rendezvous.port,
            group=rendezvous.group,
            backend=rendezvous.backend,
            timeout_s=rendezvous.timeout_s,
            digests_follow=digests_follow,
        ),
    )

    async def messages():
        yield rollout_pb2.WeightChunk(header=header)
        async for item in declarations:
            if item[0] == "bucket":
                _, bucket_specs, nbytes, digest = item
                yield rollout_pb2.WeightChunk(
                    bucket=rollout_pb2.WeightBucket(tensors=specs_to_proto(bucket_specs), nbytes=nbytes, digest=digest)
                )
            elif item[0] == "digest":
                yield rollout_pb2.WeightChunk(bucket_digest=item[1])
            else:
                yield rollout_pb2.WeightChunk(commit=rollout_pb2.WeightCommit(checksum=item[1]))

    return await update_weights(channel, messages(), timeout_s=timeout_s, token=token)
