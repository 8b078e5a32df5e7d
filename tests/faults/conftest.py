"""Every drill's outcome goes into scripts/drills.sh's table (OMRL_DRILL_REPORT), beside the figures that
the whole-run drills report themselves (tests/support/drill.py)."""

from tests.support import drill


def pytest_runtest_logreport(report):
    if report.when == "call" or report.outcome != "passed":
        drill.report(report.nodeid.split("::", 1)[-1], outcome=report.outcome, seconds=round(report.duration, 1))
