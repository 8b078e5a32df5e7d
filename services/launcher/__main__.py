"""python -m services.launcher train: a local training run, every service its own process."""
import argparse
import signal
import sys

from services.common.config import load_config
from services.common.config_errors import error_lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser("train", help="run one training job locally (defaults: tiny model on corridor, GRPO)")
    train.add_argument("--config", help="YAML run config (services.common.config.TrainConfig)")
    train.add_argument("--model", help="Hugging Face id or local path (default: build the tiny local model)")
    train.add_argument("--env", help="built-in environment to train on")
    train.add_argument("--steps", type=int, help="learner steps")
    train.add_argument("--run", help="run name (output under runs/<run>)")
    train.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="any config override")
    args = parser.parse_args()
    overrides = [f"{k}={v}" for k, v in (("model.path", args.model), ("env.name", args.env),
                                         ("learner.steps", args.steps), ("run", args.run)) if v is not None]
    try:
        config = load_config(args.config, overrides + args.set)
    except (ValueError, OSError) as exc:  # a bad config file or override: say which field, no traceback
        for line in error_lines(exc) if isinstance(exc, ValueError) else [str(exc)]:
            print(f"config error: {line}", file=sys.stderr)
        return 2
    from services.launcher.local import LocalRun

    # SIGTERM unwinds like Ctrl-C, so the run stops every service it started; SIGINT is set explicitly
    # because a shell starting us in the background leaves it ignored
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    signal.signal(signal.SIGINT, signal.default_int_handler)
    result = LocalRun(config).run()
    return 0 if result.history else 1


if __name__ == "__main__":
    sys.exit(main())
