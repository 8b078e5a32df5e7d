"""Hostile code against the python toolset's sandbox (services/envs/tools/sandbox.py), for each isolation that is a
sandbox (bwrap, unshare; one missing on the host is skipped). Every drill runs the toolset itself on a fresh
workspace, no service, and checks that the code is contained within its limit, that the answer is an error
observation (an error ToolOutput, or a ToolError of the right kind), and that an ordinary call made alongside and one
made after still print 2. The limits are small (1 s of CPU, 3 s of wall clock) so the whole file takes seconds."""

from __future__ import annotations

import asyncio
import os
import resource
import shutil
import socket
import tempfile
import time
import uuid
from pathlib import Path

import pytest

from services.envs.tools.base import ToolContext, ToolError, ToolOutput
from services.envs.tools.python import Python
from services.envs.tools.sandbox import _NEEDS, PythonOptions

pytestmark = [pytest.mark.faults]

ROOT = Path(__file__).resolve().parents[2]
WALL_S = 3.0
MARGIN_S = 2.0
"""How much later than its limit a contained call may answer on a loaded machine."""
OUTPUT_CHARS = 1000
NORMAL = ["exit code 0", "--- stdout ---", "2"]


@pytest.fixture(params=["bwrap", "unshare"])
def isolation(request) -> str:
    missing = [tool for tool in _NEEDS[request.param] if shutil.which(tool) is None]
    if missing:
        pytest.skip(f"isolation {request.param} needs {', '.join(missing)} (scripts/setup.sh installs bubblewrap)")
    return request.param


@pytest.fixture
def base():
    """A folder under /tmp, open to every uid (so only the sandbox keeps the code out), holding the workspace."""
    folder = Path(tempfile.mkdtemp(prefix="omrl-drill-"))
    folder.chmod(0o777)
    (folder / "ws").mkdir()
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def toolset(isolation: str, **options) -> Python:
    defaults = {"cpu_s": 1, "wall_s": WALL_S, "output_chars": OUTPUT_CHARS, "processes": 16, "memory_mb": 256}
    return Python(PythonOptions(isolation=isolation, **{**defaults, **options}))


async def call(tool: Python, code: str, workspace: Path, time_left: float = 30.0) -> ToolOutput | ToolError:
    try:
        return await tool.call("python", {"code": code}, ToolContext("drill", workspace, time_left))
    except ToolError as exc:
        return exc


def assert_normal(answer: ToolOutput | ToolError) -> None:
    assert isinstance(answer, ToolOutput) and not answer.error, answer
    assert answer.content.splitlines() == NORMAL


def sandbox_processes(workspace: Path) -> list[int]:
    """Processes of the sandboxes on `workspace`: bwrap (or unshare's shell) names it on its command line and is
    PID 1 of the sandbox's PID namespace, so nothing of a sandbox outlives these."""
    marker = str(workspace).encode()
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                argv = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if marker in argv:
                found.append(int(entry))
    return found


def drill(isolation: str, workspace: Path, code: str, time_left: float = 30.0, **options):
    """Runs `code` beside an ordinary call, then another ordinary call: (the answer, seconds it took, the toolset)."""

    async def run():
        tool = toolset(isolation, **options)
        await tool.start()

        async def timed():
            start = time.monotonic()
            return await call(tool, code, workspace, time_left), time.monotonic() - start

        (answer, seconds), alongside = await asyncio.gather(timed(), call(tool, "print(1+1)", workspace))
        assert_normal(alongside)
        assert_normal(await call(tool, "print(1+1)", workspace))
        return answer, seconds, tool

    answer, seconds, tool = asyncio.run(run())
    deadline = time.monotonic() + 5
    while sandbox_processes(workspace) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert sandbox_processes(workspace) == [], "a sandbox outlived its call"
    return answer, seconds, tool


def test_network_is_unreachable(isolation, base):
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        listener.setblocking(False)
        port = listener.getsockname()[1]
        code = f"""
import socket
errors = []
for address in [("1.1.1.1", 53), ("127.0.0.1", {port})]:
    try:
        socket.create_connection(address, timeout=1).close()
        print("CONNECTED", address)
    except OSError as exc:
        errors.append(exc)
if errors:
    raise errors[0]
"""
        answer, _, _ = drill(isolation, base / "ws", code)
        with pytest.raises(BlockingIOError):
            listener.accept()
    assert isinstance(answer, ToolOutput) and answer.error
    assert "CONNECTED" not in answer.content and "OSError" in answer.content


def test_files_outside_the_workspace_are_not_there(isolation, base):
    secret = base / "secret.txt"
    secret.write_text("the-secret-value")
    secret.chmod(0o644)
    paths = [str(secret), "../secret.txt", "/root", "/etc/shadow", "/etc/passwd", str(ROOT / "pyproject.toml")]
    code = f"""
import os
failed = []
for path in {paths!r}:
    try:
        print("READ", path, os.listdir(path) if os.path.isdir(path) else open(path).read()[:100])
    except OSError as exc:
        failed.append(exc)
if failed:
    raise failed[0]
"""
    answer, _, _ = drill(isolation, base / "ws", code)
    assert isinstance(answer, ToolOutput) and answer.error
    assert "READ" not in answer.content and "the-secret-value" not in answer.content


