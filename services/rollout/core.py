"""The rollout server's logic, free of gRPC: generation on a backend, stamped with the policy
version, and atomic weight updates.

Invariants of a weight push (nothing reaches the engine unless all hold; on any refusal the engine
keeps serving the version it had):
- the set is exactly the served model's (names, shapes, dtypes: `ModelSignature`, checked on the header
  before any data is read), each bucket matches its sha256 and holds finite values, and the whole set
  matches the checksum of its commit (`weightsync.grpc.receive`, `weightsync.nccl.staging`);
- atomic without a second copy in memory: verified buckets wait in a spool file; only a set that
  checked out whole is applied, bucket by bucket from that file, under the write lock (no request in
  flight, none admitted until it is done); a refused or interrupted push deletes the spool;
- versions never go backwards: a version below the served one, or the same version with other weights,
  is refused unless the push is a rollback of this same run; the same version with the same checksum is
  a no-op success (a resumed learner re-pushes what the server already holds).

A server that starts while its run already published policy vN (`required_version`) serves nothing
(Generate: UNAVAILABLE, health NOT_SERVING) until it holds a version >= N."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from services.common import metrics
from services.common.errors import FailedPrecondition, InvalidArgument, Unavailable
from services.engines.base import Generation, RolloutBackend, SamplingSpec
from services.rollout.loop_stages import LOOP_STAGE_SECONDS
from services.rollout.rwlock import ReadWriteLock
from services.weightsync.grpc.receive import BucketReceiver
from services.weightsync.nccl.staging import NcclStaging
from services.weightsync.spool import WeightSpool
from services.weightsync.wire import ModelSignature, TensorSpec, WeightSetRejected

log = logging.getLogger(__name__)

GENERATED_TOKENS = metrics.counter("rollout", "generated_tokens_total", "Tokens sampled by the engine")
GENERATE_LATENCY = metrics.histogram(
    "rollout", "generate_latency_seconds", "Latency of one generation call", buckets=metrics.DURATION_BUCKETS
)
ACTIVE_REQUESTS = metrics.gauge("rollout", "active_requests", "Generation requests in flight")
ENGINE_IDLE = metrics.counter(
    "rollout", "engine_idle_seconds_total", "Time with no generation request in flight (counted when one arrives)"
)
WEIGHTS_WAIT = LOOP_STAGE_SECONDS.labels("weights_wait")
POLICY_VERSION = metrics.gauge("rollout", "policy_version", "Policy version being served")
WEIGHT_UPDATE_SECONDS = metrics.histogram(
    "rollout", "weight_update_seconds", "Time to apply a weight set", buckets=metrics.DURATION_BUCKETS
)
PUSHES_REFUSED = metrics.preset(
    metrics.counter("rollout", "weight_pushes_refused_total", "Weight pushes refused, nothing applied", ["reason"]),
    ("unauthenticated",),
    ("invalid",),
    ("stale",),
)


@dataclass
class VersionedGeneration:
    generation: Generation
    policy_version: int


@dataclass
class UpdateResult:
    policy_version: int
    checksum: str
    bytes_received: int
    apply_seconds: float


@dataclass(frozen=True)
class PushHeader:
    version: int
    specs: Sequence[TensorSpec]
    checksum: str
    """The set checksum; "" when the sender learns it only by streaming the set (it comes with the commit)."""
    rollback: bool = False
    run: str = ""
    bucket_bytes: int = 0
    total_bytes: int = -1
    """-1: the tensors' own sum (in-process callers); from the wire it must equal that sum."""

    @property
    def declared_bytes(self) -> int:
        return sum(s.nbytes for s in self.specs)


