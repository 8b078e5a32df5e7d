#!/usr/bin/env bash
# Sets up (scripts/setup.sh) and runs the default local training job: the built-in tiny model on corridor,
# with the RL settings it learns under (configs/tiny_model_rl.yaml). Arguments go to the launcher and
# override these (a later --config replaces the file; --set overrides single fields).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m services.launcher train --config configs/tiny_model_rl.yaml "$@"
