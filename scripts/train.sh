#!/usr/bin/env bash
# Sets up (scripts/setup.sh) and runs the default local training job; arguments go to the launcher.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m services.launcher train "$@"
