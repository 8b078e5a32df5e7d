#!/usr/bin/env bash
# The learner's defaults on one GPU against the levers set by hand and against the settings that were the
# defaults before `auto` (padded rows, sdpa, eager layers, 4096-token head chunks, micro-batches of 4 sequences),
# each row with its bare loop in the same process (bench/learner_step.py --bare): 0.5B shape, 64 ragged sequences
# of 256-2,048 tokens. One GPU (CUDA_VISIBLE_DEVICES); JSON and logs to $OUT (default bench/results/auto_levers).
#   bash bench/auto_levers.sh
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-bench/results/auto_levers}
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
export TORCHINDUCTOR_COMPILE_THREADS=${TORCHINDUCTOR_COMPILE_THREADS:-1}  # see bench/scale_suite.sh
PY=${PYTHON:-python3}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
"$PY" -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)'
"$PY" bench/learner_step.py --shape 0.5b --build-only
common=(--shape 0.5b --trajectories 64 --min-len 256 --bare --bare-warmup 1)
row() {  # name, seconds, arguments...
  local name=$1 limit=$2; shift 2
  timeout "$limit" "$PY" bench/learner_step.py "${common[@]}" "$@" --out "$out/$name.json" > "$out/$name.log" 2>&1
  local rc=$?
  [ $rc = 0 ] || { echo "row $name failed (rc $rc):"; tail -8 "$out/$name.log"; }
  grep -o "auto settings on .*" "$out/$name.log" | head -1
  [ -f "$out/$name.json" ] && "$PY" - "$out/$name.json" "$name" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
print(f"{sys.argv[2]}: step {r['step_seconds_median']:.3f} s, MFU {r['mfu']:.1%}, bare MFU {r.get('bare_mfu', 0):.1%}, "
      f"learner/bare {r.get('learner_over_bare', 0):.2f}x, peak {r['max_memory_gib_per_rank']} GiB, "
      f"levers {r['levers']}, dynamo {r['dynamo_counts']}")
PY
}
row defaults "${ROW_S:-200}" --steps 5 --warmup 2
row by_hand "${ROW_S:-200}" --steps 5 --warmup 2 --set learner.pack_sequences=true --set learner.attention=varlen \
  --set learner.compile=true --set learner.logprob_chunk_tokens=16384 --set algorithm.micro_batch_tokens=40960
row before_auto "${ROW_S:-200}" --steps 3 --warmup 1 --set learner.pack_sequences=false --set learner.attention=sdpa \
  --set learner.compile=false --set learner.logprob_chunk_tokens=4096 --set algorithm.micro_batch_tokens=0 \
  --set learner.activation_checkpointing=false
