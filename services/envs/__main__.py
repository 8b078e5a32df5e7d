"""python -m services.envs --port 50052 --metrics-port 9102"""
import argparse
import asyncio
import logging


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m services.envs", description="Text environment service")
    parser.add_argument("--host", default="0.0.0.0")
    parser.add_argument("--port", type=int, default=50052, help="gRPC port (0 picks a free one)")
    parser.add_argument("--metrics-port", type=int, default=None, help="Prometheus /metrics port")
    parser.add_argument("--config", default=None, help="Run config; `env.step_timeout_s` is the default deadline")
    parser.add_argument("--step-timeout-s", type=float, default=None, help="Deadline of one env call")
    parser.add_argument("--max-observation-chars", type=int, default=4096, help="Longer observations are cut")
    parser.add_argument("--max-episodes", type=int, default=4096, help="Open episodes at most")
    parser.add_argument("--workers", type=int, default=32, help="Threads running env calls")
    parser.add_argument("--import", dest="imports", action="append", default=[], metavar="MODULE",
                        help="Import MODULE first, so its envs registered with @register_env are served")
    parser.add_argument("--grace-s", type=float, default=5.0, help="Shutdown grace for in-flight calls")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    import importlib

    from services.common.config import load_config
    from services.common.grpc_server import serve
    from services.envs.server import add_env_service
    from services.envs.service import EnvService

    for module in args.imports:
        importlib.import_module(module)
    step_timeout_s = args.step_timeout_s or load_config(args.config).env.step_timeout_s
    service = EnvService(step_timeout_s=step_timeout_s, max_observation_chars=args.max_observation_chars,
                         max_episodes=args.max_episodes, workers=args.workers)
    asyncio.run(serve("envs", args.port, [add_env_service(service)], host=args.host,
                      metrics_port=args.metrics_port, grace_s=args.grace_s, on_shutdown=service.aclose))


if __name__ == "__main__":
    main()
