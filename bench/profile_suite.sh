#!/usr/bin/env bash
# Where the learner step spends its time against the bare loop (issue 11): each row one process on one GPU,
# bench/learner_step.py --bare --profile on the Qwen2.5-0.5B shape, 64 ragged sequences of 256..2048 tokens,
# packed. Prints per-row wall/GPU-busy/kernel counts of one profiled learner step and one bare step.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-bench-out}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/gpus.txt"
run() {  # name, overrides...
  local name=$1; shift
  local sets=(); for s in "$@"; do sets+=(--set "$s"); done
  CUDA_VISIBLE_DEVICES=0 timeout ${ROW_TIMEOUT:-240} python3 bench/learner_step.py --bare --profile --min-len 256 \
    --steps ${STEPS:-3} "${sets[@]}" --out "$out/prof_$name.json" > "$out/prof_$name.log" 2>&1 \
    || tail -5 "$out/prof_$name.log"
}
for row in ${ROWS:-packed16k}; do
  case $row in
    packed16k) run packed16k learner.pack_sequences=true algorithm.micro_batch_tokens=16384 ;;
    packed32k) run packed32k learner.pack_sequences=true algorithm.micro_batch_tokens=32768 ;;
    packed16k_compile) run packed16k_compile learner.pack_sequences=true algorithm.micro_batch_tokens=16384 learner.compile=true ;;
    packed16k_varlen) run packed16k_varlen learner.pack_sequences=true algorithm.micro_batch_tokens=16384 learner.attention=varlen ;;
    packed32k_varlen) run packed32k_varlen learner.pack_sequences=true algorithm.micro_batch_tokens=32768 learner.attention=varlen ;;
    packed16k_varlen_compile) run packed16k_varlen_compile learner.pack_sequences=true algorithm.micro_batch_tokens=16384 learner.attention=varlen learner.compile=true ;;
    packed32k_varlen_compile) run packed32k_varlen_compile learner.pack_sequences=true algorithm.micro_batch_tokens=32768 learner.attention=varlen learner.compile=true ;;
    packed32k_varlen_compile_recompute) run packed32k_varlen_compile_recompute learner.pack_sequences=true algorithm.micro_batch_tokens=32768 learner.attention=varlen learner.compile=true learner.logprob_head=recompute ;;
    packed64k_varlen_compile) run packed64k_varlen_compile learner.pack_sequences=true algorithm.micro_batch_tokens=65536 learner.attention=varlen learner.compile=true ;;
    packed16k_noent) run packed16k_noent learner.pack_sequences=true algorithm.micro_batch_tokens=16384 learner.fuse_scoring=false ;;
  esac
done
python3 - "$out" <<'PY'
import json, pathlib, sys
for f in sorted(pathlib.Path(sys.argv[1]).glob("prof_*.json")):
    r = json.loads(f.read_text())
    line = (f"{f.stem:22s} {r['gpu']:22s} step {r['step_seconds_median']:.3f}s bare {r['bare_step_seconds_median']:.3f}s "
            f"ratio {r['learner_over_bare']:.3f} MFU {100 * r['mfu']:.1f}% (bare {100 * r['bare_mfu']:.1f}%) "
            f"mem {max(r['max_memory_gib_per_rank']):.1f} GiB")
    print(line)
    for kind, p in r.get("profile", {}).items():
        print(f"   {kind:8s} profiled wall {p['wall_s']:.3f}s gpu busy {p['gpu_busy_s']:.3f}s kernels {p['kernels']}")
        for op in p["top_cpu"][:12]:
            print(f"      cpu {op['self_cpu_ms']:9.1f} ms gpu {op['self_gpu_ms']:9.1f} ms x{op['count']:6d} {op['name']}")
PY
