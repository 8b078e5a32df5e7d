#!/usr/bin/env bash
# Sets up (scripts/setup.sh), lints (scripts/lint.sh) and runs every test that this machine can run: unit,
# integration, e2e.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
bash scripts/lint.sh
exec .venv/bin/python -m pytest tests -m "not gpu" -q --durations=15 "$@"
