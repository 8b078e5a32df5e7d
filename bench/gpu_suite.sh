#!/usr/bin/env bash
# The learner's GPU checks and benchmarks in one go (the figures in docs/benchmarks.md come from this):
# the gpu-marked tests, then bench/learner_step.py for GRPO and for PPO (GAE + critic + KL loss) on 1 GPU
# and, when there are two, on 2 GPUs with FSDP. Results land in ${OUT:-bench-out}/.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-bench-out}
mkdir -p "$out"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/gpus.txt"
python3 -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)'
python3 -m pytest -q -p no:cacheprovider -m gpu tests/integration/test_fsdp_gpu.py 2>&1 | tail -15
gpus=$(python3 -c 'import torch; print(torch.cuda.device_count())')
for adv in grpo gae; do
  extra=""; [ "$adv" = gae ] && extra="--kl-loss"
  CUDA_VISIBLE_DEVICES=0 python3 bench/learner_step.py --advantage $adv $extra --out "$out/${adv}_1gpu.json" \
    > "$out/${adv}_1gpu.log" 2>&1 || tail -20 "$out/${adv}_1gpu.log"
  if [ "$gpus" -ge 2 ]; then
    python3 -m torch.distributed.run --standalone --nproc_per_node 2 bench/learner_step.py --advantage $adv $extra \
      --out "$out/${adv}_2gpu.json" > "$out/${adv}_2gpu.log" 2>&1 || tail -20 "$out/${adv}_2gpu.log"
  fi
done
python3 - "$out" <<'PY'
import json, pathlib, sys
for f in sorted(pathlib.Path(sys.argv[1]).glob("*.json")):
    r = json.loads(f.read_text())
    print(f"{f.stem:10s} {r['gpu']:24s} x{r['gpus']} step {r['step_seconds_median']:.3f}s "
          f"{r['tokens_per_second']:9.0f} tok/s  {r['achieved_tflops_per_gpu']:6.1f} TFLOP/s/GPU  "
          f"MFU {100 * r['mfu']:.1f}%  mem {max(r['max_memory_gib_per_rank']):.1f} GiB")
PY
