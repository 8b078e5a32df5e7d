#!/usr/bin/env bash
# Packing, attention kernels and the bare loop on one GPU (issue 11): bench/learner_step.py on the
# Qwen2.5-0.5B shape, 64 ragged sequences of 256..2048 tokens (RL batches are ragged), GRPO, one epoch;
# each row a separate process that also times the bare training loop on the same model and micro-batches.
# Results in ${OUT:-bench-out}/.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-bench-out}
mkdir -p "$out"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/gpus.txt"
run() {  # name, min-len, micro-batch, overrides...
  local name=$1 min=$2 mb=$3; shift 3
  local sets=(); for s in "$@"; do sets+=(--set "$s"); done
  CUDA_VISIBLE_DEVICES=0 timeout ${ROW_TIMEOUT:-200} python3 bench/learner_step.py --bare --min-len "$min" \
    --micro-batch "$mb" "${sets[@]}" --out "$out/pack_$name.json" > "$out/pack_$name.log" 2>&1 \
    || tail -5 "$out/pack_$name.log"
}
run padded_sdpa 256 4
run packed_sdpa 256 4 learner.pack_sequences=true algorithm.micro_batch_tokens=8192
run packed_flex 256 4 learner.pack_sequences=true algorithm.micro_batch_tokens=16384 learner.attention=flex_attention
run packed_flex_compile 256 4 learner.pack_sequences=true algorithm.micro_batch_tokens=16384 \
  learner.attention=flex_attention learner.compile=true
run full_packed_flex 0 4 learner.pack_sequences=true algorithm.micro_batch_tokens=16384 learner.attention=flex_attention
python3 - "$out" <<'PY'
import json, pathlib, sys
for f in sorted(pathlib.Path(sys.argv[1]).glob("pack_*.json")):
    r = json.loads(f.read_text())
    print(f"{f.stem:26s} {r['gpu']:22s} step {r['step_seconds_median']:.3f}s bare {r['bare_step_seconds_median']:.3f}s "
          f"ratio {r['learner_over_bare']:.3f} {r['tokens_per_second']:8.0f} tok/s MFU {100 * r['mfu']:.1f}% "
          f"(bare {100 * r['bare_mfu']:.1f}%) mem {max(r['max_memory_gib_per_rank']):.1f} GiB")
PY
