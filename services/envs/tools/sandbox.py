"""The python toolset's sandbox: the model's code in a new, isolated and limited process per call.

A call runs `<interpreter> -I -S -` (isolated mode, no site-packages) with the code on its stdin, in a new process
group. Where it runs (`isolation`):
- `bwrap` (default): bubblewrap gives it new user, mount, PID, network, IPC, UTS and cgroup namespaces. The network
  is a loopback interface, down. The filesystem is an empty read-only root holding /usr, the interpreter's prefix
  and the /bin, /lib* links read-only, /proc of the new PID namespace, a read-only minimal /dev, a private /tmp
  (tmpfs of `tmp_mb`) and the episode's workspace, read-write, at /workspace, the working directory: the host's
  /etc, /root, /home, /work and the service's own files are not there. The sandbox dies with the service.
- `unshare`: the same namespaces and filesystem, set up by util-linux's `unshare` and a mount script, with every
  capability dropped (`setpriv`) before the code runs; for hosts without bubblewrap.
- `none`: NOT a sandbox. The limits only: the code sees the host's files and network. For development.
The tool a choice needs is checked, and a `print` run in the sandbox, by `start`: a RuntimeError names what is
missing (its Debian package) or what the sandbox said.

Limits: `prlimit` sets, for the interpreter and what it starts, RLIMIT_CPU (SIGXCPU at `cpu_s`, SIGKILL a second
later), RLIMIT_AS (`memory_mb`), RLIMIT_NPROC (`processes`), RLIMIT_FSIZE (`file_size_mb`) and no core files. The
service enforces the wall clock, min(`wall_s`, the call's time left), by killing the process group: with the PID
namespace that is everything the code started. Output is read as it comes: the first and last `output_chars` bytes
of each stream are kept, and past `_FLOOD_FACTOR` times `output_chars` the process is killed, so printing gigabytes
costs a bounded amount of memory and time. RLIMIT_NPROC counts the processes of one uid in one user namespace, and
the kernel never applies it to the host's uid 0: a service running as root starts the sandbox as `sandbox_uid` and
hands the workspace tree over to that uid before each call (chown, never following a symlink); the workspace's parent
folders must then let that uid through (the service's /tmp/omrl-ws-* do).

The answer: `ToolOutput` whose first line is "exit code N" or "killed by SIGNAME", then a "limit: ..." line where a
limit was hit, then the "--- stdout ---" and "--- stderr ---" sections that are not empty, together at most
`output_chars` characters (a cut is marked in place); error=True for anything but exit code 0. A memory, file-size or
process limit is read off the interpreter's last line of stderr (MemoryError, EFBIG, a failed fork: Python raises
rather than dies), a CPU limit off the signal. A wall-clock timeout raises ToolError kind "timeout" carrying the
output so far. `limits_hit` counts the calls that hit each limit (cpu, memory, processes, file_size, output, wall),
for the service's metrics."""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import signal
import stat
import subprocess
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import Field

from services.common import trust
from services.envs.tools.base import ToolError, ToolOptions

WORKDIR = "/workspace"
_FLOOD_FACTOR = 16
_DRAIN_S = 1.0
"""How long the output pipes may stay open after the sandbox ended (a process that escaped the group in `none`)."""
_REAP_S = 5.0
"""How long a killed sandbox may take to be gone before the call answers without it."""
_READ_CHUNK = 65536
_LIB_LINKS = ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
_ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": WORKDIR, "TMPDIR": "/tmp"}
_PACKAGES = {
    "bwrap": "bubblewrap",
    "unshare": "util-linux",
    "prlimit": "util-linux",
    "setpriv": "util-linux",
    "mount": "mount",
    "chroot": "coreutils",
}
_NEEDS = {
    "bwrap": ("bwrap", "setpriv", "prlimit"),
    "unshare": ("unshare", "setpriv", "mount", "chroot", "prlimit"),
    "none": ("setpriv", "prlimit"),
}

