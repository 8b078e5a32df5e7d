"""python -m services.reward --port 50053 --metrics-port 9103 [--config file.yaml]: the reward service; its
run-config section is `reward` (`--set reward.components.goal.weight=2`, or a flag per field), and `env` names the
task dataset whose reference answers the rule scorers (exact_match, math_equiv, ...) read."""

import asyncio
import sys

import services.plugins  # noqa: F401  (the whole run config is checked when it is parsed, as the launcher does)
from services.common.config_cli import Parser, add_import_flag, parse_service_args
from services.common.logs import setup_logging


def main() -> None:
    parser = Parser(prog="python -m services.reward", description=__doc__)
    parser.add_argument("--host", default=None, help="bind address (default $OMRL_BIND_HOST, else 127.0.0.1)")
    parser.add_argument("--port", type=int, default=50053, help="gRPC port (0 picks a free one)")
    parser.add_argument("--metrics-port", type=int, default=None, help="Prometheus /metrics port")
    add_import_flag(parser, "its reward functions registered in REWARDS are served")
    parser.add_argument("--grace-s", type=float, default=5.0, help="Shutdown grace for in-flight calls")
    args, run_config = parse_service_args(parser)
    setup_logging("reward")

    from services.common.config_errors import error_lines
    from services.common.grpc_server import serve
    from services.reward.composer import RewardComposer
    from services.reward.server import add_reward_service
    from services.reward.service import RewardService

    config = run_config.reward
    try:
        composer = RewardComposer.from_config(config, run_config.env)
    except ValueError as exc:
        print(f"{parser.prog}: config error: {'; '.join(error_lines(exc))}", file=sys.stderr)
        raise SystemExit(2) from None
    service = RewardService(composer, timeout_s=config.timeout_s)
    asyncio.run(
        serve(
            "reward",
            args.port,
            [add_reward_service(service)],
            host=args.host,
            metrics_port=args.metrics_port,
            grace_s=args.grace_s,
        )
    )


if __name__ == "__main__":
    main()
