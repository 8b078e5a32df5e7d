#!/usr/bin/env bash
# Lint and format check with ruff (rules in pyproject.toml, [tool.ruff]); CI runs it through scripts/test.sh.
# Fix what it reports with: .venv/bin/ruff check --fix . && .venv/bin/ruff format .
set -euo pipefail
cd "$(dirname "$0")/.."
ruff="${RUFF:-.venv/bin/ruff}"
"$ruff" check .
"$ruff" format --check .