@dataclass
class RolloutCore:
    backend: RolloutBackend
    model: str
    signature: ModelSignature | None = None
    """The served model's tensors; None accepts any set (tests with fake engines only)."""
    run: str = ""
    required_version: int = 0
    """Serve nothing until holding at least this version (the run's published one at start-up)."""
    policy_version: int = 0
    weights_checksum: str = ""
    generated_tokens: int = 0
    active_episodes: int = 0
    engine_dead: bool = False
    spool_dir: str | None = None
    """Where verified buckets wait until their set is whole (None: the system temporary folder)."""
    engine_idle_s: float = 0.0
    """Seconds with no request in flight, up to the last request's arrival (ENGINE_IDLE)."""
    _in_flight: int = 0
    _idle_since: float | None = None
    _lock: ReadWriteLock = field(default_factory=ReadWriteLock)
    _version_waiters: set[asyncio.Future] = field(default_factory=set)
    _nccl_lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    @property
    def waiting_for_version(self) -> int:
        return self.required_version if self.policy_version < self.required_version else 0

    @property
    def serving(self) -> bool:
        return not self.engine_dead and not self.waiting_for_version

    async def wait_until_serving(self, poll_s: float = 0.2) -> None:
        while not self.serving:  # a push makes it serve; a dead engine never does
            await self.wait_for_new_version(self.policy_version, poll_s)

    async def wait_for_new_version(self, seen: int, timeout_s: float) -> None:
        """Returns once the served version is no longer `seen` (a push landed), or after `timeout_s`."""
        if self.policy_version != seen:
            return
        waiter = asyncio.get_running_loop().create_future()
        self._version_waiters.add(waiter)
        try:
            await asyncio.wait_for(waiter, timeout_s)
        except TimeoutError:
            pass
        finally:
            self._version_waiters.discard(waiter)

    async def generate(self, request_id: str, prompt_ids: Sequence[int], sampling: SamplingSpec) -> VersionedGeneration:
        if self.engine_dead:
            raise Unavailable("the engine is dead or holds a half-applied weight set; this server must restart")
        if self.waiting_for_version:
            raise Unavailable(
                f"waiting for weights v{self.required_version}: this rollout server (re)started "
                f"while the run is at that version and holds v{self.policy_version}"
            )
        queued = time.perf_counter()
        async with self._lock.read():
            WEIGHTS_WAIT.observe(time.perf_counter() - queued)
            version = self.policy_version
            ACTIVE_REQUESTS.inc()
            start = time.perf_counter()
            self._request_starts(start)
            try:
                generation = await self.backend.generate(request_id, list(prompt_ids), sampling)
            finally:
                ACTIVE_REQUESTS.dec()
                self._in_flight -= 1
                if not self._in_flight:
                    self._idle_since = time.perf_counter()
        GENERATE_LATENCY.observe(time.perf_counter() - start)
        self.generated_tokens += len(generation.token_ids)
        GENERATED_TOKENS.inc(len(generation.token_ids))
        return VersionedGeneration(generation, version)

    def _request_starts(self, now: float) -> None:
        if not self._in_flight and self._idle_since is not None:
            idle = now - self._idle_since
            self.engine_idle_s += idle
            ENGINE_IDLE.inc(idle)
        self._in_flight += 1

    def admit(self, header: PushHeader) -> bool:
        """Checks a push's header before any of its data is read. True: the server already holds exactly
        this set (nothing to do). Raises FailedPrecondition (version) or InvalidArgument (set)."""
        # An empty checksum matches nothing: a first-pass header ("") on a server that has served no push
        # yet ("") would otherwise skip the learner's first push of v0 and leave the disk weights served.
        if header.checksum and header.version == self.policy_version and header.checksum == self.weights_checksum:
            return True
        maybe_served_set = not header.checksum and header.version == self.policy_version
        if self._behind(header) and not maybe_served_set:  # the commit's checksum decides that case
            if not header.rollback:
                PUSHES_REFUSED.labels("stale").inc()
                log.warning(
                    "weight push v%d refused: this server serves v%d and versions never go back "
                    "(set rollback for a deliberate one)",
                    header.version,
                    self.policy_version,
                )
                raise FailedPrecondition(
                    f"version {header.version} is not above the served "
                    f"v{self.policy_version}; nothing applied (not a rollback)"
                )
            if header.run != self.run:
                PUSHES_REFUSED.labels("stale").inc()
                raise FailedPrecondition(
                    f"rollback to v{header.version} refused: it is for run {header.run!r}, "
                    f"this server serves run {self.run!r}"
                )
        if self.signature is not None:
            try:
                self.signature.check(header.specs)
            except WeightSetRejected as exc:
                self._refuse(header, exc)
        return False

    def _behind(self, header: PushHeader) -> bool:
        """Whether the push would not move the served version forward (the weights loaded from disk
        at start-up count as no version: the first push of v0 installs them)."""
        return header.version < self.policy_version or (
            header.version == self.policy_version and self.weights_checksum != ""
        )

    def _refuse(self, header: PushHeader, exc: Exception):
        PUSHES_REFUSED.labels("invalid").inc()
        log.warning("weight push v%d refused: %s", header.version, exc)
        raise InvalidArgument(f"weight set rejected, nothing applied: {exc}") from exc

    def begin_push(self, header: PushHeader) -> BucketReceiver | None:
        """Admits the header and returns the receiver for its buckets; None: the set is already served."""
        if self.admit(header):
            return None
        total = header.declared_bytes if header.total_bytes < 0 else header.total_bytes
        try:
            return BucketReceiver(header.specs, header.bucket_bytes, total, self.spool_dir)
        except WeightSetRejected as exc:
            self._refuse(header, exc)

    async def receive(self, header: PushHeader, receiver: BucketReceiver, step, *args) -> None:
        """Runs one receiver step (`receiver.start_bucket`, `.add_data`); a refusal aborts the push.
        Starting a bucket closes the previous one (hash, scan, spool write): that runs off the event loop."""
        try:
            if step == receiver.add_data:
                step(*args)
            else:
                await asyncio.to_thread(step, *args)
        except WeightSetRejected as exc:
            receiver.abort()
            self._refuse(header, exc)

    async def commit_push(self, header: PushHeader, receiver: BucketReceiver, checksum: str) -> UpdateResult:
        """Verifies the whole set, then applies it from the spool; the spool is gone when this returns."""
        if header.checksum and checksum != header.checksum:
            receiver.abort()
            self._refuse(header, WeightSetRejected("commit checksum differs from the header's"))
        try:
            spool = await asyncio.to_thread(receiver.commit, checksum)
        except WeightSetRejected as exc:
            receiver.abort()
            self._refuse(header, exc)
        try:
            return await self._apply(dataclasses.replace(header, checksum=checksum), spool)
        finally:
            spool.delete()

    async def begin_nccl_push(
        self, header: PushHeader, rendezvous: dict, *, digests_follow: bool = False
    ) -> NcclStaging | None:
        """An `nccl` push (buckets by broadcast to the engine's workers): admits the header, then joins the
        learner's process group (a new group name: the engine leaves the previous group first) and opens a
        receive session. None: the set is already served. Holds the push slot until `end_nccl_push`."""
        if self.admit(header):
            return None
        total = header.declared_bytes if header.total_bytes < 0 else header.total_bytes
        try:
            staging = NcclStaging(
                header.specs, header.bucket_bytes, total, self.spool_dir, digests_follow=digests_follow
            )
        except WeightSetRejected as exc:
            self._refuse(header, exc)
        await self._nccl_lock.acquire()
        try:
            await self.backend.begin_nccl_push(rendezvous, total_bytes=total, tensors=len(header.specs))
        except Exception as exc:
            self._nccl_lock.release()
            staging.abort()
            log.warning("weight push v%d: joining the learner's process group failed: %s", header.version, exc)
            raise Unavailable(f"joining the learner's process group failed, nothing applied: {exc}") from exc
        return staging

    async def receive_nccl(self, header: PushHeader, staging: NcclStaging, specs, nbytes: int, digest: str) -> None:
        try:
            info = staging.declare(specs, nbytes, digest)
        except WeightSetRejected as exc:
            self._refuse(header, exc)
        try:
            await self.backend.receive_nccl_bucket(info)
        except Exception as exc:  # a bad digest or non-finite values in the worker, or a broken group
            self._refuse(header, WeightSetRejected(f"bucket of {specs[0].name!r} not received: {exc}"))

    def receive_nccl_digest(self, header: PushHeader, staging: NcclStaging, digest: str) -> None:
        """The digest of the bucket declared last, in a push whose digests follow their buckets."""
        try:
            staging.add_digest(digest)
        except WeightSetRejected as exc:
            self._refuse(header, exc)

    async def end_nccl_push(self, header: PushHeader, staging: NcclStaging, checksum: str | None) -> UpdateResult:
        """`checksum` None: the push failed or ended early (the group is dropped, the spool deleted).
        Otherwise closes the receive session and applies the set if the checksum verifies."""
        unflushed: Exception | None = None
        try:
            try:
                if checksum is not None:
                    try:
                        await self.backend.flush_nccl_bucket(staging.last_digest())
                    except Exception as exc:  # noqa: BLE001 - the last bucket failed a check (refused below)
                        unflushed = exc
                await self.backend.end_nccl_push(ok=checksum is not None and unflushed is None)
            finally:
                self._nccl_lock.release()
        except BaseException:  # a broken group (the learner died midway): the spool goes too
            staging.abort()
            raise
        if checksum is None:
            staging.abort()
            raise InvalidArgument("weight set rejected, nothing applied: the push ended before its commit")
        if unflushed is not None:
            staging.abort()
            self._refuse(header, WeightSetRejected(f"the last bucket was not received: {unflushed}"))
        try:
            if header.checksum and checksum != header.checksum:
                raise WeightSetRejected("commit checksum differs from the header's")
            spool = staging.commit(checksum)
        except WeightSetRejected as exc:
            staging.abort()
            self._refuse(header, exc)
        try:
            return await self._apply(dataclasses.replace(header, checksum=checksum), spool)
        finally:
            spool.delete()

    async def _apply(self, header: PushHeader, spool: WeightSpool) -> UpdateResult:
        if self.admit(header):  # the commit's checksum shows the served set was pushed again
            return UpdateResult(self.policy_version, self.weights_checksum, spool.nbytes, 0.0)
        start = time.perf_counter()
        async with self._lock.write():
            if self.admit(header):  # another push of the same set landed while this one waited
                return UpdateResult(self.policy_version, self.weights_checksum, spool.nbytes, 0.0)
            rollback = self._behind(header)
            try:
                await self.backend.load_weight_spool(spool, header.version)
            except Exception:
                # Part of the set may be in the engine: serve nothing more (health NOT_SERVING) rather
                # than a mix of two versions; a restarted server waits for the run's version.
                self.engine_dead = True
                log.exception("applying weights v%d failed midway: this server stops serving", header.version)
                raise
            if rollback:
                log.warning(
                    "ROLLBACK of run %s: v%d replaces the served v%d", self.run, header.version, self.policy_version
                )
            self.policy_version, self.weights_checksum = header.version, header.checksum
            for waiter in self._version_waiters:
                if not waiter.done():
                    waiter.set_result(None)
        seconds = time.perf_counter() - start
        POLICY_VERSION.set(header.version)
        WEIGHT_UPDATE_SECONDS.observe(seconds)
        log.info(
            "policy v%d loaded (%d tensors, %.1f MB in %d buckets) in %.2fs",
            header.version,
            len(header.specs),
            spool.nbytes / 1e6,
            len(spool.buckets),
            seconds,
        )
        if self.required_version and not self.waiting_for_version:
            log.info("holds v%d >= the run's v%d: serving", self.policy_version, self.required_version)
        return UpdateResult(header.version, header.checksum, spool.nbytes, seconds)

    def status(self) -> dict:
        return {
            "model": self.model,
            "backend": self.backend.name,
            "policy_version": self.policy_version,
            "weights_checksum": self.weights_checksum,
            "active_requests": self._lock.readers,
            "generated_tokens_total": self.generated_tokens,
            "active_episodes": self.active_episodes,
            "waiting_for_version": self.waiting_for_version,
        }
