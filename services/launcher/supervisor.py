"""python -m services.launcher.supervisor: the supervisor process of one local job.

It runs the job with LocalRun, turns SIGTERM (cancel) and SIGALRM (`--max-runtime-s`) into a clean stop
of every service, and keeps `status.json` in the run directory current, so that the job API can follow
the job from outside, also after the API itself restarted."""

from __future__ import annotations

import argparse
import signal
import sys
from pathlib import Path
from typing import Any

from services.common.config import TrainConfig, load_config
from services.common.logs import setup_logging
from services.launcher.job_files import EXITED, PREPARING, RUNNING, STARTING, StatusFile
from services.launcher.local import LocalRun
from services.launcher.report import DETAIL_MARK, SupervisorView, failure_summary
from services.launcher.restarts import MAX_RESTARTS, RESTART_DELAY_S, add_restart_flags


class Stop(SystemExit):
    """Raised from a signal handler. A SystemExit, so that neither an `except Exception` nor asyncio swallows it:
    asyncio's callback runner and task steps re-raise only SystemExit and KeyboardInterrupt, and log any other
    BaseException. A cancel that landed in the start-up's health wait was lost that way (and, the handler having
    ignored further signals, the job ran on until the launcher's SIGKILL)."""

    def __init__(self, state: str, error: str | None = None):
        super().__init__(state)
        self.state, self.error = state, error


class SupervisedRun(LocalRun):
    def __init__(self, config: TrainConfig, status: StatusFile, **kwargs: Any):
        super().__init__(config, **kwargs)
        self.status = status

    def prepare_model(self) -> None:
        self.status.write(phase=PREPARING)
        super().prepare_model()
        self.status.write(phase=STARTING)

    def start(self) -> None:
        super().start()
        self.status.write(phase=RUNNING)


def _install_stop_handlers(max_runtime_s: int | None) -> None:
    def stop(state: str, error: str | None):
        def handler(*_):
            # a second signal must not interrupt the clean stop of the services
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            signal.signal(signal.SIGALRM, signal.SIG_IGN)
            raise Stop(state, error)

        return handler

    signal.signal(signal.SIGTERM, stop("cancelled", None))
    if max_runtime_s:
        signal.signal(signal.SIGALRM, stop("failed", f"max_runtime_s ({max_runtime_s}s) exceeded"))
        signal.alarm(max_runtime_s)


def supervise(
    config: TrainConfig,
    status_path: Path,
    max_runtime_s: int | None = None,
    max_restarts: int = MAX_RESTARTS,
    restart_delay_s: float = RESTART_DELAY_S,
) -> int:
    status = StatusFile(status_path)
    status.write(phase=PREPARING, state=None)
    _install_stop_handlers(max_runtime_s)

    def say(line: str) -> None:
        print(line, flush=True)

    run = SupervisedRun(
        config,
        status,
        say=say,
        view=SupervisorView(say),
        restart_delay_s=restart_delay_s,
        max_restarts=max_restarts,
    )
    try:
        result = run.run()
    except Stop as stop:
        run.stop()  # idempotent; covers a signal that landed inside run()'s own clean-up
        status.write(phase=EXITED, state=stop.state, error=stop.error)
        return 0 if stop.state == "cancelled" else 1
    except Exception as exc:  # the job failed: one line where the API reads it, the detail in the log only
        status.write(phase=EXITED, state="failed", error=failure_summary(exc))
        for line in f"{type(exc).__name__}: {exc}".splitlines():
            print(DETAIL_MARK + line, flush=True)
        return 1
    status.write(phase=EXITED, state="succeeded", error=None, steps=len(result.history), summary=result.summary)
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m services.launcher.supervisor", description=__doc__)
    parser.add_argument("--config", required=True, help="the job's run config (TrainConfig YAML)")
    parser.add_argument("--status", required=True, help="status file to keep current")
    parser.add_argument("--max-runtime-s", type=int, default=None, help="stop and fail the job after this long")
    add_restart_flags(parser)
    args = parser.parse_args()
    setup_logging("supervisor")
    return supervise(
        load_config(args.config), Path(args.status), args.max_runtime_s, args.max_restarts, args.restart_delay_s
    )


if __name__ == "__main__":
    sys.exit(main())