# Runs as root of the new user namespace (uid 0 there is `sandbox_uid` or the service's uid on the host): builds the
# root on a tmpfs over /tmp, which only this mount namespace sees (the workspace is opened as fd 3 first, since the
# tmpfs hides its path), makes it read-only, and starts the code under it without capabilities. The shell stays PID 1
# of the namespace: the interpreter, not being PID 1, gets SIGXCPU like any process.
_UNSHARE_INIT = r"""set -eu
workspace=$1; tmp_bytes=$2; shift 2
exec 3<"$workspace"
mount -t tmpfs -o mode=0755,size=1m sandbox /tmp
cd /tmp
mkdir proc dev tmp workspace
for dir in "$@"; do
  [ "$dir" = -- ] && break
  if [ -L "$dir" ]; then ln -s "$(readlink "$dir")" ".$dir"
  else mkdir -p ".$dir" && mount --bind -o ro "$dir" ".$dir"; fi
done
while [ "$1" != -- ]; do shift; done; shift
mount -t proc -o nosuid,nodev,noexec proc proc
for dev in null zero full random urandom; do touch "dev/$dev"; mount --bind "/dev/$dev" "dev/$dev"; done
mount -t tmpfs -o "mode=1777,size=$tmp_bytes,nosuid,nodev" tmp tmp
mount --no-canonicalize --bind /proc/self/fd/3 workspace
exec 3<&-
mount -o remount,ro,bind /tmp
/usr/sbin/chroot /tmp /usr/bin/setpriv --bounding-set=-all --inh-caps=-all --ambient-caps=-all --no-new-privs \
  -- /usr/bin/env -C /workspace "$@"
"""


class PythonOptions(ToolOptions):
    isolation: Literal["bwrap", "unshare", "none"] = Field("bwrap", json_schema_extra=trust.OPERATOR)
    """bwrap: bubblewrap namespaces; unshare: util-linux's, where bubblewrap is missing; none: limits only, NOT a
    sandbox (development)."""
    interpreter: str | None = Field(None, json_schema_extra=trust.OPERATOR)
    """The Python that runs the code; None: /usr/bin/python3, else the python3 on PATH. Its real file is used, so
    never a virtualenv's; its prefix is mounted read-only in the sandbox."""
    cpu_s: int = Field(2, ge=1, le=600)
    """CPU seconds (RLIMIT_CPU) of each process of the call."""
    memory_mb: int = Field(256, ge=32, le=65536)
    """Address space of each process (RLIMIT_AS)."""
    processes: int = Field(16, ge=1, le=4096)
    """Processes of the sandbox at once (RLIMIT_NPROC); with isolation none, of the uid it runs as."""
    file_size_mb: int = Field(8, ge=1, le=16384)
    """The largest file the code writes (RLIMIT_FSIZE)."""
    tmp_mb: int = Field(16, ge=1, le=16384)
    """Size of the sandbox's private /tmp (a tmpfs, in the host's memory)."""
    wall_s: float = Field(5.0, gt=0, le=3600)
    """Wall-clock seconds of a call (never more than the call's time left); then the sandbox is killed."""
    output_chars: int = Field(4000, ge=100, le=1_000_000)
    """Characters of stdout and stderr together in the answer; the rest is cut, marked in place."""
    max_concurrent: int = Field(8, ge=1, le=1024)
    """Sandboxes running at once; further calls wait for a slot."""
    sandbox_uid: int = Field(65534, ge=1, json_schema_extra=trust.OPERATOR)
    """The uid (and gid) the sandbox runs as when the service runs as root (root is exempt from RLIMIT_NPROC)."""
    endpoint: str | None = Field(None, json_schema_extra=trust.URL)
    """URL of a sandbox server (python -m services.envs.sandbox_server) to run the code on instead of here."""
    token_env: str = Field("OMRL_SANDBOX_TOKEN", json_schema_extra=trust.OPERATOR)
    """The environment variable holding the sandbox server's bearer token (with `endpoint`)."""
    remote_timeout_s: float = Field(30.0, gt=0)
    """Seconds on top of the wall clock a call to the sandbox server may take (queueing, the network)."""


