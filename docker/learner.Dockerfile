# Learner on CPU (torch CPU build, FSDP over gloo): python -m services.learner, or torchrun for several
# processes. Build from the repository root:
#   docker build -f docker/learner.Dockerfile -t openmanus-rl/learner:cpu .
# For GPUs use docker/learner.cuda.Dockerfile.
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
    HF_HOME=/cache/hf TOKENIZERS_PARALLELISM=false
COPY --from=build /wheels /wheels
RUN pip install --no-cache-dir --index-url https://download.pytorch.org/whl/cpu "torch==2.13.0" \
 && pip install --no-cache-dir "$(ls /wheels/*.whl)[ml,trackers]" && rm -rf /wheels \
 && useradd --uid 10001 --user-group --no-create-home --shell /usr/sbin/nologin omrl \
 && mkdir -p /cache /data && chown 10001:10001 /cache /data
USER 10001:10001
EXPOSE 9104
HEALTHCHECK --interval=15s --timeout=5s --start-period=300s \
  CMD ["python", "-m", "services.common.healthcheck", "http://127.0.0.1:9104/metrics"]
ENTRYPOINT ["python", "-m", "services.learner"]
CMD ["--metrics-port", "9104"]