def test_writes_outside_the_workspace_do_not_land(isolation, base):
    host_tmp = Path(tempfile.gettempdir()) / f"omrl-drill-escape-{uuid.uuid4().hex}"
    paths = [str(base / "escape.txt"), "../escape.txt", "/escape.txt", "/usr/escape.txt", str(host_tmp)]
    code = f"""
failed = []
for path in {paths!r}:
    try:
        open(path, "w").write("escaped")
        print("WROTE", path)
    except OSError as exc:
        failed.append(exc)
if failed:
    raise failed[0]
"""
    answer, _, _ = drill(isolation, base / "ws", code)
    assert isinstance(answer, ToolOutput) and answer.error
    assert not (base / "escape.txt").exists() and not Path("/escape.txt").exists()
    assert not Path("/usr/escape.txt").exists()
    # the sandbox's own /tmp takes the write; the host's does not see it
    assert f"WROTE {host_tmp}" in answer.content and not host_tmp.exists()


@pytest.mark.parametrize("persistent", [False, True], ids=["fork-bomb", "fork-bomb-catching-errors"])
def test_fork_bomb_is_contained(isolation, base, persistent):
    body = "try:\n        os.fork()\n    except OSError:\n        pass" if persistent else "os.fork()"
    answer, seconds, tool = drill(isolation, base / "ws", f"import os\nwhile True:\n    {body}\n")
    assert seconds < WALL_S + MARGIN_S
    if persistent:
        assert isinstance(answer, ToolError) and answer.kind == "timeout"
    else:
        assert isinstance(answer, ToolOutput) and answer.error
        assert "limit: 16 processes" in answer.content and tool.limits_hit["processes"] == 1


def test_unbounded_allocation_hits_the_memory_limit(isolation, base):
    answer, seconds, tool = drill(isolation, base / "ws", "grow = bytearray()\nwhile True:\n    grow += b'x' * 10**6\n")
    assert isinstance(answer, ToolOutput) and answer.error
    assert "limit: memory 256 MB" in answer.content and tool.limits_hit["memory"] == 1
    assert seconds < WALL_S + MARGIN_S


def test_infinite_loop_hits_the_cpu_limit(isolation, base):
    answer, seconds, tool = drill(isolation, base / "ws", "while True:\n    pass\n")
    assert isinstance(answer, ToolOutput) and answer.error
    assert answer.content.startswith("killed by SIGXCPU\nlimit: CPU time 1 s") and tool.limits_hit["cpu"] == 1
    assert seconds < WALL_S + MARGIN_S


def test_sleeping_forever_hits_the_wall_clock_within_the_time_left(isolation, base):
    time_left = 1.5
    answer, seconds, tool = drill(isolation, base / "ws", "import time\ntime.sleep(1000)\n", time_left=time_left)
    assert isinstance(answer, ToolError) and answer.kind == "timeout"
    assert str(answer).startswith("timed out") and tool.limits_hit["wall"] == 1
    assert time_left <= seconds < time_left + MARGIN_S


def test_printing_gigabytes_is_cut_and_stopped(isolation, base):
    peak_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    answer, seconds, tool = drill(isolation, base / "ws", "while True:\n    print('x' * 10**6)\n")
    assert isinstance(answer, ToolOutput) and answer.error
    assert len(answer.content) <= OUTPUT_CHARS + 300
    assert "limit: output" in answer.content and tool.limits_hit["output"] == 1
    assert seconds < WALL_S + MARGIN_S
    # ru_maxrss is in KiB: the parent read at most a few pipe buffers of what was printed
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak_before < 64 * 1024


def test_the_workspace_is_writable_and_persists(isolation, base):
    workspace = base / "ws"
    (workspace / "config.ini").write_text("timeout = 30\n")  # written by the service, as a built-in env does
    code = """
import os
os.makedirs("out", exist_ok=True)
open("out/result.txt", "w").write("written in the sandbox")
open("config.ini", "a").write("retries = 3\\n")
print(os.getcwd(), sorted(os.listdir(".")))
"""

    async def run():
        tool = toolset(isolation)
        await tool.start()
        first = await call(tool, code, workspace)
        second = await call(tool, "print(open('out/result.txt').read())", workspace)
        return first, second

    first, second = asyncio.run(run())
    assert isinstance(first, ToolOutput) and not first.error, first
    assert "/workspace ['config.ini', 'out']" in first.content
    assert (workspace / "out" / "result.txt").read_text() == "written in the sandbox"
    assert (workspace / "config.ini").read_text() == "timeout = 30\nretries = 3\n"
    assert isinstance(second, ToolOutput) and second.content.endswith("written in the sandbox")


def test_sandboxes_run_at_most_max_concurrent_at_once(base):
    if shutil.which("bwrap") is None:
        pytest.skip("needs bwrap")

    async def run():
        tool = toolset("bwrap", max_concurrent=1)
        await tool.start()
        start = time.monotonic()
        code = "import time; time.sleep(0.5); print(1+1)"
        answers = await asyncio.gather(*(call(tool, code, base / "ws") for _ in range(3)))
        return answers, time.monotonic() - start

    answers, seconds = asyncio.run(run())
    for answer in answers:
        assert_normal(answer)
    assert seconds >= 1.5
