"""Wires the learner: trainer (FSDP), weight pusher, and on rank 0 Redis run state and stream."""

from __future__ import annotations

from prometheus_client import start_http_server

from services.common.config import TrainConfig
from services.common.grpc_server import bind_host
from services.common.run_state import RunState
from services.common.stream import TrajectoryStream
from services.learner import collectives
from services.learner.episodes import EpisodeRecorder, run_folder
from services.learner.prometheus_metrics import register_stream_collector
from services.learner.service import LearnerService
from services.learner.trackers import Trackers
from services.learner.trainer import PolicyTrainer
from services.weightsync import PUSHERS


def build_learner(config: TrainConfig, metrics_port: int | None = None, host: str | None = None) -> LearnerService:
    if not config.model.path:
        raise SystemExit("model.path is empty: give a model (the local launcher builds the tiny one)")
    if config.threads.budget:
        import torch

        from services.common.cpu_budget import torch_threads

        torch.set_num_threads(torch_threads(config.threads.learner))
    trainer = PolicyTrainer(config, config.model.path)
    state = stream = None
    if collectives.is_rank0():
        state = RunState.connect(config)
        stream = TrajectoryStream(
            state.client,
            state.trajectories_key,
            max_len=config.stream.max_len,
            max_entry_bytes=config.stream.max_entry_bytes,
        )
        if metrics_port:
            register_stream_collector(stream)
            start_http_server(metrics_port, addr=bind_host(host))
    learner = config.learner
    nccl = (  # the `nccl` transport's settings
        {
            "host": learner.weight_nccl_host,
            "port": learner.weight_nccl_port,
            "backend": learner.weight_nccl_backend,
            "nccl_timeout_s": learner.weight_nccl_timeout_s,
        }
        if learner.weight_push == "nccl"
        else {}
    )
    pusher = PUSHERS.create(
        learner.weight_push, timeout_s=learner.push_timeout_s, bucket_mb=learner.weight_bucket_mb, **nccl
    )
    recorder = trackers = None
    if collectives.is_rank0():
        recorder = EpisodeRecorder(config) if config.logging.episodes_per_step else None
        trackers = Trackers.from_config(config, run_folder(config)) if config.logging.trackers else None
    return LearnerService(config, trainer, pusher, state, stream, recorder, trackers)
