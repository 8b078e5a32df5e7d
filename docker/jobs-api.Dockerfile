# Job API (CPU only, no torch): python -m services.jobs, launching jobs through the Kubernetes API.
# Build from the repository root: docker build -f docker/jobs-api.Dockerfile -t openmanus-rl/jobs-api:cpu .
# Like every service it binds 127.0.0.1 unless OMRL_BIND_HOST says otherwise (the chart sets 0.0.0.0); alone:
#   docker run -e OMRL_BIND_HOST=0.0.0.0 -e OMRL_API_TOKEN=... -p 127.0.0.1:8080:8080 openmanus-rl/jobs-api:cpu
FROM python:3.11-slim-bookworm AS build
WORKDIR /src
COPY pyproject.toml ./
COPY proto/ proto/
COPY services/ services/
RUN pip install --no-cache-dir "grpcio-tools>=1.60" \
 && python -m services.common.protogen \
 && pip wheel --no-cache-dir --no-deps -w /wheels .

FROM python:3.11-slim-bookworm
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_DISABLE_PIP_VERSION_CHECK=1 HOME=/tmp
COPY --from=build /wheels /wheels
RUN pip install --no-cache-dir "$(ls /wheels/*.whl)[api,k8s]" && rm -rf /wheels \
 && useradd --uid 10001 --user-group --no-create-home --shell /usr/sbin/nologin omrl \
 && mkdir -p /data && chown 10001:10001 /data
USER 10001:10001
EXPOSE 8080
HEALTHCHECK --interval=10s --timeout=5s --start-period=20s \
  CMD ["python", "-m", "services.common.healthcheck", "http://127.0.0.1:8080/healthz"]
ENTRYPOINT ["python", "-m", "services.jobs"]
CMD ["--port", "8080"]
