"""omrl: submit a training job from a YAML file, list jobs, show one, follow its events, cancel it;
validate a spec offline.

The API's address and token come from --api/--token or OMRL_API_URL/OMRL_API_TOKEN."""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import httpx

from services.cli import render
from services.cli.client import ApiError, JobsClient
from services.common.config_errors import error_lines

FAILED_STATES = {"failed", "interrupted", "cancelled"}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="omrl", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--api", default=os.environ.get("OMRL_API_URL", "http://127.0.0.1:8080"), help="job API URL")
    parser.add_argument("--token", default=os.environ.get("OMRL_API_TOKEN"), help="bearer token")
    parser.add_argument("--timeout", type=float, default=30.0, help="seconds per request")
    sub = parser.add_subparsers(dest="command", required=True)
    submit = sub.add_parser("submit", help="submit a job spec (YAML: a run config plus resources/schedule)")
    submit.add_argument("spec", help="YAML file (services.common.config.JobSpec)")
    submit.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a spec field")
    submit.add_argument("--follow", action="store_true", help="then follow its events until it ends")
    validate = sub.add_parser("validate", help="check a job spec offline: prints ok, or one line per error")
    validate.add_argument("spec", help="YAML file (services.common.config.JobSpec)")
    validate.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a spec field")
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
    return parser


def follow_job(client: JobsClient, job_id: str, after: int = 0, retries: int = 5) -> int:
    """Prints events until the job ends; reconnects from the last seen event. Exit code: 0 if it succeeded."""
    total = client.get(job_id)["total_steps"]
    for attempt in range(retries + 1):
        try:
            for event in client.follow(job_id, after):
                if event["type"] == "end":
                    print(f"job {job_id} {event['job_state']}")
                    return 0 if event["job_state"] == "succeeded" else 1
                after = event["seq"]
                print(render.event_line(event, total), flush=True)
        except (httpx.TransportError, httpx.StreamError) as exc:
            if attempt == retries:
                raise
            print(f"(connection lost: {exc}; resuming after event {after})", file=sys.stderr)
            time.sleep(min(2 ** attempt, 10))
    return 1


def run(args: argparse.Namespace, client: JobsClient) -> int:
    if args.command == "submit":
        from services.common.config import JobSpec, load_config

        spec = load_config(args.spec, args.set, schema=JobSpec)  # the server's models: errors show before sending
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
    raise AssertionError(args.command)


def print_config_error(exc: ValueError | OSError) -> None:
    for line in error_lines(exc) if isinstance(exc, ValueError) else [str(exc)]:
        print(f"omrl: {line}", file=sys.stderr)


def validate_spec(args: argparse.Namespace) -> int:
    from services.common.config import JobSpec, load_config

    try:
        load_config(args.spec, args.set, schema=JobSpec)
    except (ValueError, OSError) as exc:
        print_config_error(exc)
        return 1
    print("ok")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "validate":
        return validate_spec(args)
    if not args.token:
        print("omrl: no token: pass --token or set OMRL_API_TOKEN", file=sys.stderr)
        return 2
    client = JobsClient(args.api, args.token, args.timeout)
    try:
        return run(args, client)
    except ApiError as exc:
        print(f"omrl: {exc}", file=sys.stderr)
        return 1
    except (ValueError, OSError) as exc:  # a bad spec file or override
        print_config_error(exc)
        return 2
    except httpx.HTTPError as exc:
        print(f"omrl: cannot reach {args.api}: {exc}", file=sys.stderr)
        return 1
    finally:
        client.close()
