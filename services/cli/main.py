"""omrl: submit a training job from a YAML file, list jobs, show one, follow its events, cancel it;
validate a spec offline, show the effective config with the source of each value, explain a field; read a
run's recorded episodes, or browse runs in the trajectory inspector.

Every job-spec field is a flag of submit, validate and config show (`--algorithm.advantage rloo`), over
the file, `OMRL_CONFIG__SECTION__FIELD` variables and `--set a.b=value`. The API's address and token come
from --api/--token or OMRL_API_URL/OMRL_API_TOKEN. Errors are one line; --debug shows tracebacks."""

from __future__ import annotations

import argparse
import json
import os
import sys

import httpx

from services.cli import render
from services.cli.client import ApiError, JobsClient
from services.common.config_cli import ConfigError, ConfigFlags, Parser, UsageError

SPEC_USAGE = "omrl {} {} [--set KEY=VALUE] [--SECTION.FIELD VALUE ...]"


def build_parser() -> tuple[Parser, dict[str, ConfigFlags]]:
    from services.jobs.spec import JobSpec

    parser = Parser(prog="omrl", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--api", default=os.environ.get("OMRL_API_URL", "http://127.0.0.1:8080"), help="job API URL")
    parser.add_argument("--token", default=os.environ.get("OMRL_API_TOKEN"), help="bearer token")
    parser.add_argument("--timeout", type=float, default=30.0, help="seconds per request")
    parser.add_argument("--debug", action="store_true", help="show tracebacks")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=Parser)
    flags: dict[str, ConfigFlags] = {}
    submit = sub.add_parser(
        "submit",
        help="submit a job spec (YAML: a run config plus resources/schedule)",
        usage=SPEC_USAGE.format("submit", "SPEC") + " [--follow]",
    )
    submit.add_argument("--follow", action="store_true", help="then follow its events until it ends")
    flags["submit"] = ConfigFlags(submit, JobSpec, spec="SPEC")
    validate = sub.add_parser(
        "validate",
        help="check a job spec offline: prints ok, or one line per error",
        usage=SPEC_USAGE.format("validate", "SPEC"),
    )
    flags["validate"] = ConfigFlags(validate, JobSpec, spec="SPEC")
    config = sub.add_parser("config", help="the effective config (show) or one field's meaning (explain)")
    config_sub = config.add_subparsers(dest="config_command", required=True, parser_class=Parser)
    show = config_sub.add_parser(
        "show",
        help="every field's value and where it came from (default, file, env, flag)",
        usage=SPEC_USAGE.format("config show", "[SPEC]") + " [--changed] [--json]",
    )
    show.add_argument("--changed", action="store_true", help="only values that are not the default")
    show.add_argument("--json", action="store_true", help="as JSON: {field: {value, source}}")
    flags["config show"] = ConfigFlags(show, JobSpec, spec="SPEC?")
    explain = config_sub.add_parser("explain", help="a field's type, default, valid choices and meaning")
    explain.add_argument(
        "field",
        nargs="?",
        default="",
        help="dotted path (algorithm.advantage) or a section (algorithm); empty: the sections",
    )
    lst = sub.add_parser("list", help="list jobs, newest first")
    lst.add_argument("--state", action="append", help="only jobs in this state (repeatable)")
    lst.add_argument("--limit", type=int, default=50)
    lst.add_argument("--json", action="store_true")
    status = sub.add_parser("status", help="one job's state, step, metrics, error")
    status.add_argument("job_id")
    status.add_argument("--json", action="store_true")
    follow = sub.add_parser("follow", help="stream a job's events with live progress until it ends")
    follow.add_argument("job_id")
    follow.add_argument("--after", type=int, default=0, help="start after this event seq")
    cancel = sub.add_parser("cancel", help="cancel a job")
    cancel.add_argument("job_id")
    cancel.add_argument("--wait", action="store_true", help="wait until its processes are gone")
    logs = sub.add_parser("logs", help="the tail of one service's log")
    logs.add_argument("job_id")
    logs.add_argument("--service", default="learner", choices=["supervisor", "envs", "reward", "rollout", "learner"])
    logs.add_argument("--tail", type=int, default=200)
    episodes = sub.add_parser(
        "episodes", help="a step's recorded episodes as transcripts: of a run folder here (runs/NAME) or of a job"
    )
    episodes.add_argument("run", help="the run's folder (its checkpoints folder's parent), or a job id (the API's)")
    episodes.add_argument("--step", type=int, help="default: the last recorded step")
    episodes.add_argument("--filter", action="append", default=[], help="KEY=VALUE, e.g. success=false (repeatable)")
    episodes.add_argument("--sort", help="reward, advantage_mean, num_turns, model_tokens or invalid_actions")
    episodes.add_argument("--ascending", action="store_true", help="sort lowest first (default: highest first)")
    episodes.add_argument("--limit", type=int, default=0, help="at most this many episodes (0: all)")
    episodes.add_argument("--json", action="store_true", help="the full records, one JSON object per line")
    inspect = sub.add_parser(
        "inspect",
        help="the trajectory inspector in the browser: serve a run folder (or a folder of runs) on 127.0.0.1, "
        "or print a job's page in the job API (--api)",
    )
    inspect.add_argument("target", help="a run folder, a folder of runs (runs/), or a job id")
    inspect.add_argument("--port", type=int, default=8765, help="port on 127.0.0.1 for a folder (0: any free one)")
    return parser, flags


