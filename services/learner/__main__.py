"""python -m services.learner: the policy learner of one run (run it under torchrun for several
processes; rank 0 reads the stream and pushes weights). Every run-config field is also a flag
(`--learner.steps 10`)."""

import json

import services.plugins  # noqa: F401  (the whole run config is checked when it is parsed, as the launcher does)
from services.common.config_cli import Parser, parse_service_args
from services.common.logs import setup_logging


def main() -> None:
    parser = Parser(prog="python -m services.learner", description=__doc__)
    parser.add_argument("--metrics-port", type=int, default=None)
    parser.add_argument("--host", default=None, help="metrics bind address (default $OMRL_BIND_HOST, else 127.0.0.1)")
    parser.add_argument("--history", help="write the per-step summaries to this JSON file at the end")
    args, config = parse_service_args(parser)
    setup_logging("learner")
    from services.learner.app import build_learner

    history = build_learner(config, args.metrics_port, args.host).run()
    if args.history and history:
        with open(args.history, "w") as f:
            json.dump(history, f, indent=1)


if __name__ == "__main__":
    main()
