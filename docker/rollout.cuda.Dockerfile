# Rollout server on NVIDIA GPUs: vLLM's own CUDA image (same vLLM version as the CPU build) plus this
# project. Build from the repository root:
#   docker build -f docker/rollout.cuda.Dockerfile -t openmanus-rl/rollout:cuda .
ARG BASE_IMAGE=vllm/vllm-openai:v0.32.0
FROM python:3.11-slim-bookworm AS build
WORKDIR /src
COPY pyproject.toml ./
COPY proto/ proto/
COPY services/ services/
RUN pip install --no-cache-dir "grpcio-tools>=1.60" \
 && python -m services.common.protogen \
 && pip wheel --no-cache-dir --no-deps -w /wheels .

FROM ${BASE_IMAGE}
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_DISABLE_PIP_VERSION_CHECK=1 HOME=/tmp \
    HF_HOME=/cache/hf VLLM_CACHE_ROOT=/tmp/vllm TRITON_CACHE_DIR=/tmp/triton TOKENIZERS_PARALLELISM=false
COPY --from=build /wheels /wheels
# the base image already has vLLM, torch and transformers; only this project and what it adds come in
RUN python3 -m pip install --no-cache-dir "$(ls /wheels/*.whl)[ml]" && rm -rf /wheels \
 && useradd --uid 10001 --user-group --no-create-home --shell /usr/sbin/nologin omrl \
 && mkdir -p /cache && chown 10001:10001 /cache
USER 10001:10001
EXPOSE 50051 9101
HEALTHCHECK --interval=10s --timeout=5s --start-period=900s \
  CMD ["python3", "-m", "services.common.healthcheck", "127.0.0.1:50051"]
ENTRYPOINT ["python3", "-m", "services.rollout"]
CMD ["--port", "50051", "--metrics-port", "9101"]
