"""python -m services.launcher train: a local training run, every service its own process.

Every run-config field is a flag (`--algorithm.advantage rloo`, `--env.options '{"size": 6}'`); they apply
over `--config FILE`, `OMRL_CONFIG__SECTION__FIELD` variables and `--set a.b=value`. `omrl config explain
FIELD` describes one field."""

from __future__ import annotations

import argparse
import signal
import sys

import services.plugins  # noqa: F401  (the whole run config is checked when it is parsed, as the launcher does)
from services.common.config_cli import ConfigError, ConfigFlags, Parser, UsageError
from services.common.model_context import check_local_model
from services.launcher.restarts import RESTART_STAGES, add_restart_flags

PROG = "python -m services.launcher"


def build_parser() -> tuple[Parser, ConfigFlags]:
    parser = Parser(prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True, parser_class=Parser)
    train = sub.add_parser(
        "train",
        help="run one training job locally (defaults: tiny model on corridor, GRPO)",
        usage=f"{PROG} train [--config FILE] [--set KEY=VALUE] [--SECTION.FIELD VALUE ...]",
        description="Shortcuts: --model (model.path; default: build the tiny local model), "
        "--env (env.name), --steps (learner.steps).",
    )
    train.add_argument("--debug", action="store_true", help="show tracebacks")
    train.add_argument("--plain", action="store_true", help="plain lines even on a terminal (no live view)")
    add_restart_flags(train)
    return parser, ConfigFlags(train, shortcuts=True)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser, flags = build_parser()
    try:
        args = parser.parse_args(argv)
        config = flags.resolve(args).config
        check_local_model(config.model)
    except (UsageError, ConfigError) as exc:  # one line naming the flag or field; nothing has started
        for line in getattr(exc, "lines", [str(exc)]):
            print(f"config error: {line}", file=sys.stderr)
        if "--debug" in argv:
            raise
        return 2
    from services.common.logs import setup_logging
    from services.launcher.local import LocalRun
    from services.launcher.report import PlainView

    setup_logging("launcher")
    # SIGTERM unwinds like Ctrl-C, so the run stops every service it started; SIGINT is set explicitly
    # because a shell starting us in the background leaves it ignored
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    signal.signal(signal.SIGINT, signal.default_int_handler)
    view = (
        PlainView(lambda line: print(line, flush=True))
        if args.plain or not sys.stdout.isatty()
        else TerminalView(config.learner.steps)
    )
    try:
        run = LocalRun(
            config, say=view.say, view=view, restart_delay_s=args.restart_delay_s, max_restarts=args.max_restarts
        )
        result = run.run()
    except KeyboardInterrupt:
        view.close()
        print(f"{PROG}: interrupted; every service was stopped", file=sys.stderr)
        return 130
    except Exception as exc:  # a failed run: its cause in one line, the service logs hold the rest
        view.close()
        if args.debug:
            raise
        from services.launcher.report import failure_summary

        print(
            f"{PROG}: run failed: {failure_summary(exc)} (logs in {config.run_dir / 'logs'}; --debug shows the "
            "traceback)",
            file=sys.stderr,
        )
        return 1
    finally:
        view.close()  # also on SIGTERM's exit: the terminal gets its cursor back
    return 0 if result.history else 1


class TerminalView:
    """The live view (services.cli.live) as a LocalRun view."""

    def __init__(self, total_steps: int):
        from services.cli.live import LiveView

        self.live = LiveView(total_steps)

    def say(self, line: str) -> None:
        self.live.line(line)

    def stage(self, record: dict) -> None:
        if record.get("stage") in RESTART_STAGES:
            self.live.notice(record["message"])
        else:
            self.live.stage(record["message"])

    def step(self, metrics: dict, total_steps: int) -> None:
        self.live.step(metrics)

    def close(self) -> None:
        self.live.close()


if __name__ == "__main__":
    sys.exit(main())
