"""The generation backend interface: token ids in, token ids and logprobs out."""

from __future__ import annotations

import abc
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from services.common.registry import Registry
from services.engines import vllm_args


@dataclass
class SamplingSpec:
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    stop_token_ids: list[int] = field(default_factory=list)
    seed: int | None = None
    top_logprobs: int = 0
    """How many of the likeliest tokens' logprobs to return at each position besides the sampled one's (a judge's
    yes/no verdict); 0 (the rollout): the sampled token's only."""


@dataclass
class Generation:
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str  # "stop" | "length" | "abort"
    top_logprobs: list[dict[int, float]] = field(default_factory=list)
    """With `SamplingSpec.top_logprobs`: per position, token id -> logprob of the likeliest tokens and the sampled
    one's."""


class RolloutBackend(abc.ABC):
    """One policy engine. `generate` calls run concurrently (the engine batches them continuously);
    `load_weights` is only called while no `generate` is in flight (the server guarantees it)."""

    name: str = "base"

    @abc.abstractmethod
    async def start(self) -> None: ...

    @abc.abstractmethod
    async def generate(self, request_id: str, prompt_token_ids: list[int], sampling: SamplingSpec) -> Generation: ...

    @abc.abstractmethod
    async def load_weights(self, named_tensors: Iterable[tuple[str, Any]]) -> None:
        """Replace weights in place by Hugging Face parameter name (torch tensors)."""

    async def load_weight_spool(self, spool: Any, version: int) -> None:
        """Replace weights from a verified `weightsync.spool.WeightSpool` (bucket by bucket from its file).
        This default hands `load_weights` copies of the tensors; engines override it to load from the
        file without the copies."""
        await self.load_weights(spool.named_tensors(copy=True))

    async def begin_nccl_push(self, rendezvous: dict, *, total_bytes: int = 0, tensors: int = 0) -> None:
        """Joins the learner's process group named in `rendezvous` (unless already in it) and opens a
        receive session for an `nccl` push (`services/weightsync/nccl/`) of `total_bytes` in
        `tensors` tensors."""
        raise NotImplementedError(f"the {self.name} backend has no process-group weight transport")

    async def receive_nccl_bucket(self, info: dict) -> None:
        """Receives one bucket by broadcast, checks it and stages it (`NcclStaging.declare`'s info). An
        engine may pipeline: start this bucket's transfer and check and stage the one before, leaving
        the last to `flush_nccl_bucket`."""
        raise NotImplementedError(f"the {self.name} backend has no process-group weight transport")

    async def flush_nccl_bucket(self, digest: str = "") -> None:
        """Checks and stages the last received bucket, if `receive_nccl_bucket` left it pending (against
        `digest` where digests follow their buckets, else its declared one); raises if it fails a check.
        Called before the commit is verified."""

    async def end_nccl_push(self, ok: bool) -> None:
        """Closes the receive session; `ok=False` also leaves the group (it may be broken)."""

    @abc.abstractmethod
    async def shutdown(self) -> None: ...

    async def check_alive(self) -> None:
        """Raises once the engine is dead for good (the server then exits so it is restarted)."""

    def describe(self) -> dict[str, Any]:
        return {"backend": self.name}


BACKENDS: Registry[RolloutBackend] = Registry("rollout backend", choice="backend")
BACKENDS.register_lazy("vllm", "services.engines.vllm", options=vllm_args.check_engine_args)
"""`rollout.engine_args` of the vLLM backend: checked against vLLM's engine fields without importing vLLM."""
