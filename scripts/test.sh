#!/usr/bin/env bash
# Sets up (scripts/setup.sh), lints (scripts/lint.sh) and runs every test that this machine can run: unit,
# integration, e2e, faults. Prints the 50 slowest tests and writes a JUnit XML report (per-test times) to
# $TEST_REPORT_DIR (default runs/test-report/junit.xml): the CI budget is 25 minutes, see docs/testing.md.
# Tests run on one pytest-xdist worker per core (at most 4; TEST_WORKERS overrides), each module (or class) on one
# worker, in the file order tests/conftest.py sets (longest first); extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
bash scripts/lint.sh
report_dir="${TEST_REPORT_DIR:-runs/test-report}"
mkdir -p "$report_dir"
workers="${TEST_WORKERS:-$(.venv/bin/python -c 'from services.common.cpu_budget import available_cores as c; print(min(4, c().count))')}"
started=$(date +%s)
status=0
.venv/bin/python -m pytest tests -m "not gpu" -q -n "$workers" --dist loadscope --no-loadscope-reorder -p no:randomly --durations=50 --junitxml="$report_dir/junit.xml" "$@" || status=$?
echo "tests took $(($(date +%s) - started)) s (setup and lint before them); JUnit report: $report_dir/junit.xml"
exit $status
