"""The `python` toolset: runs the model's code in the sandbox (services/envs/tools/sandbox.py: what it isolates and
limits, and the answer's form), a new process per call.

At most `max_concurrent` sandboxes run at once; a call waits for a slot within its time left. With `endpoint` set,
calls go to a sandbox server (services/envs/sandbox_server.py) instead, with the bearer token read from the
environment variable `token_env`; the server runs this same sandbox and keeps one workspace per episode id."""

from __future__ import annotations

import asyncio
import os
from collections import Counter
from typing import Any

from services.envs.tools.base import TOOLSETS, ToolContext, ToolError, ToolOutput, Toolset, ToolSpec
from services.envs.tools.sandbox import PythonOptions, RunResult, Sandbox, render


@TOOLSETS.register("python")
class Python(Toolset):
    type = "python"
    Options = PythonOptions

    @classmethod
    def capacity_of(cls, options: PythonOptions) -> int:
        return options.max_concurrent

    def __init__(self, options: PythonOptions):
        super().__init__(options)
        self.options: PythonOptions = options
        self.capacity = self.capacity_of(options)
        self.limits_hit: Counter[str] = Counter()
        """Calls that hit each limit (cpu, memory, processes, file_size, output, wall), for the service's metrics."""
        self.sandbox = Sandbox(options) if options.endpoint is None else None
        self._client = None
        self._remote_slots = asyncio.Semaphore(options.max_concurrent)

    async def start(self) -> None:
        if self.sandbox is not None:
            await self.sandbox.start()
            return
        import httpx

        token = os.environ.get(self.options.token_env)
        if not token:
            raise RuntimeError(f"the sandbox server's token: set the environment variable {self.options.token_env}")
        self._client = httpx.AsyncClient(
            base_url=self.options.endpoint, headers={"Authorization": f"Bearer {token}"}, timeout=None
        )
        try:
            (await self._client.get("/healthz", timeout=10)).raise_for_status()
        except httpx.HTTPError as exc:
            raise RuntimeError(f"the sandbox server {self.options.endpoint} is not healthy: {exc}") from None

    def specs(self) -> list[ToolSpec]:
        o = self.options
        return [
            ToolSpec(
                name="python",
                description=(
                    "Runs a Python 3 program (standard library only) in a fresh sandboxed process and returns its "
                    "exit code, stdout and stderr; print what you need to see. The working directory is your "
                    f"workspace, whose files persist between calls; there is no network. Limits: {o.wall_s:g} s, "
                    f"{o.cpu_s} s of CPU, {o.memory_mb} MB of memory, output cut to {o.output_chars} characters."
                ),
                parameters={
                    "type": "object",
                    "properties": {"code": {"type": "string", "description": "The program's source."}},
                    "required": ["code"],
                    "additionalProperties": False,
                },
            )
        ]

    async def call(self, name: str, arguments: dict[str, Any], ctx: ToolContext) -> ToolOutput:
        timeout = min(self.options.wall_s, ctx.time_left)
        if timeout <= 0:
            raise ToolError("no time left to run the code", "timeout")
        if self.sandbox is not None:
            if not ctx.workspace.is_dir():
                raise ToolError("the episode's workspace is gone", "unavailable")
            result = await self.sandbox.run(arguments["code"], ctx.workspace, timeout)
        else:
            result = await self._remote(arguments["code"], ctx.episode_id, timeout)
        if result.limit is not None:
            self.limits_hit[result.limit] += 1
        if result.limit == "wall":
            raise ToolError(render(result), "timeout")
        return ToolOutput(render(result), error=result.exit_code != 0)

    async def _remote(self, code: str, episode_id: str, timeout: float) -> RunResult:
        import httpx

        limit = timeout + self.options.remote_timeout_s
        try:
            async with self._remote_slots:
                response = await self._client.post(
                    "/run", json={"code": code, "episode_id": episode_id, "timeout": timeout}, timeout=limit
                )
        except httpx.TimeoutException:
            raise ToolError(f"the sandbox server did not answer within {limit:g} s", "timeout") from None
        except httpx.HTTPError as exc:
            raise ToolError(f"the sandbox server is unreachable: {type(exc).__name__}", "unavailable") from None
        if response.status_code == 503 and "kind" in (body := _json(response)):
            raise ToolError(str(body.get("detail", "")), str(body["kind"]))
        if response.status_code != 200:
            kind = "unavailable" if response.status_code in (401, 403, 429) or response.status_code >= 500 else "failed"
            raise ToolError(f"the sandbox server answered {response.status_code}: {response.text[:300]}", kind)
        return RunResult(**response.json())

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client.aclose()


def _json(response: Any) -> dict[str, Any]:
    try:
        body = response.json()
    except ValueError:
        return {}
    return body if isinstance(body, dict) else {}
