"""python -m services.envs.sandbox_server: the python toolset's sandbox behind HTTP, for deployments where the env
service's own pod may not create namespaces (Kubernetes' default seccomp profile); the toolset's `endpoint` option
points at it.

`POST /run` {"code", "episode_id", "timeout"} runs the code in the same local sandbox as the toolset
(services/envs/tools/sandbox.py, `Sandbox`) and answers its `RunResult` as JSON; a call the sandbox refuses answers
503 {"detail", "kind"}. Every request but `GET /healthz` needs `Authorization: Bearer <token>`, the token read from
the environment variable OMRL_SANDBOX_TOKEN (the server does not start without it). The server listens on loopback
unless --host or $OMRL_BIND_HOST says otherwise. Each episode id gets its own workspace folder under --workspace-root
(made passable by every uid), named by a hash of the id so that no id reaches outside it, kept across that episode's
calls and removed once unused for --workspace-ttl-s. A call runs for min(its `timeout`, the sandbox's `wall_s`)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import hmac
import json
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path

from fastapi import Depends, FastAPI, Header, HTTPException, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field

from services.envs.tools.base import ToolError
from services.envs.tools.sandbox import PythonOptions, Sandbox

TOKEN_ENV = "OMRL_SANDBOX_TOKEN"
MAX_CODE_CHARS = 200_000
log = logging.getLogger("sandbox-server")


class RunRequest(BaseModel):
    code: str = Field(max_length=MAX_CODE_CHARS)
    episode_id: str = Field(min_length=1, max_length=200)
    timeout: float = Field(gt=0)


def create_app(options: PythonOptions, token: str, workspace_root: Path, workspace_ttl_s: float = 3600.0) -> FastAPI:
    if not token:
        raise ValueError(f"the sandbox server needs a bearer token (${TOKEN_ENV})")
    if options.endpoint is not None:
        raise ValueError("the sandbox server runs code itself: its options take no endpoint")

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        workspace_root.mkdir(parents=True, exist_ok=True)
        # passable, not listable, by the uid a root server runs the sandbox as
        workspace_root.chmod(workspace_root.stat().st_mode | 0o111)
        app.state.sandbox = Sandbox(options)
        await app.state.sandbox.start()
        sweeper = asyncio.create_task(_sweep(workspace_root, workspace_ttl_s))
        try:
            yield
        finally:
            sweeper.cancel()

    app = FastAPI(title="OpenManus-RL sandbox", lifespan=lifespan)

    def authorized(authorization: str = Header(default="")) -> None:
        scheme, _, given = authorization.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.encode(), token.encode()):
            raise HTTPException(401, "a bearer token is required", headers={"WWW-Authenticate": "Bearer"})

    @app.get("/healthz")
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.post("/run", dependencies=[Depends(authorized)])
    async def run(body: RunRequest, request: Request):
        workspace = workspace_root / hashlib.sha256(body.episode_id.encode()).hexdigest()[:32]
        workspace.mkdir(mode=0o700, exist_ok=True)
        os.utime(workspace)
        timeout = min(body.timeout, options.wall_s)
        try:
            result = await request.app.state.sandbox.run(body.code, workspace, timeout)
        except ToolError as exc:
            return JSONResponse({"detail": str(exc), "kind": exc.kind}, status_code=503)
        return result.as_json()

    return app


async def _sweep(root: Path, ttl_s: float) -> None:
    """Removes the workspaces no call used for `ttl_s` (an episode's end is not told to this server)."""
    while True:
        await asyncio.sleep(min(ttl_s, 60.0))
        cutoff = time.time() - ttl_s
        for folder in root.iterdir():
            with contextlib.suppress(OSError):
                if folder.stat().st_mtime < cutoff:
                    await asyncio.to_thread(shutil.rmtree, folder, True)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m services.envs.sandbox_server", description=__doc__)
    parser.add_argument("--host", default=None, help="bind address (default $OMRL_BIND_HOST, else 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8090)
    parser.add_argument("--options", default="{}", help="the sandbox's options as JSON (the python toolset's)")
    parser.add_argument("--workspace-root", default=None, help="where episodes' workspaces go (default: a temp dir)")
    parser.add_argument("--workspace-ttl-s", type=float, default=3600.0)
    parser.add_argument("--log-level", default="info")
    args = parser.parse_args()
    from services.common.logs import setup_logging

    setup_logging("sandbox-server", args.log_level)
    import uvicorn

    from services.common.grpc_server import bind_host

    token = os.environ.get(TOKEN_ENV, "")
    if not token:
        parser.error(f"set the bearer token in ${TOKEN_ENV}")
    options = PythonOptions.model_validate(json.loads(args.options))
    root = Path(args.workspace_root or tempfile.mkdtemp(prefix="omrl-sandbox-"))
    app = create_app(options, token, root, args.workspace_ttl_s)
    uvicorn.run(app, host=bind_host(args.host), port=args.port, log_level=args.log_level, log_config=None)


if __name__ == "__main__":
    main()