@dataclass
class RunResult:
    """One run's outcome; `stdout`/`stderr` are already cut to the output budget."""

    exit_code: int | None
    """None where the process was killed by a signal (`signal`)."""
    signal: str | None
    limit: str | None
    """cpu, memory, processes, file_size, output (cut or flooded), wall, or None."""
    stdout: str
    stderr: str
    seconds: float
    limit_line: str = ""
    """What the model reads about the limit, e.g. "limit: CPU time 2 s"."""

    def as_json(self) -> dict[str, Any]:
        return asdict(self)


class _Capture:
    """One stream's first `keep` bytes, its last `keep` to 2*`keep` bytes, and how many it carried."""

    def __init__(self, keep: int):
        self.keep = keep
        self.head = bytearray()
        self.tail = bytearray()
        self.total = 0

    def feed(self, chunk: bytes) -> None:
        self.total += len(chunk)
        room = self.keep - len(self.head)
        if room > 0:
            self.head += chunk[:room]
            chunk = chunk[room:]
        self.tail += chunk
        if len(self.tail) > 2 * self.keep:
            del self.tail[: -self.keep]

    def text(self, budget: int) -> str:
        """At most `budget` bytes' worth of characters: all of it, or its start and end with the cut marked."""
        data = bytes(self.head + self.tail)
        if self.total <= budget:
            return data.decode(errors="replace")
        half = budget // 2
        head, tail = data[:half], data[len(data) - (budget - half) :]
        cut = self.total - len(head) - len(tail)
        return f"{head.decode(errors='replace')}\n[... {cut} bytes cut ...]\n{tail.decode(errors='replace')}"


