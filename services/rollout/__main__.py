"""python -m services.rollout: a vLLM rollout server (and trajectory producer) for one run. Every run-config
field is also a flag (`--rollout.max_new_tokens 32`)."""

import asyncio
import os

import services.plugins  # noqa: F401  (the whole run config is checked when it is parsed, as the launcher does)
from services.common.config_cli import Parser, parse_service_args
from services.common.logs import setup_logging


def main() -> None:
    parser = Parser(prog="python -m services.rollout", description=__doc__)
    parser.add_argument("--host", default=None, help="bind address (default $OMRL_BIND_HOST, else 127.0.0.1)")
    parser.add_argument("--port", type=int, default=50051)
    parser.add_argument("--advertise", help="address the learner reaches this server at (default 127.0.0.1:PORT)")
    parser.add_argument("--metrics-port", type=int, default=None)
    parser.add_argument("--no-produce", action="store_true", help="serve generation only, run no agent loop")
    args, config = parse_service_args(parser)
    setup_logging("rollout")
    if config.threads.budget:  # a local launcher's share stays; alone (a pod) the worker takes the budget
        from services.common.cpu_budget import alone_engine_env, available_cores

        for name, value in alone_engine_env(available_cores()).items():
            os.environ.setdefault(name, value)
    from services.rollout.app import run_server

    asyncio.run(
        run_server(
            config,
            args.port,
            args.advertise or f"127.0.0.1:{args.port}",
            args.metrics_port,
            produce=not args.no_produce,
            host=args.host,
        )
    )


if __name__ == "__main__":
    main()