class StreamClosed(Exception):
    """The server closed the event stream without the job's end event (a proxy's or the server's timeout)."""


def follow_job(client: JobsClient, job_id: str, after: int = 0, retries: int = 5, wait_s: float = 1.0) -> int:
    """Shows events until the job ends (live on a terminal, plain lines otherwise); a lost connection is
    resumed from the last seen event, up to `retries` times with exponential back-off. Exit code: 0 if it
    succeeded."""
    from tenacity import RetryCallState, Retrying, retry_if_exception_type, stop_after_attempt, wait_exponential

    total = client.get(job_id)["total_steps"]
    view = render.follow_view(total)

    def say_lost(state: RetryCallState) -> None:
        print(f"(connection lost: {state.outcome.exception()}; resuming after event {after})", file=sys.stderr)

    attempts = Retrying(
        retry=retry_if_exception_type((httpx.TransportError, httpx.StreamError, StreamClosed)),
        stop=stop_after_attempt(retries + 1),
        wait=wait_exponential(multiplier=wait_s, max=10 * wait_s),
        before_sleep=say_lost,
        reraise=True,
    )
    try:
        for attempt in attempts:
            with attempt:
                for event in client.follow(job_id, after):
                    if event["type"] == "end":
                        view.end(job_id, event["job_state"])
                        return 0 if event["job_state"] == "succeeded" else 1
                    after = event["seq"]
                    view.event(event)
                raise StreamClosed("the event stream ended before the job did")
    finally:
        view.close()
    return 1


def run(args: argparse.Namespace, flags: dict[str, ConfigFlags], client: JobsClient) -> int:
    if args.command == "submit":
        spec = flags["submit"].resolve(args).config  # the server's models: errors show before sending
        job = client.submit(spec.model_dump(mode="json", exclude_unset=True))
        print(job["id"], flush=True)
        return follow_job(client, job["id"]) if args.follow else 0
    if args.command == "list":
        page = client.list(args.state, args.limit)
        print(json.dumps(page, indent=1) if args.json else render.job_table(page["jobs"]))
        return 0
    if args.command == "status":
        job = client.get(args.job_id)
        print(json.dumps(job, indent=1) if args.json else render.job_status(job))
        return 0
    if args.command == "follow":
        return follow_job(client, args.job_id, args.after)
    if args.command == "cancel":
        job = client.cancel(args.job_id)
        print(f"{job['id']} {job['state']}")
        if args.wait and job["state"] != "cancelled":
            follow_job(client, args.job_id, after=client.events(args.job_id)["next_after"])
            job = client.get(args.job_id)
        return 0 if job["state"] in ("cancelled", "cancelling") else 1
    if args.command == "logs":
        print(client.logs(args.job_id, args.service, args.tail))
        return 0
    if args.command == "episodes":
        from services.cli.episodes_view import show

        page = client.episodes(args.run, args.step)
        print(show(page["step"], page["episodes"], args.filter, args.sort, args.limit, args.json, args.ascending))
        return 0
    raise AssertionError(args.command)


