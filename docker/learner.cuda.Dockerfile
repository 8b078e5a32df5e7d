# Learner on NVIDIA GPUs (FSDP over NCCL). Built on the same vLLM CUDA image as the rollout server so
# both sides run the same torch and CUDA. Build from the repository root:
#   docker build -f docker/learner.cuda.Dockerfile -t openmanus-rl/learner:cuda .
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
    HF_HOME=/cache/hf TRITON_CACHE_DIR=/tmp/triton TOKENIZERS_PARALLELISM=false
COPY --from=build /wheels /wheels
RUN python3 -m pip install --no-cache-dir "$(ls /wheels/*.whl)[ml,trackers]" && rm -rf /wheels \
 && useradd --uid 10001 --user-group --no-create-home --shell /usr/sbin/nologin omrl \
 && mkdir -p /cache /data && chown 10001:10001 /cache /data
USER 10001:10001
EXPOSE 9104 29500
HEALTHCHECK --interval=15s --timeout=5s --start-period=900s \
  CMD ["python3", "-m", "services.common.healthcheck", "http://127.0.0.1:9104/metrics"]
ENTRYPOINT ["python3", "-m", "services.learner"]
CMD ["--metrics-port", "9104"]
