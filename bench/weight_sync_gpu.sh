#!/usr/bin/env bash
# The GPU weight-sync bench in one go on a 2-GPU machine (no vLLM needed): GPU topology, then both model
# shapes; JSON and the log under $OUT (named with $TAG if set; $TIMEOUT caps the run, 420 s).
# Usage: [TAG=a] bash bench/weight_sync_gpu.sh [extra args of weight_sync_gpu.py]
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/omrl-bench}
NAME=weight_sync_gpu${TAG:+_$TAG}  # TAG: several runs into one $OUT
mkdir -p "$OUT"
nvidia-smi --query-gpu=index,name,memory.total --format=csv | tee "$OUT/gpus.txt" || true
nvidia-smi topo -m | tee -a "$OUT/gpus.txt" || true
PYTHON=${PYTHON:-python3}
PYTHONPATH=$PWD timeout "${TIMEOUT:-420}" "$PYTHON" bench/weight_sync_gpu.py --out "$OUT/$NAME.json" "$@" 2>&1 | tee "$OUT/$NAME.log"
