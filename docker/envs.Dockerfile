# Environment service (CPU only, no torch): python -m services.envs
# Build from the repository root: docker build -f docker/envs.Dockerfile -t openmanus-rl/envs:cpu .
# The same image runs the python toolset's sandbox server (docker-compose.yml service sandbox, the chart's sandbox):
#   docker run --entrypoint python ... openmanus-rl/envs:cpu -m services.envs.sandbox_server --port 8090
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
# bubblewrap: the sandbox of the python toolset (services/envs/tools/python.py); it needs user namespaces, which the
# container runtime's default seccomp profile may refuse (the toolset's start then says so)
RUN apt-get update && apt-get install -y --no-install-recommends bubblewrap && rm -rf /var/lib/apt/lists/*
COPY --from=build /wheels /wheels
# api: fastapi and uvicorn for the sandbox server (services/envs/sandbox_server.py)
RUN pip install --no-cache-dir "$(ls /wheels/*.whl)[envs,api]" && rm -rf /wheels \
 && useradd --uid 10001 --user-group --no-create-home --shell /usr/sbin/nologin omrl
USER 10001:10001
EXPOSE 50052 9102
HEALTHCHECK --interval=10s --timeout=5s --start-period=20s \
  CMD ["python", "-m", "services.common.healthcheck", "127.0.0.1:50052"]
ENTRYPOINT ["python", "-m", "services.envs"]
CMD ["--port", "50052", "--metrics-port", "9102"]
