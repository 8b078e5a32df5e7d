# Reward service (CPU only, no torch): python -m services.reward
# Build from the repository root: docker build -f docker/reward.Dockerfile -t openmanus-rl/reward:cpu .
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
RUN pip install --no-cache-dir "$(ls /wheels/*.whl)[reward]" && rm -rf /wheels \
 && useradd --uid 10001 --user-group --no-create-home --shell /usr/sbin/nologin omrl
USER 10001:10001
EXPOSE 50053 9103
HEALTHCHECK --interval=10s --timeout=5s --start-period=20s \
  CMD ["python", "-m", "services.common.healthcheck", "127.0.0.1:50053"]
ENTRYPOINT ["python", "-m", "services.reward"]
CMD ["--port", "50053", "--metrics-port", "9103"]
