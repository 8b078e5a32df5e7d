#!/usr/bin/env bash
# Issue 11 in one device call on nvidia-h100-x4 (4 GPUs, under 9 minutes). Each row is bench/learner_step.py
# with --bare (the bare loop in the same process, after the learner steps), GRPO, ragged sequences of
# 256..2,048 tokens, packed, varlen attention, compiled layers:
#   (a) the Qwen2.5-0.5B shape, one GPU each, 64 sequences, 32k-token micro-batches, rows side by side on
#       GPUs 0-2 (one process a GPU): the fused LM head, the recompute (checkpointed) head, and the fused head
#       with fused AdamW; --profile adds one profiled learner and bare step (GPU-busy time, kernel count).
#   (b) the Qwen2.5-7B shape (random weights), FSDP over the 4 GPUs (torchrun), 128 sequences, activation
#       checkpointing, 32k-token micro-batches, fused head; if it fails and time is left, again without compile
#       and with 16k-token micro-batches; if it ran and time is left, without activation checkpointing (no
#       recompute, which MFU does not count) on 6k-token micro-batches (what the activations allow in 80 GB).
# Prints one table; writes ${OUT:-bench-out}/scale_suite.json (every row's result) and scale_suite.log (each
# row's log tail). A_ONLY=1: the (a) rows alone, one after another on GPU 0, and no (b). TINY=1: the same
# rows with a tiny model on CPU (2 processes for (b)), to check the script.
# LEVERS=1 (one GPU, under 8 minutes; implies A_ONLY): the 0.5B shape's MFU levers instead of the (a) rows, one
# row after another on GPU 0, each with its bare loop: `base` (the levers off: per-layer FSDP units, 4k-token
# head chunks, 32k-token micro-batches, foreach AdamW, the head's torch kernels), each lever alone (`root`:
# fsdp_wrap=root; `chunk16k`: logprob_chunk_tokens=16384; `mb40k`: micro_batch_tokens=40960, 2 micro-batches
# where 32k gives 3), `all` (the three and the head's Triton kernels, --profile), `all_torch_head` (`all` with
# the head's torch kernels), `all_keep_logits` (head_keep_logits: no recompute of the head's logits),
# `all_decoder_compile` (compile_scope=decoder: the decoder stack one graph) and `all_fused_adamw`; each row
# gets what is left of BUDGET_S (default 450 s), at most 180 s, and is skipped under 60 s, in that order. LEVER_ROWS="l0_base l1_all": those rows only; ROW_CAP_S: a row's most seconds (180);
# `all_cdtune` (Inductor's coordinate-descent tuning of its kernels' block sizes) runs only when named there.
# B_ONLY=1: the (b) rows alone (no (a) rows, no gpu tests): the 7B row with the defaults, then, if time is left,
# `b_7b_fsdp_levers` (16k-token head chunks, 40k-token micro-batches) instead of the row without checkpointing.
# B_GPUS=2: the (b) rows over 2 GPUs (nvidia-h100-x2; ~71 GiB a GPU for the 7B shape's fp32 state and Adam).
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-bench-out}
work=$(mktemp -d)
mkdir -p "$out"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" TOKENIZERS_PARALLELISM=false
# Inductor's parallel compile workers left the learner's host work (collate, advantages) 5-10x slower for the
# first ~3-10 steps after compiling (6.5 CPU-s in the learner process per 1 s step, H100 host, 27 Nov): steady-state
# rows compile in-process
export TORCHINDUCTOR_COMPILE_THREADS=${TORCHINDUCTOR_COMPILE_THREADS:-1}
PY=${PYTHON:-python3}
BUDGET=${BUDGET_S:-530}  # the whole suite's seconds; the device call allows 600
[ "${LEVERS:-0}" = 1 ] && A_ONLY=1 BUDGET=${BUDGET_S:-450}
common=(--bare --bare-warmup 1 --min-len 256 --set learner.pack_sequences=true --set learner.attention=varlen
  --set learner.compile=true)
if [ "${TINY:-0}" = 1 ]; then
  small=(--tiny --seq-len 96 --min-len 16 --group-size 4)
  a_args=(--shape tiny "${small[@]}" --trajectories 8 --steps 1 --warmup 1 --set algorithm.micro_batch_tokens=256)
  b_args=(--shape tiny "${small[@]}" --trajectories 8 --steps 1 --warmup 1 --set algorithm.micro_batch_tokens=256)
  a_env() { :; }
  b_launch=("$PY" -m torch.distributed.run --standalone --nproc_per_node 2)
  a_timeout=400 BUDGET=${BUDGET_S:-1200}
else
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$work/gpus.txt"
  a_args=(--shape 0.5b --trajectories 64 --steps 5 --warmup 2 --profile --set algorithm.micro_batch_tokens=32768)
  b_args=(--shape 7b --trajectories 128 --steps 3 --warmup 2 --set algorithm.micro_batch_tokens=32768)
  a_env() { echo "CUDA_VISIBLE_DEVICES=$1"; }
  b_launch=("$PY" -m torch.distributed.run --standalone --nproc_per_node "${B_GPUS:-4}")
  a_timeout=190
