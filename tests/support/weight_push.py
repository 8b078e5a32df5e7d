"""A rollout core in front of a fake engine that records what it loads, and a real gRPC server for it, for
tests of weight pushes without vLLM."""

import asyncio
import contextlib

import torch

from services.common.grpc_server import serve
from services.engines.base import Generation, RolloutBackend
from services.rollout.core import RolloutCore
from services.rollout.server import add_to_server
from services.weightsync.credential import PushAuthenticator
from services.weightsync.wire import ModelSignature


class FakeEngine(RolloutBackend):
    name = "fake"

    def __init__(self):
        self.loads: list[dict[str, torch.Tensor]] = []

    async def start(self): ...

    async def shutdown(self): ...

    async def generate(self, request_id, prompt_token_ids, sampling):
        return Generation([1, 2], [-0.1, -0.2], "length")

    async def load_weights(self, named_tensors):
        self.loads.append({name: t.clone() for name, t in named_tensors})


@contextlib.asynccontextmanager
async def serving(core, token):
    """Serves `core` over gRPC on a free loopback port until the block ends, pushes guarded by `token`;
    yields its address."""
    stop, bound = asyncio.Event(), asyncio.get_running_loop().create_future()
    task = asyncio.ensure_future(
        serve(
            "rollout",
            0,
            [add_to_server(core, PushAuthenticator(token))],
            host="127.0.0.1",
            grace_s=1.0,
            stop=stop,
            ready=bound.set_result,
            serving=lambda: core.serving,
        )
    )
    port = await asyncio.wait_for(asyncio.shield(bound), 10)
    try:
        yield f"127.0.0.1:{port}"
    finally:
        stop.set()
        await asyncio.wait_for(task, 10)


SHAPES = {"w": (4, 3), "b": (3,), "big": (64,)}
"""The model of `make_core`: a tensor bigger than a small bucket beside two small ones."""


def named(value: float):
    """A weight set of `SHAPES`, every element `value`."""
    return [(n, torch.full(shape, value)) for n, shape in SHAPES.items()]


def make_core(tmp_path):
    """A core of run `run-a` serving a model of `SHAPES`, spooling pushes under `tmp_path`; and its engine."""
    engine = FakeEngine()
    signature = ModelSignature.of(named(0.0))
    return RolloutCore(engine, "fake", signature=signature, run="run-a", spool_dir=str(tmp_path)), engine
