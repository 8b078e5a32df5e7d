"""The `mcp` toolset: the tools of one Model Context Protocol server, over stdio or streamable HTTP.

Invariants:
- One live connection at a time, owned by one background task that enters and leaves the SDK's transport and
  `ClientSession` context managers (anyio cancel scopes must be left by the task that entered them); every
  episode's calls run concurrently over that one session, each in its caller's task.
- The tools are those the server listed at `start` (every page), filtered by `include`/`exclude` and named
  `prefix + name` (an `include` naming a tool the server lacks fails `start`); `specs` never changes after `start`.
- A call ends within min(`timeout_s`, the context's `time_left`): the tool's own overrun is `timeout`.
- A lost connection (the server died, refused, or forgot our HTTP session) is replaced, with a short backoff,
  within the call's deadline, and the call is retried once on the new one: a call may thus reach the server
  twice. Time running out while reconnecting, or a second loss, is `unavailable`. The new connection's
  listing decides which tools still exist: a vanished one is `refused`.
- Several calls that lose the connection together reconnect once: the others wait for that attempt, and
  fail at once where it failed.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
from contextlib import AbstractAsyncContextManager, AsyncExitStack
from typing import Any, Literal

import anyio
import httpx2
import mcp.types as mcp_types
from mcp.client.session import ClientSession
from mcp.client.stdio import StdioServerParameters, stdio_client
from mcp.client.streamable_http import MCP_SESSION_ID, streamable_http_client
from mcp.shared.exceptions import MCPError
from pydantic import Field, model_validator

from services.common import trust
from services.envs.tools.base import TOOLSETS, ToolContext, ToolError, ToolOptions, ToolOutput, Toolset, ToolSpec

log = logging.getLogger(__name__)

_MAX_PAGES = 100
"""Pages of tools/list followed: a server whose cursors never end cannot hang a start."""
_BACKOFF_S = (0.1, 0.2, 0.5, 1.0)
"""Pauses between reconnect attempts, the last repeated."""
_SETTLE_S = 0.05
_CLOSE_TIMEOUT_S = 15.0
_SSE_READ_TIMEOUT_S = 300.0
"""The HTTP read timeout (the SDK's default): the server's event stream may be idle that long."""


class McpOptions(ToolOptions):
    transport: Literal["stdio", "http"]
    """stdio: the toolset starts the server itself (`command`); http: it connects to `url`."""
    command: list[str] = Field(default_factory=list, json_schema_extra=trust.OPERATOR)
    """stdio: the server's argv."""
    env: dict[str, str] = Field(default_factory=dict, json_schema_extra=trust.OPERATOR)
    """stdio: environment added to the few variables the SDK passes on (HOME, PATH, ...)."""
    cwd: str | None = Field(None, json_schema_extra=trust.PATH)
    """stdio: the server's working folder."""
    url: str | None = Field(None, json_schema_extra=trust.URL)
    """http: the streamable-HTTP endpoint, e.g. http://host:8000/mcp."""
    headers: dict[str, str] = Field(default_factory=dict)
    """http: sent with every request (an Authorization header, say)."""
    timeout_s: float = Field(30.0, gt=0)
    """The longest one call may take, reconnecting included (less where the episode has less time left)."""
    connect_timeout_s: float = Field(10.0, gt=0)
    """The longest one connection's handshake and tool listing may take."""
    prefix: str = ""
    """Put before each tool's name as the model sees it (to keep names unique across toolsets)."""
    include: list[str] | None = None
    """The server's tools to offer (their names on the server); all where unset."""
    exclude: list[str] = Field(default_factory=list)
    """The server's tools not to offer."""

    @model_validator(mode="after")
    def _transport_fields(self) -> McpOptions:
        if self.transport == "stdio":
            if not self.command:
                raise ValueError("transport stdio needs `command`, the server's argv")
            if self.url is not None or self.headers:
                raise ValueError("`url` and `headers` are for transport http")
        else:
            if not self.url or not self.url.startswith(("http://", "https://")):
                raise ValueError("transport http needs `url`, an http:// or https:// endpoint")
            if self.command or self.env or self.cwd is not None:
                raise ValueError("`command`, `env` and `cwd` are for transport stdio")
        return self


class _Lost(Exception):
    """The connection under a call is gone (not the tool's failure)."""


class _Connection:
    """One session with the server; `task` owns it until `stop` is set or the transport fails."""

    def __init__(self) -> None:
        self.session: ClientSession | None = None
        self.tools: dict[str, mcp_types.Tool] = {}
        self.ready = asyncio.Event()
        self.error: BaseException | None = None
        self.stop = asyncio.Event()
        self.broken = False
        self.expired = False
        """HTTP: the server answered 404 to our session (see `McpToolset._transport`)."""
        self.task: asyncio.Task | None = None

    @property
    def alive(self) -> bool:
        return self.ready.is_set() and self.error is None and not (self.broken or self.expired or self.task.done())


@TOOLSETS.register("mcp")
class McpToolset(Toolset):
    type = "mcp"
    Options = McpOptions

    def __init__(self, options: McpOptions):
        super().__init__(options)
        self.options: McpOptions = options
        self._specs: list[ToolSpec] = []
        self._real: dict[str, str] = {}
        self._conn: _Connection | None = None
        self._owners: dict[asyncio.Task, _Connection] = {}
        self._reconnecting = asyncio.Lock()
        self._failed_reconnects = 0
        self._last_failure = ""
        self._closed = False

    @property
    def _where(self) -> str:
        return self.options.url if self.options.transport == "http" else " ".join(self.options.command)

    async def start(self) -> None:
        try:
            conn = await self._connect(self.options.connect_timeout_s)
        except Exception as exc:
            raise ToolError(f"cannot connect to MCP server {self._where}: {_describe(exc)}", "unavailable") from None
        offered = self.options.include if self.options.include is not None else list(conn.tools)
        missing = [name for name in offered if name not in conn.tools]
        if missing:
            conn.stop.set()
            raise ToolError(f"MCP server {self._where} has no tools {missing}; it has {sorted(conn.tools)}", "refused")
        excluded = set(self.options.exclude)
        self._real = {self.options.prefix + name: name for name in offered if name not in excluded}
        self._specs = [
            ToolSpec(name, conn.tools[real].description or "", conn.tools[real].input_schema)
            for name, real in self._real.items()
        ]
        self._conn = conn

    def specs(self) -> list[ToolSpec]:
        return list(self._specs)

    async def call(self, name: str, arguments: dict[str, Any], ctx: ToolContext) -> ToolOutput:
        real = self._real.get(name)
        if real is None:
            raise ToolError(f"{name!r} is not a tool of this MCP server", "refused")
        budget = min(self.options.timeout_s, ctx.time_left)
        deadline = anyio.current_time() + budget
        conn = self._conn
        if conn is None or not conn.alive:
            conn = await self._reconnect(conn, deadline)
        for attempt in range(2):
            if real not in conn.tools:
                raise ToolError(f"the MCP server no longer offers the tool {name!r}", "refused")
            try:
                return _output(await self._call_on(conn, name, real, arguments, deadline, budget))
            except _Lost as exc:
                conn.broken = True
                if attempt:
                    raise ToolError(f"MCP server {self._where} is unavailable: {exc}", "unavailable") from None
                log.warning("MCP server %s: connection lost during %s (%s); reconnecting", self._where, real, exc)
                conn = await self._reconnect(conn, deadline)
        raise AssertionError("unreachable")

    async def aclose(self) -> None:
        self._closed = True
        for conn in self._owners.values():
            conn.stop.set()
        owners = list(self._owners)
        if owners:
            # the SDK bounds its own shutdown (a stdio server is killed after a few seconds); this is the backstop
            _, stuck = await asyncio.wait(owners, timeout=_CLOSE_TIMEOUT_S)
            for task in stuck:
                task.cancel()
            await asyncio.gather(*owners, return_exceptions=True)

    async def _call_on(
        self, conn: _Connection, name: str, real: str, arguments: dict[str, Any], deadline: float, budget: float
    ) -> mcp_types.CallToolResult:
        try:
            with anyio.fail_after(deadline - anyio.current_time()):
                return await conn.session.call_tool(real, arguments)
        except TimeoutError:
            raise ToolError(f"{name} did not finish within {budget:g}s", "timeout") from None
        except MCPError as exc:
            if exc.error.code == mcp_types.CONNECTION_CLOSED or conn.expired:
                raise _Lost(str(exc)) from None
            raise ToolError(f"{name} failed: {exc}", "failed") from None
        except (anyio.ClosedResourceError, anyio.BrokenResourceError) as exc:
            raise _Lost(type(exc).__name__) from None
        except Exception as exc:  # noqa: BLE001 - a server's malformed answer fails this call, not the toolset
            raise ToolError(f"{name} failed: {type(exc).__name__}: {exc}", "failed") from None

    async def _reconnect(self, lost: _Connection | None, deadline: float) -> _Connection:
        """A live connection in place of `lost`, made here or by a concurrent call; ToolError unavailable where
        none could be made before `deadline`."""
        if self._closed:
            raise ToolError(f"the MCP toolset for {self._where} is closed", "unavailable")
        failed_before = self._failed_reconnects
        try:
            with anyio.fail_after(max(0.0, deadline - anyio.current_time())):
                async with self._reconnecting:
                    if self._conn is not None and self._conn is not lost and self._conn.alive:
                        return self._conn
                    if self._failed_reconnects != failed_before:
                        raise ToolError(self._unavailable(), "unavailable")
                    if lost is not None:
                        lost.broken = True
                        lost.stop.set()
                    return await self._connect_until(deadline)
        except TimeoutError:
            raise ToolError(self._unavailable(), "unavailable") from None

    async def _connect_until(self, deadline: float) -> _Connection:
        # stop a moment early: the caller's own timer, started just before ours, would call the lost server a timeout
        deadline -= _SETTLE_S
        for pause in itertools.chain(_BACKOFF_S, itertools.repeat(_BACKOFF_S[-1])):
            try:
                conn = await self._connect(min(self.options.connect_timeout_s, deadline - anyio.current_time()))
            except Exception as exc:  # noqa: BLE001 - any failure to connect is retried until the deadline
                self._last_failure = _describe(exc)
            else:
                self._conn = conn
                log.info("MCP server %s: reconnected, %d tools", self._where, len(conn.tools))
                return conn
            if anyio.current_time() + pause >= deadline:
                break
            await anyio.sleep(pause)
        self._failed_reconnects += 1
        raise ToolError(self._unavailable(), "unavailable")

    def _unavailable(self) -> str:
        why = f": {self._last_failure}" if self._last_failure else ""
        return f"MCP server {self._where} is unavailable{why}"

    async def _connect(self, timeout: float) -> _Connection:
        conn = _Connection()
        conn.task = asyncio.create_task(self._own(conn, timeout), name=f"mcp {self._where}")
        self._owners[conn.task] = conn
        conn.task.add_done_callback(lambda task: self._owners.pop(task, None))
        try:
            await conn.ready.wait()
        except BaseException:
            # a caller cancelled mid-handshake: the owner must not keep a session nobody will use
            conn.stop.set()
            raise
        if conn.error is not None:
            raise conn.error
        return conn

    async def _own(self, conn: _Connection, timeout: float) -> None:
        try:
            async with AsyncExitStack() as stack:
                read, write = await stack.enter_async_context(await self._transport(stack, conn))
                session = await stack.enter_async_context(ClientSession(read, write))
                try:
                    with anyio.fail_after(timeout):
                        await session.initialize()
                        conn.tools = await _list_tools(session)
                except TimeoutError:
                    raise TimeoutError(f"no answer to the handshake within {timeout:g}s") from None
                conn.session = session
                conn.ready.set()
                await conn.stop.wait()
        except Exception as exc:  # noqa: BLE001 - a failed connection is reported to its callers, not raised here
            if conn.ready.is_set():
                log.warning("MCP server %s: connection ended: %s", self._where, _describe(exc))
            else:
                conn.error = exc
        finally:
            conn.broken = True
            if conn.error is None and conn.session is None:
                conn.error = ConnectionError("the connection closed during its handshake")
            conn.ready.set()

    async def _transport(self, stack: AsyncExitStack, conn: _Connection) -> AbstractAsyncContextManager[Any]:
        options = self.options
        if options.transport == "stdio":
            params = StdioServerParameters(
                command=options.command[0], args=options.command[1:], env=options.env or None, cwd=options.cwd
            )
            return stdio_client(params)

        async def session_expired(response: httpx2.Response) -> None:
            # MCP over HTTP: a 404 to a request naming our session means the server no longer has it (it restarted,
            # say) and we must start a new one; the SDK passes on only the JSON-RPC error, whose text varies
            if response.status_code == 404 and MCP_SESSION_ID in response.request.headers:
                conn.expired = True

        # pool=None: a call waiting for a free connection is bounded by its own deadline, not failed by the pool
        timeout = httpx2.Timeout(options.connect_timeout_s, read=_SSE_READ_TIMEOUT_S, pool=None)
        hooks = {"response": [session_expired]}
        client = httpx2.AsyncClient(headers=options.headers, timeout=timeout, event_hooks=hooks)
        await stack.enter_async_context(client)
        return streamable_http_client(options.url, http_client=client)


async def _list_tools(session: ClientSession) -> dict[str, mcp_types.Tool]:
    tools: dict[str, mcp_types.Tool] = {}
    cursor = None
    for _ in range(_MAX_PAGES):
        params = mcp_types.PaginatedRequestParams(cursor=cursor) if cursor is not None else None
        page = await session.list_tools(params=params)
        tools.update((tool.name, tool) for tool in page.tools)
        cursor = page.next_cursor
        if cursor is None:
            return tools
    log.warning("MCP tools/list still paging after %d pages; using the tools listed so far", _MAX_PAGES)
    return tools


def _output(result: mcp_types.CallToolResult) -> ToolOutput:
    lines = []
    for item in result.content:
        if isinstance(item, mcp_types.TextContent):
            lines.append(item.text)
        elif isinstance(item, mcp_types.ImageContent | mcp_types.AudioContent):
            lines.append(f"[{item.type}: {item.mime_type}]")
        elif isinstance(item, mcp_types.ResourceLink | mcp_types.EmbeddedResource):
            uri = item.uri if isinstance(item, mcp_types.ResourceLink) else item.resource.uri
            lines.append(f"[resource: {uri}]")
        else:
            lines.append(f"[{getattr(item, 'type', type(item).__name__)}]")
    if not any(isinstance(item, mcp_types.TextContent) for item in result.content) and result.structured_content:
        lines.append(json.dumps(result.structured_content, ensure_ascii=False))
    return ToolOutput("\n".join(lines), error=bool(result.is_error))


def _describe(exc: BaseException) -> str:
    """The innermost cause of a failure the SDK's task groups wrapped, as one line."""
    while getattr(exc, "exceptions", None) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