fi
"$PY" -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)'

row() {  # name, timeout, command...: runs one row, its JSON and log in $work
  local name=$1 limit=$2; shift 2
  timeout "$limit" "$@" --out "$work/$name.json" > "$work/$name.log" 2>&1
  local rc=$?
  [ $rc = 0 ] || { echo "row $name failed (rc $rc):"; tail -8 "$work/$name.log"; }
  return $rc
}

# the models first: the (a) rows would race to build the same directory; the 7B one, and the gpu tests of the
# fused head and varlen attention, on the GPU (a) leaves free
[ "${B_ONLY:-0}" = 1 ] || "$PY" bench/learner_step.py "${a_args[@]}" --build-only
if [ "${B_ONLY:-0}" = 1 ]; then
  "$PY" bench/learner_step.py "${b_args[@]}" --build-only > "$work/build_7b.txt" 2>&1 &
  build_7b=$! gpu_tests=""
elif [ "${A_ONLY:-0}" = 1 ]; then
  build_7b="" gpu_tests=""
else
  env $(a_env 3) "$PY" bench/learner_step.py "${b_args[@]}" --build-only > "$work/build_7b.txt" 2>&1 &
  build_7b=$!
  env $(a_env 3) "$PY" -m pytest -q -p no:cacheprovider -m gpu tests/integration/test_fused_head_gpu.py \
    tests/integration/test_varlen_attention_gpu.py > "$work/gpu_tests.txt" 2>&1 &
  gpu_tests=$!
fi

# (a) side by side, one GPU each
a_row() {  # name, gpu, overrides...
  local name=$1 gpu=$2; shift 2
  local sets=(); for s in "$@"; do sets+=(--set "$s"); done
  row "$name" "$a_timeout" env $(a_env "$gpu") "$PY" bench/learner_step.py "${common[@]}" "${a_args[@]}" "${sets[@]}"
}
if [ "${LEVERS:-0}" = 1 ]; then
  base=(learner.logprob_head=fused learner.fsdp_wrap=layers learner.logprob_chunk_tokens=4096
    learner.fused_optimizer=false learner.head_kernel=torch)
  levers=(learner.fsdp_wrap=root learner.logprob_chunk_tokens=16384 algorithm.micro_batch_tokens=40960
    learner.head_kernel=auto)
  # TINY: uncompiled (inductor takes minutes a row on a small CPU; tests/unit covers the compiled levers)
  [ "${TINY:-0}" = 1 ] && levers=(learner.fsdp_wrap=root learner.logprob_chunk_tokens=64 \
    algorithm.micro_batch_tokens=320) base+=(learner.compile=false)
  plain=(); for a in "${a_args[@]}"; do [ "$a" = --profile ] || plain+=("$a"); done
  lever_row() {  # name, profile (0/1), overrides...: each row gets what is left of the budget, at most 180 s
    local name=$1 prof=$2 left=$((BUDGET - SECONDS)); shift 2
    [ -z "${LEVER_ROWS:-}" ] || [[ " $LEVER_ROWS " == *" $name "* ]] || return 0
    [ "$left" -ge 60 ] || { echo "skipped $name: $left s left"; return; }
    local cap=${ROW_CAP_S:-180}
    a_timeout=$((left < cap ? left : cap))
    [ "${TINY:-0}" = 1 ] && a_timeout=400
    a_args=("${plain[@]}"); [ "$prof" = 1 ] && a_args+=(--profile)
    a_row "$name" 0 "${base[@]}" "$@"
  }
  lever_row l0_base 0
  lever_row l1_all 1 "${levers[@]}"
  lever_row l2_root 0 "${levers[0]}"
  lever_row l3_chunk16k 0 "${levers[1]}"
  lever_row l4_mb40k 0 "${levers[2]}"
  if [[ " ${LEVER_ROWS:-} " == *" l7_all_cdtune "* ]]; then
    export TORCHINDUCTOR_COORDINATE_DESCENT_TUNING=1
    lever_row l7_all_cdtune 0 "${levers[@]}"
    unset TORCHINDUCTOR_COORDINATE_DESCENT_TUNING
  fi
  lever_row l8_all_torch_head 0 "${levers[@]}" learner.head_kernel=torch
  lever_row l9_all_keep_logits 0 "${levers[@]}" learner.head_keep_logits=true
  lever_row l5_all_decoder_compile 0 "${levers[@]}" learner.compile_scope=decoder
  lever_row l6_all_fused_adamw 0 "${levers[@]}" learner.fused_optimizer=true
elif [ "${B_ONLY:-0}" = 1 ]; then
  :
