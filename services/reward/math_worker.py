"""math-verify in a child process of its own, one check at a time, each bounded in time.

math-verify bounds its own work with SIGALRM, which only a process's main thread may use, and reward functions run
in the service's worker threads: so the checks run in a child (`python -m services.reward.math_worker`, JSON lines
on its stdin and stdout) with math-verify's timeouts off, and a check that outlives `timeout_s` kills the child; the
next check starts a fresh one (about a second: the child imports sympy)."""

from __future__ import annotations

import json
import logging
import os
import select
import subprocess
import sys
import threading
from pathlib import Path

MISSING = (
    'the math_equiv reward needs the `math-verify` package: pip install -e ".[reward]" (scripts/setup.sh installs it)'
)
START_TIMEOUT_S = 120.0
COMMAND = (sys.executable, "-m", "services.reward.math_worker")
_ROOT = str(Path(__file__).resolve().parents[2])  # where `services` is importable from, installed or not


def equal(answer: str, references: list[str]) -> bool:
    """math-verify's verdict, asked as verl's math_verify score asks it: each reference boxed, the answer as written
    (its last boxed or plain expression counts)."""
    from math_verify import parse, verify

    parsed = parse(answer, parsing_timeout=None)
    return any(
        verify(parse(f"\\boxed{{{ref}}}", parsing_timeout=None), parsed, timeout_seconds=None) for ref in references
    )


def main() -> None:
    """The child: a ready line, then one verdict line per request line, until its stdin closes."""
    logging.getLogger("math_verify").setLevel(logging.ERROR)  # its "timeout is disabled" warning: bounded here
    try:
        import math_verify  # noqa: F401
    except ImportError:
        reply = {"error": MISSING}
    else:
        reply = {"ready": True}
    print(json.dumps(reply), flush=True)
    for line in sys.stdin if "ready" in reply else ():
        request = json.loads(line)
        try:
            reply = {"equal": equal(request["answer"], request["references"])}
        except Exception as exc:  # noqa: BLE001 - reported to the caller, who fails its batch
            reply = {"error": f"{type(exc).__name__}: {exc}"}
        print(json.dumps(reply), flush=True)


class MathVerifier:
    def __init__(self, timeout_s: float, command: tuple[str, ...] = COMMAND):
        """`command`: the child's command line (tests give a stand-in)."""
        self.timeout_s, self.command = timeout_s, command
        self._lock = threading.Lock()  # one check at a time in the one child
        self._proc: subprocess.Popen | None = None

    def equal(self, answer: str, references: list[str]) -> bool | None:
        """Whether `answer` equals one of `references`; None when the check ran out of time."""
        with self._lock:
            proc = self._start()
            proc.stdin.write(json.dumps({"answer": answer, "references": references}) + "\n")
            proc.stdin.flush()
            reply = self._reply(self.timeout_s)
        if reply is None:
            return None
        if "equal" not in reply:
            raise RuntimeError(f"math-verify: {reply['error']}")
        return reply["equal"]

    def close(self) -> None:
        with self._lock:
            self._stop()

    def _start(self) -> subprocess.Popen:
        if self._proc is not None and self._proc.poll() is None:
            return self._proc
        self._stop()
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [_ROOT, os.environ.get("PYTHONPATH")]))}
        self._proc = subprocess.Popen(
            self.command,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        reply = self._reply(START_TIMEOUT_S)
        if reply is None or "ready" not in reply:
            raise RuntimeError(f"math-verify's worker did not start: {reply['error'] if reply else 'no answer'}")
        return self._proc

    def _reply(self, timeout_s: float) -> dict | None:
        """The child's next line; None (the child killed) when none comes within `timeout_s`."""
        proc = self._proc
        ready, _, _ = select.select([proc.stdout], [], [], timeout_s)
        line = proc.stdout.readline() if ready else ""
        if not line:  # out of time, or it died (killed, out of memory): the next check starts another
            code = proc.poll()
            self._stop()
            return None if code is None else {"error": f"the worker process exited (code {code})"}
        return json.loads(line)

    def _stop(self) -> None:
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait()
            for pipe in (self._proc.stdin, self._proc.stdout):
                pipe.close()
            self._proc = None


if __name__ == "__main__":
    main()