def offline(args: argparse.Namespace, flags: dict[str, ConfigFlags]) -> int:
    """Commands that need no API: validate, config show, config explain."""
    from services.cli import config_view

    if args.command == "validate":  # exit 1: the spec is not valid (2 stays a usage error)
        try:
            flags["validate"].resolve(args)
        except ConfigError as exc:
            if args.debug:
                raise
            for line in exc.lines:
                print(f"omrl: {line}", file=sys.stderr)
            return 1
        print("ok")
        return 0
    if args.config_command == "show":
        resolved = flags["config show"].resolve(args)
        print(config_view.show(resolved, args.changed, args.json))
        return 0
    from services.jobs.spec import JobSpec

    print(config_view.explain(JobSpec, args.field))
    return 0


def _main(argv: list[str]) -> int:
    parser, flags = build_parser()
    args = parser.parse_args(argv)
    if args.command in ("validate", "config"):
        return offline(args, flags)
    if args.command == "episodes" and episodes_folder(args.run) is not None:
        from services.cli.episodes_view import read_folder, show

        step, rows = read_folder(episodes_folder(args.run), args.step)
        print(show(step, rows, args.filter, args.sort, args.limit, args.json, args.ascending))
        return 0
    if args.command == "inspect":
        return inspect(args)
    if not args.token:
        raise UsageError("no token: pass --token or set OMRL_API_TOKEN")
    client = JobsClient(args.api, args.token, args.timeout)
    try:
        return run(args, flags, client)
    except ApiError as exc:
        print(f"omrl: {exc}", file=sys.stderr)
        return 1
    except httpx.HTTPError as exc:
        print(f"omrl: cannot reach {args.api}: {exc}", file=sys.stderr)
        return 1
    finally:
        client.close()


def episodes_folder(target: str):
    """`target` as a run folder on this machine, or None where it names a job (or is neither: then UsageError)."""
    import re
    from pathlib import Path

    from services.jobs.models import JOB_ID_PATTERN

    if Path(target).is_dir():
        return Path(target)
    if Path(target).exists() or not re.match(JOB_ID_PATTERN, target):
        raise UsageError(f"{target}: not a run folder, nor a job id")
    return None


def inspect(args: argparse.Namespace) -> int:
    """A folder here is served on loopback; anything else is a job id, whose page the job API serves."""
    import re
    from pathlib import Path

    from services.cli import inspector
    from services.jobs.models import JOB_ID_PATTERN

    target = Path(args.target)
    if target.is_dir():
        inspector.serve(target, args.port)
        return 0
    if target.exists() or not re.match(JOB_ID_PATTERN, args.target):
        raise UsageError(f"{args.target}: not a folder, nor a job id")
    print(inspector.job_url(args.api, args.target))
    print("(the API asks for its token: a browser opens the page once with ?token=...)", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        return _main(argv)
    except (UsageError, ConfigError) as exc:  # a bad flag, file or value: nothing was sent or started
        if "--debug" in argv:
            raise
        for line in getattr(exc, "lines", [str(exc)]):
            print(f"omrl: {line}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # `omrl ... | head`: the reader has what it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except Exception as exc:  # anything else still reads as one line
        if "--debug" in argv:
            raise
        text = str(exc).splitlines()[0] if str(exc) else ""
        print(f"omrl: {type(exc).__name__}: {text} (--debug shows the traceback)", file=sys.stderr)
        return 1