def _budgets(out: int, err: int, cap: int) -> tuple[int, int]:
    """Characters for stdout and stderr: each its half of `cap`, and what one leaves the other."""
    if out + err <= cap:
        return out, err
    err_budget = min(err, max(cap // 2, cap - out))
    return min(out, cap - err_budget), err_budget


_EXCEPTION_LINE = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception)\b")


def _stderr_limit(stderr: str) -> str | None:
    """The limit the interpreter's last words name: Python raises (and exits 1) where a limit refuses it memory, a
    file's growth (SIGXFSZ is ignored by Python) or a fork."""
    lines = [line for line in stderr.splitlines() if line.strip()]
    # the last exception line, not the last line: a fork bomb's processes die together, their tracebacks interleaved
    last = next((line for line in reversed(lines) if _EXCEPTION_LINE.match(line)), lines[-1] if lines else "")
    if last.startswith("MemoryError") or "[Errno 12] Cannot allocate memory" in last:
        return "memory"
    if "[Errno 27] File too large" in last:
        return "file_size"
    if last.startswith("BlockingIOError: [Errno 11]"):
        return "processes"
    return None


def _limit_line(limit: str | None, o: PythonOptions, printed: int) -> str:
    lines = {
        "cpu": f"limit: CPU time {o.cpu_s} s, killed",
        "memory": f"limit: memory {o.memory_mb} MB (MemoryError)",
        "file_size": f"limit: file size {o.file_size_mb} MB",
        "processes": f"limit: {o.processes} processes (a fork failed)",
        "output": f"limit: output {o.output_chars} characters, {printed} bytes printed, cut",
    }
    return lines.get(limit or "", "")


def _hand_over(workspace: Path, uid: int, gid: int) -> None:
    """Gives the workspace tree to the sandbox's uid. fwalk checks every folder it enters is the one it listed and
    chown never follows a link, so code swapping in symlinks cannot redirect it outside the workspace."""
    for _, dirs, files, dir_fd in os.fwalk(workspace, follow_symlinks=False):
        if os.fstat(dir_fd).st_uid != uid:
            os.chown(dir_fd, uid, gid)
        for name in (*dirs, *files):
            try:
                os.chown(name, uid, gid, dir_fd=dir_fd, follow_symlinks=False)
            except FileNotFoundError:
                pass


def _reachable(workspace: Path, uid: int, gid: int) -> str | None:
    """The first parent folder of the workspace the uid cannot pass through, or None."""
    for folder in reversed(workspace.resolve().parents):
        st = folder.stat()
        if st.st_uid == uid:
            ok = st.st_mode & stat.S_IXUSR
        elif st.st_gid == gid:
            ok = st.st_mode & stat.S_IXGRP
        else:
            ok = st.st_mode & stat.S_IXOTH
        if not ok:
            return f"{folder} (mode {stat.filemode(st.st_mode)}, owner {st.st_uid})"
    return None


class Sandbox:
    """The local sandbox: builds the command of the chosen isolation and runs code with the limits (see the module
    docstring). Shared by the toolset and the sandbox server."""

    def __init__(self, options: PythonOptions):
        self.options = options
        self.slots = asyncio.Semaphore(options.max_concurrent)
        self.as_root = os.geteuid() == 0
        self.interpreter = ""
        self.mounts: list[str] = []

    async def start(self) -> None:
        o = self.options
        missing = [tool for tool in _NEEDS[o.isolation] if shutil.which(tool) is None]
        if missing:
            packages = " ".join(sorted({_PACKAGES[tool] for tool in missing}))
            raise RuntimeError(
                f"isolation {o.isolation!r} needs {', '.join(missing)}: install the Debian package(s) {packages} "
                f"(apt-get install {packages})"
            )
        self.interpreter, prefix = await asyncio.to_thread(_interpreter, o.interpreter)
        self.mounts = ["/usr", *(p for p in _LIB_LINKS if os.path.lexists(p))]
        for extra in (prefix, str(Path(self.interpreter).parent)):
            if not any(extra == m or extra.startswith(m + "/") for m in self.mounts):
                self.mounts.append(extra)
        workspace = Path(tempfile.mkdtemp(prefix="omrl-sandbox-check-"))
        try:
            result = await self.run('print("ok")', workspace, timeout=max(o.wall_s, 10.0))
        finally:
            shutil.rmtree(workspace, ignore_errors=True)
        if result.exit_code != 0 or result.stdout.strip() != "ok":
            said = (result.stderr or result.stdout).strip()[-1000:]
            raise RuntimeError(f"the {o.isolation} sandbox does not run: {said or result.limit_line or 'no output'}")

    def command(self, workspace: Path) -> list[str]:
        o = self.options
        limits = [
            "prlimit",
            f"--cpu={o.cpu_s}:{o.cpu_s + 1}",
            f"--as={o.memory_mb << 20}",
            f"--nproc={o.processes}",
            f"--fsize={o.file_size_mb << 20}",
            "--core=0",
            "--",
            self.interpreter,
            "-I",
            "-S",
            "-",
        ]
        # setpriv: the sandbox dies with the service, and runs as `sandbox_uid` where the service is root (rather than
        # Popen's user=, which uvloop does not take)
        start = ["setpriv", "--pdeathsig", "KILL"]
        if self.as_root:
            start += ["--reuid", str(o.sandbox_uid), "--regid", str(o.sandbox_uid), "--clear-groups"]
        start.append("--")
        if o.isolation == "none":
            return [*start, *limits]
        if o.isolation == "unshare":
            return [
                *start,
                "unshare",
                "--user",
                "--map-root-user",
                "--net",
                "--pid",
                "--ipc",
                "--uts",
                "--mount",
                "--propagation",
                "private",
                "--fork",
                "--kill-child",
                "--",
                "/bin/sh",
                "-c",
                _UNSHARE_INIT,
                "sandbox-init",
                str(workspace),
                str(o.tmp_mb << 20),
                *self.mounts,
                "--",
                *limits,
            ]
        binds: list[str] = []
        for path in self.mounts:
            if os.path.islink(path):
                binds += ["--symlink", os.readlink(path), path]
            else:
                binds += ["--ro-bind", path, path]
        return [
            *start,
            "bwrap",
            "--unshare-all",
            "--unshare-user",
            "--disable-userns",
            "--die-with-parent",
            "--new-session",
            "--hostname",
            "sandbox",
            *binds,
            "--proc",
            "/proc",
            "--dev",
            "/dev",
            "--remount-ro",
            "/dev",
            "--size",
            str(o.tmp_mb << 20),
            "--tmpfs",
            "/tmp",
            "--bind",
            str(workspace),
            WORKDIR,
            "--remount-ro",
            "/",
            "--chdir",
            WORKDIR,
            "--clearenv",
            *(arg for key, value in _ENV.items() for arg in ("--setenv", key, value)),
            "--",
            *limits,
        ]

    async def run(self, code: str, workspace: Path, timeout: float) -> RunResult:
        """Runs `code` with `workspace` as its working directory for at most `timeout` seconds (wall clock), the
        wait for a free slot included."""
        o = self.options
        deadline = time.monotonic() + timeout
        if self.as_root:
            blocked = await asyncio.to_thread(_reachable, workspace, o.sandbox_uid, o.sandbox_uid)
            if blocked is not None:
                raise ToolError(
                    f"the sandbox's uid {o.sandbox_uid} cannot reach the workspace: {blocked}",
                    "unavailable",
                )
        try:
            await asyncio.wait_for(self.slots.acquire(), max(0.0, deadline - time.monotonic()))
        except asyncio.TimeoutError:
            return RunResult(None, None, "wall", "", "", timeout, f"no sandbox was free within {timeout:g} s")
        try:
            if self.as_root:
                await asyncio.to_thread(_hand_over, workspace, o.sandbox_uid, o.sandbox_uid)
            return await self._run(code, workspace, deadline - time.monotonic())
        finally:
            self.slots.release()

    async def _run(self, code: str, workspace: Path, timeout: float) -> RunResult:
        o = self.options
        start = time.monotonic()
        env = {**_ENV, "HOME": str(workspace), "TMPDIR": str(workspace)} if o.isolation == "none" else dict(_ENV)
        # stdout and stderr on pipes of our own: asyncio's would hold `wait()` until every writer closed them, which
        # a process escaping the group (isolation none) may never do
        pipes = [os.pipe(), os.pipe()]
        try:
            proc = await asyncio.create_subprocess_exec(
                *self.command(workspace),
                stdin=subprocess.PIPE,
                stdout=pipes[0][1],
                stderr=pipes[1][1],
                cwd=str(workspace) if o.isolation == "none" else "/",
                env=env,
                start_new_session=True,
            )
        except BaseException:
            for read_end, _ in pipes:
                os.close(read_end)
            raise
        finally:
            for _, write_end in pipes:
                os.close(write_end)
        out, err = _Capture(o.output_chars), _Capture(o.output_chars)
        flooded = False

        def kill() -> None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass

        async def pump(file: Any, capture: _Capture) -> None:
            nonlocal flooded
            reader = asyncio.StreamReader()
            loop = asyncio.get_running_loop()
            try:
                transport, _ = await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), file)
            except BaseException:
                file.close()
                raise
            try:
                # reading on once flooded: the process dies of the kill, and the pipe's EOF comes only to a reader
                while chunk := await reader.read(_READ_CHUNK):
                    capture.feed(chunk)
                    if not flooded and out.total + err.total > _FLOOD_FACTOR * o.output_chars:
                        flooded = True
                        kill()
            finally:
                transport.close()

        async def feed() -> None:
            try:
                proc.stdin.write(code.encode())
                await proc.stdin.drain()
            except (BrokenPipeError, ConnectionResetError):
                pass
            finally:
                proc.stdin.close()

        files = [open(fd, "rb", buffering=0) for fd, _ in pipes]  # noqa: SIM115 - the read transports close them
        pumps = [asyncio.create_task(pump(file, capture)) for file, capture in zip(files, (out, err))]
        tasks = [asyncio.create_task(feed()), *pumps]
        timed_out = False
        try:
            try:
                await asyncio.wait_for(proc.wait(), max(0.0, timeout))
            except asyncio.TimeoutError:
                timed_out = True
            if timed_out or o.isolation == "none":
                # a timeout's whole group; in `none`, whatever the code left behind in it
                kill()
            await asyncio.wait([asyncio.ensure_future(proc.wait())], timeout=_REAP_S)
            await asyncio.wait(pumps, timeout=_DRAIN_S)
        finally:
            if proc.returncode is None:
                kill()
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        rc = proc.returncode if proc.returncode is not None else -signal.SIGKILL
        return self._result(rc, out, err, timed_out, flooded, time.monotonic() - start, timeout)

    def _result(
        self, rc: int, out: _Capture, err: _Capture, timed_out: bool, flooded: bool, seconds: float, timeout: float
    ) -> RunResult:
        o = self.options
        # bwrap and unshare's shell report a signal's death as the exit code 128 + the signal
        sig = -rc if rc < 0 else rc - 128 if rc > 128 and o.isolation != "none" else None
        out_budget, err_budget = _budgets(out.total, err.total, o.output_chars)
        stdout, stderr = out.text(out_budget), err.text(err_budget)
        if timed_out:
            limit, line = "wall", f"timed out: killed after the wall-clock limit of {timeout:.3g} s"
        else:
            if flooded:
                limit = "output"
            elif sig == signal.SIGXCPU:
                limit = "cpu"
            elif sig == signal.SIGXFSZ:
                limit = "file_size"
            elif rc != 0:
                limit = _stderr_limit(err.text(o.output_chars))
            else:
                limit = None
            if limit is None and out.total + err.total > o.output_chars:
                limit = "output"
            line = _limit_line(limit, o, out.total + err.total)
        return RunResult(None if sig else rc, _signal_name(sig), limit, stdout, stderr, seconds, line)


