"""How a local run restarts a service that exits, as Kubernetes restarts a pod: the bound and the delay
that `python -m services.launcher train` and the job API's local launcher (`OMRL_API_MAX_RESTARTS`,
`OMRL_API_RESTART_DELAY_S`) give LocalRun, and how an exit is told to a person."""

from __future__ import annotations

import argparse
import signal

MAX_RESTARTS = 3
"""Restarts of each service of a run; one more exit fails the run, naming the service and its exit codes."""
RESTART_DELAY_S = 5.0
"""Wait before a service that exited is started again."""
RESTART_STAGES = ("restarting", "restarted")
"""Stages of the events a restart makes (services.launcher.report.stage_record): why it stopped, when it is back."""


def _at_least_zero(kind: type):
    def parse(text: str):
        value = kind(text)
        if value < 0:
            raise argparse.ArgumentTypeError(f"must be 0 or more, got {text}")
        return value

    parse.__name__ = kind.__name__  # argparse names the type in its error
    return parse


def add_restart_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--max-restarts",
        type=_at_least_zero(int),
        default=MAX_RESTARTS,
        help=f"restarts of each service that exits before the run fails (0: none; default {MAX_RESTARTS})",
    )
    parser.add_argument(
        "--restart-delay-s",
        type=_at_least_zero(float),
        default=RESTART_DELAY_S,
        help=f"wait before a service that exited is restarted (default {RESTART_DELAY_S:.0f})",
    )


def exit_reason(code: int | None) -> str:
    """`killed by SIGKILL` for -9, `exit code 1` for 1."""
    if code is not None and code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"
