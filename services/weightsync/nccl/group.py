"""Where an `nccl` push's process group meets (`Rendezvous`: the learner's store, the group's name, the
backend) and the group itself (`Group`): rank 0 (the learner) hosts the store and broadcasts, the rollout
engine's workers join as ranks 1.. and receive. See the package docstring."""

from __future__ import annotations

import datetime
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

BACKENDS = ("gloo", "nccl")


@dataclass(frozen=True)
class Rendezvous:
    """Where a group meets: the learner's store (`host`:`port`), the group's name (its store prefix), the
    backend, and the timeout of every collective and of joining."""

    host: str
    port: int
    group: str
    backend: str
    timeout_s: float

    def __post_init__(self):
        if self.backend not in BACKENDS:
            raise ValueError(f"process-group backend must be one of {BACKENDS}, got {self.backend!r}")
        if not 0 < self.port < 65536:
            raise ValueError(f"rendezvous port {self.port} is not a TCP port")
        if not self.group or "/" in self.group:
            raise ValueError(f"group name {self.group!r} must be non-empty and hold no '/'")

    @property
    def device(self) -> str:
        return "cuda" if self.backend == "nccl" else "cpu"


def backend_for(device: str | torch.device) -> str:
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def open_store(host: str, port: int, *, master: bool, timeout_s: float) -> torch.distributed.Store:
    return torch.distributed.TCPStore(
        host, port, None, master, timeout=datetime.timedelta(seconds=timeout_s), wait_for_workers=False
    )


class GroupLeft(ConnectionError):
    """A receiver was asked to join a group it had left: the learner still holds it, its receivers do not."""


class Group:
    """One process group of a rendezvous: `broadcast` from rank 0. Rank 0 learns the world size from the
    receivers' rank 1 (`announce`), so the learner needs no knowledge of a server's parallelism."""

    def __init__(self, rdv: Rendezvous, store, rank: int, world_size: int):
        import torch.distributed as dist

        self.rdv, self.rank, self.world_size = rdv, rank, world_size
        self.store = dist.PrefixStore(f"omrl/{rdv.group}/", store)
        timeout = datetime.timedelta(seconds=rdv.timeout_s)
        if rdv.backend == "nccl":
            opts = dist.ProcessGroupNCCL.Options()
            if hasattr(opts, "_timeout"):
                opts._timeout = timeout
            self.pg = dist.ProcessGroupNCCL(self.store, rank, world_size, opts)
        else:
            self.pg = dist.ProcessGroupGloo(self.store, rank, world_size, timeout)
        self._timeout = timeout
        self.sessions = 0  # pushes the source started on this group

    @classmethod
    def join(cls, rdv: Rendezvous, rank: int, world_size: int) -> Group:
        """A receiver's side: announces the world size (rank 1), then joins; blocks until rank 0 joins.
        Each rank joins a group once: rank 0 forms it once, so a rank that joined it before (its server left
        it since, for another learner's group or by a restart) would get no working group (the push waited
        out the timeout or broke at its first broadcast); it is refused at once (`GroupLeft`) and the learner
        forms a new group."""
        import torch.distributed as dist

        store = open_store(rdv.host, rdv.port, master=False, timeout_s=rdv.timeout_s)
        prefixed = dist.PrefixStore(f"omrl/{rdv.group}/", store)
        if prefixed.add(f"joined/{rank}", 1) > 1:
            raise GroupLeft(f"group {rdv.group}: rank {rank} joined and left it before; a new group is needed")
        if rank == 1:
            prefixed.set("world_size", str(world_size))
        return cls(rdv, store, rank, world_size)

    @classmethod
    def host(cls, rdv: Rendezvous, store, give_up: Callable[[], bool] = lambda: False) -> Group:
        """The source's side (rank 0) on the store it hosts: waits for the receivers' announcement (or
        until `give_up()`, or the timeout), then joins."""
        import torch.distributed as dist

        prefixed = dist.PrefixStore(f"omrl/{rdv.group}/", store)
        deadline = time.monotonic() + rdv.timeout_s
        while not prefixed.check(["world_size"]):
            if give_up():
                raise ConnectionError(f"group {rdv.group}: the receiver ended the push before joining")
            if time.monotonic() > deadline:
                raise TimeoutError(f"group {rdv.group}: no receiver joined within {rdv.timeout_s:.0f}s")
            time.sleep(0.005)
        return cls(rdv, store, 0, int(prefixed.get("world_size")))

    def open_session(self) -> None:
        """A receiver's side: its session is open (counted in the store), buckets may come."""
        self.store.add("sessions", 1)

    def wait_session(self, give_up: Callable[[], bool] = lambda: False) -> None:
        """The source's side, before a push's first bucket: waits until the receivers opened one more
        session than before (the server accepted the push's header), so no broadcast waits on a receiver
        that refused the push."""
        self.sessions += 1
        deadline = time.monotonic() + self.rdv.timeout_s
        while int(self.store.add("sessions", 0)) < self.sessions:
            if give_up():
                raise ConnectionError(f"group {self.rdv.group}: the receiver ended the push before receiving")
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"group {self.rdv.group}: the receiver opened no session in {self.rdv.timeout_s:.0f}s"
                )
            time.sleep(0.002)

    def broadcast(self, buffer: torch.Tensor) -> None:
        self.post(buffer).wait()

    def post(self, buffer: torch.Tensor):
        """Starts a broadcast from rank 0 into/out of `buffer`; the returned work's `wait()` ends it (on
        NCCL: orders the current CUDA stream after it)."""
        import torch.distributed as dist

        opts = dist.BroadcastOptions()
        opts.rootRank, opts.timeout = 0, self._timeout
        return self.pg.broadcast([buffer], opts)

    def close(self) -> None:
        pg, self.pg = self.pg, None
        if pg is not None and hasattr(pg, "shutdown"):
            try:
                pg.shutdown()
            except Exception:  # noqa: BLE001 - a group whose peer died may not shut down cleanly
                pass
