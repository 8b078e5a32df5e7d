"""Assembles a rollout server: engine backend, RolloutCore, gRPC shell, registration in the run's
rollout registry (heartbeat), and the trajectory producer."""
from __future__ import annotations

import asyncio
import logging

from services.common.config import TrainConfig
from services.common.grpc_server import serve
from services.common.run_state import RunState
from services.common.stream import TrajectoryStream
from services.rollout.backends.base import BACKENDS

log = logging.getLogger(__name__)


async def heartbeat(state: RunState, address: str, core, every_s: float = 2.0) -> None:
    while True:
        await asyncio.to_thread(state.register_rollout, address, core.status())
        await asyncio.sleep(every_s)


def build_backend(config: TrainConfig):
    m, r = config.model, config.rollout
    if not m.path:
        raise SystemExit("model.path is empty: give a model (the local launcher builds the tiny one)")
    return BACKENDS.create(r.backend, m.path, dtype=m.dtype, max_model_len=m.max_model_len,
                           gpu_memory_utilization=r.gpu_memory_utilization, max_num_seqs=r.max_num_seqs,
                           enforce_eager=r.enforce_eager, seed=config.seed)


async def run_server(config: TrainConfig, port: int, advertise: str, metrics_port: int | None,
                     produce: bool) -> None:
    from transformers import AutoTokenizer

    from services.envs.client import GrpcEnvClient
    from services.reward.client import GrpcRewardClient
    from services.rollout.action_parsers import PARSERS
    from services.rollout.agent_loop import AgentLoop
    from services.rollout.core import RolloutCore
    from services.rollout.producer import Producer
    from services.rollout.prompting import ChatFormatter
    from services.rollout.server import add_to_server

    backend = build_backend(config)
    await backend.start()
    core = RolloutCore(backend, config.model.path)
    state = RunState.connect(config)
    tasks = [asyncio.create_task(heartbeat(state, advertise, core))]
    if produce:
        loop = AgentLoop(core, GrpcEnvClient(config.env.address, timeout_s=config.env.step_timeout_s + 5.0),
                         ChatFormatter(AutoTokenizer.from_pretrained(config.model.path)),
                         PARSERS.create(config.rollout.action_parser), config.rollout, config.env,
                         config.model.max_model_len, server_name=advertise)
        stream = TrajectoryStream(state.client, state.trajectories_key, max_len=config.stream.max_len)
        producer = Producer(config, loop, GrpcRewardClient(config.reward.address, timeout_s=config.reward.timeout_s),
                            state, stream, core)
        tasks.append(asyncio.create_task(producer.run()))

    async def on_shutdown():
        for task in tasks:
            task.cancel()
        await asyncio.to_thread(state.unregister_rollout, advertise)
        await backend.shutdown()

    await serve("rollout", port, [add_to_server(core)], metrics_port=metrics_port, on_shutdown=on_shutdown)