elif [ "${A_ONLY:-0}" = 1 ]; then  # (a) alone, one row after another on GPU 0: no neighbour shares the host
  a_row a_05b_fused_head 0 learner.logprob_head=fused
  a_row a_05b_recompute_head 0 learner.logprob_head=recompute
  a_row a_05b_fused_head_fused_adamw 0 learner.logprob_head=fused learner.fused_optimizer=true
else
  a_row a_05b_fused_head 0 learner.logprob_head=fused &
  a_pids=($!)
  a_row a_05b_recompute_head 1 learner.logprob_head=recompute &
  a_pids+=($!)
  a_row a_05b_fused_head_fused_adamw 2 learner.logprob_head=fused learner.fused_optimizer=true &
  a_pids+=($!)
  wait "${a_pids[@]}"
fi

# (b) 7B shape, FSDP over every GPU, in the time left
if [ "${A_ONLY:-0}" != 1 ]; then
wait "$build_7b" || tail -5 "$work/build_7b.txt"
[ -z "$gpu_tests" ] || { wait "$gpu_tests"; tail -4 "$work/gpu_tests.txt"; }
b_timeout=$((BUDGET - SECONDS))
[ "$b_timeout" -ge 60 ] || b_timeout=60  # timeout 0 would mean none
b_sets=(--set learner.activation_checkpointing=true --set learner.logprob_head=fused)
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True  # the 7B rows only: (a) is done
row b_7b_fsdp "$b_timeout" "${b_launch[@]}" bench/learner_step.py "${common[@]}" "${b_args[@]}" "${b_sets[@]}"
left=$((BUDGET - SECONDS))
if [ ! -s "$work/b_7b_fsdp.json" ] && [ "$left" -gt 150 ]; then
  echo "retrying (b) without compile, 16k-token micro-batches ($left s left)"
  row b_7b_fsdp_nocompile_16k "$left" "${b_launch[@]}" bench/learner_step.py "${common[@]}" "${b_args[@]}" \
    "${b_sets[@]}" --set learner.compile=false --set algorithm.micro_batch_tokens=16384
elif [ "${B_ONLY:-0}" = 1 ] && [ "$left" -gt 150 ]; then
  echo "(b) with 16k-token head chunks and 40k-token micro-batches ($left s left)"
  row b_7b_fsdp_levers "$left" "${b_launch[@]}" bench/learner_step.py "${common[@]}" "${b_args[@]}" "${b_sets[@]}" \
    --set learner.logprob_chunk_tokens=16384 --set algorithm.micro_batch_tokens=40960
elif [ "$left" -gt 170 ]; then
  echo "(b) without activation checkpointing, 6k-token micro-batches ($left s left)"
  row b_7b_fsdp_noac_6k "$left" "${b_launch[@]}" bench/learner_step.py "${common[@]}" "${b_args[@]}" \
    --set learner.logprob_head=fused --set algorithm.micro_batch_tokens=6144
fi
fi

"$PY" - "$work" "$out" <<'PY'
import json, pathlib, sys
work, out = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
rows, logs = {}, []
for f in sorted(work.glob("*.log")):
    logs.append(f"==> {f.name} <==\n" + "\n".join(f.read_text(errors="replace").splitlines()[-40:]))
    j = f.with_suffix(".json")
    rows[f.stem] = json.loads(j.read_text()) if j.is_file() else None
gpus = (work / "gpus.txt").read_text() if (work / "gpus.txt").is_file() else ""
(out / "scale_suite.json").write_text(json.dumps({"gpus": gpus, "rows": rows}, indent=1))
(out / "scale_suite.log").write_text("\n\n".join(logs))
print(f"\n{'row':30s} {'GPU':22s} GPUs {'step s':>7s} {'bare s':>7s} {'ratio':>6s} {'tok/s':>9s} {'MFU':>6s} "
      f"{'bare MFU':>8s} {'MFU b0':>6s} {'peak GiB/GPU':>14s}  kernels learner/bare")
for name, r in rows.items():
    if r is None:
        print(f"{name:30s} (no result: see scale_suite.log)")
        continue
    prof = r.get("profile", {})
    kernels = "/".join(str(prof[k]["kernels"]) for k in ("learner", "bare") if k in prof)
    mem = "/".join(f"{m:.1f}" for m in r["max_memory_gib_per_rank"])
    print(f"{name:30s} {r['gpu'][:22]:22s} {r['gpus']:4d} {r['step_seconds_median']:7.3f} "
          f"{r.get('bare_step_seconds_median', float('nan')):7.3f} {r.get('learner_over_bare', float('nan')):6.3f} "
          f"{r['tokens_per_second']:9.0f} {100 * r['mfu']:5.1f}% {100 * r.get('bare_mfu', float('nan')):7.1f}% "
          f"{100 * r.get('mfu_batch0_median', float('nan')):5.1f}% {mem:>14s}  {kernels}")
PY
rm -rf "$work"
