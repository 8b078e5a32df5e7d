# Reward service on CPU: python -m services.reward, with the rule scorers (the reward extra) and torch's CPU build
# with transformers (the ml extra), so the reward_model component runs here. A judge (a vLLM engine) or a reward
# model on GPUs runs on the rollout image instead (the chart's reward.servers: image.component rollout).
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
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_DISABLE_PIP_VERSION_CHECK=1 HOME=/tmp \
    TOKENIZERS_PARALLELISM=false
COPY --from=build /wheels /wheels
# torch from PyTorch's CPU index first, as the learner image does: PyPI's default wheel carries CUDA
RUN pip install --no-cache-dir --index-url https://download.pytorch.org/whl/cpu "torch==2.13.0" \
 && pip install --no-cache-dir "$(ls /wheels/*.whl)[reward,ml]" && rm -rf /wheels \
 && useradd --uid 10001 --user-group --no-create-home --shell /usr/sbin/nologin omrl
USER 10001:10001
EXPOSE 50053 9103
HEALTHCHECK --interval=10s --timeout=5s --start-period=120s \
  CMD ["python", "-m", "services.common.healthcheck", "127.0.0.1:50053"]
ENTRYPOINT ["python", "-m", "services.reward"]
CMD ["--port", "50053", "--metrics-port", "9103"]
