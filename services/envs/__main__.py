"""python -m services.envs --port 50052 --metrics-port 9102: the environment service; `env.step_timeout_s` of
the run config (`--config`, `--set`, a flag per field) is its default deadline, scaled by the queue waves of
an env that serves a limited number of calls at once (services.envs.deadlines)."""

import asyncio
import logging

import services.plugins  # noqa: F401  (the whole run config is checked when it is parsed, as the launcher does)
from services.common.config_cli import Parser, add_import_flag, parse_service_args
from services.common.logs import setup_logging


def main() -> None:
    parser = Parser(prog="python -m services.envs", description=__doc__)
    parser.add_argument("--host", default=None, help="bind address (default $OMRL_BIND_HOST, else 127.0.0.1)")
    parser.add_argument("--port", type=int, default=50052, help="gRPC port (0 picks a free one)")
    parser.add_argument("--metrics-port", type=int, default=None, help="Prometheus /metrics port")
    parser.add_argument("--step-timeout-s", type=float, default=None, help="Deadline of one env call")
    parser.add_argument("--max-observation-chars", type=int, default=4096, help="Longer observations are cut")
    parser.add_argument("--max-episodes", type=int, default=4096, help="Open episodes at most")
    parser.add_argument(
        "--max-episode-steps",
        type=int,
        default=1000,
        help="Steps after which the service ends an episode whatever the env says",
    )
    parser.add_argument(
        "--idle-ttl-s",
        type=float,
        default=900.0,
        help="Episodes with no call for this long are closed by a periodic reaper",
    )
    parser.add_argument("--workers", type=int, default=32, help="Threads running env calls")
    add_import_flag(parser, "its envs registered with @register_env are served")
    parser.add_argument("--grace-s", type=float, default=5.0, help="Shutdown grace for in-flight calls")
    parser.add_argument(
        "--replica-id", default=None, help="This replica's id, the prefix of its episode ids (default: random)"
    )
    parser.add_argument(
        "--advertise",
        default=None,
        help="Direct address peers forward this replica's episodes to (default 127.0.0.1:PORT)",
    )
    parser.add_argument(
        "--registry",
        choices=["none", "redis"],
        default="none",
        help="Where replicas find each other: redis (the run config's stream.redis_url) or none",
    )
    parser.add_argument(
        "--peer",
        action="append",
        default=[],
        metavar="ID=HOST:PORT",
        help="A peer replica's direct address (a static directory instead of Redis)",
    )
    parser.add_argument(
        "--alerts",
        choices=["run", "none"],
        default="run",
        help="Where backend alerts (a server restarted, out of rotation) go besides the log: run (the run "
        "config's metrics stream in Redis, shown by the launcher and the job's events) or none",
    )
    parser.add_argument(
        "--skip-server-check",
        action="store_true",
        help="Do not check the env's servers at start-up (the local launcher has checked them already)",
    )
    args, config = parse_service_args(parser)
    setup_logging("envs")
    if args.alerts == "run":
        from services.envs.alerts import add_sink, run_stream_sink

        add_sink(run_stream_sink(config))
    if not args.skip_server_check:
        check_servers(config)

    from services.envs.deadlines import env_deadlines
    from services.envs.service import EnvService
    from services.envs.tool_host import ToolHost

    deadlines = env_deadlines(config, args.step_timeout_s)
    if deadlines.waves > 1:
        logging.getLogger("services.envs").info(
            "%s serves %d calls at once: env-call deadline %.1fs (%d queue waves)",
            config.env.name,
            deadlines.capacity,
            deadlines.service_s,
            deadlines.waves,
        )
    service = EnvService(
        step_timeout_s=deadlines.service_s,
        max_observation_chars=args.max_observation_chars,
        max_episodes=args.max_episodes,
        max_episode_steps=args.max_episode_steps,
        # calls the env can serve at once must not wait for a thread: its own queue is the one the deadline covers
        workers=max(args.workers, deadlines.capacity or 0),
        replica_id=args.replica_id,
        idle_ttl_s=args.idle_ttl_s,
        tools=ToolHost(
            config.env.toolset_entries(),
            call_timeout_s=config.env.tool_timeout_s,
            max_output_chars=args.max_observation_chars,
            max_calls=config.env.max_tool_calls,
        ),
    )
    asyncio.run(run(args, config, service, deadlines.routed_s))


def check_servers(config) -> None:
    """The env's backends checked once at start-up (`TextEnv.preflight`), where no launcher did (a pod on
    Kubernetes): a failure is logged and published as an alert (the job's events show it), and the service
    starts anyway, as the servers may come up after it; episodes on them fail, named, until they do."""
    from services.envs.alerts import alert
    from services.envs.base import InvalidTask
    from services.envs.registry import preflight

    log = logging.getLogger("services.envs")
    try:
        checked = preflight(config.env)
    except InvalidTask as exc:
        log.error("env servers failed their start-up check: %s", exc)
        alert("env_server_check_failed", f"env servers failed their start-up check: {exc}")
        return
    if checked:
        log.info("%s", checked)


async def run(args, config, service, forward_timeout_s: float) -> None:
    from services.common.grpc_server import serve
    from services.envs.replicas import RedisDirectory, RoutedEnvService, StaticDirectory, heartbeat
    from services.envs.server import add_env_service

    advertise = args.advertise or f"127.0.0.1:{args.port}"
    directory = None
    if args.registry == "redis":
        from services.common.run_state import async_redis_client

        client = async_redis_client(config.stream.redis_url, timeout_s=5)
        directory = RedisDirectory(client, config.key("env_replicas"))
    elif args.peer:
        directory = StaticDirectory(dict(peer.split("=", 1) for peer in args.peer))
    routed = RoutedEnvService(service, directory, timeout_s=forward_timeout_s)
    tasks = [asyncio.create_task(service.reap_forever())]
    if directory is not None:
        await directory.register(service.replica_id, advertise)
        tasks.append(asyncio.create_task(heartbeat(directory, service.replica_id, advertise)))
    logging.getLogger("services.envs").info("replica %s serving at %s", service.replica_id, advertise)

    async def on_shutdown() -> None:
        for task in tasks:
            task.cancel()
        if directory is not None:
            await directory.unregister(service.replica_id)
        await routed.aclose()

    await serve(
        "envs",
        args.port,
        [add_env_service(routed)],
        host=args.host,
        metrics_port=args.metrics_port,
        grace_s=args.grace_s,
        on_shutdown=on_shutdown,
    )


if __name__ == "__main__":
    main()
