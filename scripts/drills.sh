#!/usr/bin/env bash
# Runs every fault drill in tests/faults (real processes, Redis and vLLM) and prints what each one counted.
# OMRL_DRILL_SEED=<n> draws the service-restart drill's kill points and restart delay (5-60 s) at random;
# unset, the drills are the fixed ones CI runs. Extra arguments go to pytest (e.g. -k redis).
set -uo pipefail
cd "$(dirname "$0")/.."
log=$(mktemp)
bash scripts/setup.sh >"$log" 2>&1 || { tail -30 "$log"; exit 1; }
rm -f "$log"
report=$(mktemp)
OMRL_DRILL_REPORT=$report .venv/bin/python -m pytest tests/faults -m faults -q -p no:cacheprovider "$@"
status=$?
.venv/bin/python - "$report" <<'PY'
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
cols = ["drill", "outcome", "seconds", "steps", "full_batches", "groups_dead_lettered", "applied_twice",
        "lost_to_redis", "entries_dead_lettered", "restarts"]
print("\n" + " | ".join(cols))
print(" | ".join("---" for _ in cols))
for row in rows:
    print(" | ".join(str(row.get(c, "")) for c in cols))
PY
rm -f "$report"
exit $status
