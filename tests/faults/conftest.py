"""Every drill's outcome goes into scripts/drills.sh's table (OMRL_DRILL_REPORT), beside the figures that
the whole-run drills report themselves (tests/support/drill.py)."""

import os

from tests.support import drill


def pytest_runtest_logreport(report):
    if os.environ.get("PYTEST_XDIST_WORKER"):  # under pytest-xdist the controller gets every report as well
        return
    if report.when == "call" or report.outcome != "passed":
        drill.report(report.nodeid.split("::", 1)[-1], outcome=report.outcome, seconds=round(report.duration, 1))