def _signal_name(sig: int | None) -> str | None:
    if sig is None:
        return None
    try:
        return signal.Signals(sig).name
    except ValueError:
        return f"signal {sig}"


def _interpreter(chosen: str | None) -> tuple[str, str]:
    """The interpreter's real file and its prefix; a virtualenv's interpreter is refused."""
    path = chosen or ("/usr/bin/python3" if os.path.exists("/usr/bin/python3") else shutil.which("python3"))
    found = shutil.which(path) if path else None
    if found is None:
        raise RuntimeError(f"no Python interpreter {path or 'python3'!r} for the python toolset (option interpreter)")
    real = os.path.realpath(found)
    probe = subprocess.run(
        [real, "-I", "-S", "-c", "import sys; print(sys.prefix); print(sys.base_prefix)"],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    prefix, base = probe.stdout.split()
    if prefix != base:
        raise RuntimeError(f"{real} is a virtualenv's interpreter; name its base Python (option interpreter)")
    return real, os.path.realpath(base)


def render(result: RunResult) -> str:
    """The model's view of a run (see the module docstring); a timeout's starts with its limit line."""
    status = f"killed by {result.signal}" if result.signal else f"exit code {result.exit_code}"
    lines = [] if result.limit == "wall" else [status]
    if result.limit_line:
        lines.append(result.limit_line)
    for name, text in (("stdout", result.stdout), ("stderr", result.stderr)):
        if text:
            lines += [f"--- {name} ---", text.rstrip("\n")]
    return "\n".join(lines)
