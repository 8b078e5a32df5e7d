"""An env gRPC server in this event loop, on a free loopback port."""

import asyncio
import contextlib

from services.common.grpc_server import serve


@contextlib.asynccontextmanager
async def running(*add_servicers, on_shutdown=None):
    """Serves `add_servicers` as the `envs` service until the block ends; yields its address."""
    stop, bound = asyncio.Event(), asyncio.get_running_loop().create_future()
    task = asyncio.ensure_future(
        serve(
            "envs",
            0,
            list(add_servicers),
            host="127.0.0.1",
            grace_s=1.0,
            stop=stop,
            ready=bound.set_result,
            on_shutdown=on_shutdown,
        )
    )
    port = await asyncio.wait_for(asyncio.shield(bound), 10)
    try:
        yield f"127.0.0.1:{port}"
    finally:
        stop.set()
        await asyncio.wait_for(task, 10)
