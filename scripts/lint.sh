#!/usr/bin/env bash
# Lint and format check with ruff (rules in pyproject.toml, [tool.ruff]); CI runs it through scripts/test.sh.
# Fix what it reports with: .venv/bin/ruff check --fix . && .venv/bin/ruff format .
set -uo pipefail
cd "$(dirname "$0")/.."
ruff="${RUFF:-.venv/bin/ruff}"
status=0
"$ruff" check . || status=1
"$ruff" format --check . || status=1
exit $status
