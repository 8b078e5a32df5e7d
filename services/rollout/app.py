"""Assembles a rollout server: engine backend, RolloutCore, gRPC shell, registration in the run's
rollout registry (heartbeat), and the trajectory producer.

Start-up: a server that finds its run already at published policy vN waits for weights vN (health
NOT_SERVING, Generate UNAVAILABLE, no producer) while its heartbeat reports the version it holds, so
the learner re-pushes to it. Exit: the process exits non-zero when the engine dies or a background task
(heartbeat, producer, engine watch) fails, so it is restarted rather than left half alive."""

from __future__ import annotations

import asyncio
import logging

from services.common.config import TrainConfig
from services.common.grpc_server import bind_host, serve
from services.common.run_state import AsyncRunState
from services.engines.base import BACKENDS
from services.rollout.supervision import TaskSupervisor, retrying, watch_engine

log = logging.getLogger(__name__)

# a failing server's shutdown takes ~3 s (5 s gRPC grace at most, then the engine's own 5 s); past this, it hangs
SHUTDOWN_DEADLINE_S = 30.0


async def heartbeat(state: AsyncRunState, address: str, core, every_s: float = 2.0) -> None:
    """Registers the server's state every `every_s`, and at once when a weight push lands: the learner catches up
    the servers its registry shows behind, and a registry a heartbeat late would have it push the same version
    again to a server that holds it (a push the server then applies while its requests wait)."""
    reported = [-1]

    async def beat():
        reported[0] = core.policy_version
        info = {**core.status(), "version": core.policy_version, "serving": core.serving}
        await state.register_rollout(address, info)

    await retrying(
        beat, "rollout registry heartbeat", every_s, pause=lambda: core.wait_for_new_version(reported[0], every_s)
    )


def build_backend(config: TrainConfig):
    m, r = config.model, config.rollout
    if not m.path:
        raise SystemExit("model.path is empty: give a model (the local launcher builds the tiny one)")
    return BACKENDS.create(
        r.backend,
        m.path,
        dtype=m.dtype,
        max_model_len=m.max_model_len,
        gpu_memory_utilization=r.gpu_memory_utilization,
        max_num_seqs=r.max_num_seqs,
        enforce_eager=r.enforce_eager,
        seed=config.seed,
        gpus=r.gpus,
        engine_args=r.engine_args,
        vllm_metrics=r.vllm_metrics,
        weight_staging=r.weight_staging,
        deterministic=config.deterministic,
    )


async def run_server(
    config: TrainConfig, port: int, advertise: str, metrics_port: int | None, produce: bool, host: str | None = None
) -> None:
    from transformers import AutoTokenizer

    from services.envs.client import GrpcEnvClient
    from services.envs.deadlines import env_deadlines
    from services.reward.client import GrpcRewardClient
    from services.rollout.action_parsers import PARSERS
    from services.rollout.agent_loops import AGENT_LOOPS
    from services.rollout.core import RolloutCore
    from services.rollout.producer import Producer
    from services.rollout.prompting import ChatFormatter
    from services.rollout.server import add_to_server
    from services.weightsync.credential import PushAuthenticator, token_from_env
    from services.weightsync.wire import ModelSignature

    host = bind_host(host)
    auth = PushAuthenticator.for_server(host, token_from_env())
    state = AsyncRunState.connect(config)
    published = await state.policy_version()
    signature = ModelSignature.of_pretrained(config.model.path, config.model.dtype)
    backend = build_backend(config)
    await backend.start()
    core = RolloutCore(backend, config.model.path, signature=signature, run=config.run, required_version=published)
    if core.waiting_for_version:
        log.warning(
            "waiting for weights v%d: the run published it before this server started; serving nothing "
            "until the learner pushes it",
            published,
        )
    stop = asyncio.Event()
    tasks = TaskSupervisor(stop, exit_deadline_s=SHUTDOWN_DEADLINE_S)

    def engine_dead(exc: BaseException) -> None:
        core.engine_dead = True
        log.error("vLLM engine is dead (%s: %s); exiting 1 to be restarted", type(exc).__name__, exc)
        tasks.fail(f"engine dead: {type(exc).__name__}")

    tasks.start("heartbeat", heartbeat(state, advertise, core))
    tasks.start("engine watch", watch_engine(backend.check_alive, engine_dead))
    if produce:
        loop = AGENT_LOOPS.get(config.rollout.agent_loop)(
            core,
            GrpcEnvClient(
                config.env.address,
                timeout_s=env_deadlines(config).client_s,
                batch_steps=config.env.batch_steps,
                tools_timeout_s=env_deadlines(config).tools_client_s,
            ),
            ChatFormatter(AutoTokenizer.from_pretrained(config.model.path)),
            PARSERS.create(config.rollout.action_parser),
            config.rollout,
            config.env,
            config.model.max_model_len,
            server_name=advertise,
            greedy_baseline=config.algorithm.advantage == "remax",
        )
        producer = Producer(
            config, loop, GrpcRewardClient(config.reward.address, timeout_s=config.reward.timeout_s), state, core
        )

        async def produce_when_serving():
            await core.wait_until_serving()  # no claims before the server holds the run's version
            await producer.run()

        tasks.start("producer", produce_when_serving())

    async def on_shutdown():
        await tasks.cancel_all()
        await state.unregister_rollout(advertise)
        await state.aclose()
        await backend.shutdown()

    await serve(
        "rollout",
        port,
        [add_to_server(core, auth)],
        host=host,
        metrics_port=metrics_port,
        on_shutdown=on_shutdown,
        stop=stop,
        serving=lambda: core.serving,
    )
    if tasks.failure:
        raise SystemExit(f"rollout server stopped: {tasks.failure}")
