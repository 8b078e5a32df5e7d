"""python -m services.common.healthcheck ADDRESS: exits 0 if the service there is healthy, 1 if not.

ADDRESS is `host:port` for a gRPC server (the standard health service must answer SERVING) or an
`http://` URL (it must answer 2xx; the learner's metrics endpoint, the job API's health route).
Made for container healthchecks (compose), where no native gRPC probe exists as it does in Kubernetes."""

from __future__ import annotations

import argparse
import sys
import urllib.error
import urllib.request


def check_grpc(address: str, service: str, timeout_s: float) -> str | None:
    """None when SERVING, else why not."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(address) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout_s
            )
        except grpc.RpcError as err:
            return f"{err.code().name}: {err.details()}"
    if reply.status != health_pb2.HealthCheckResponse.SERVING:
        return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    return None


def check_http(url: str, timeout_s: float) -> str | None:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as reply:
            return None if 200 <= reply.status < 300 else f"HTTP {reply.status}"
    except urllib.error.HTTPError as err:
        return f"HTTP {err.code}"
    except (urllib.error.URLError, OSError) as err:
        return str(getattr(err, "reason", err))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m services.common.healthcheck",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("address", help="host:port (gRPC health) or http://host:port/path")
    parser.add_argument("--service", default="", help="gRPC service name to check ('' is the whole server)")
    parser.add_argument("--timeout", type=float, default=3.0, help="seconds before the check counts as failed")
    args = parser.parse_args(argv)
    if args.address.startswith(("http://", "https://")):
        problem = check_http(args.address, args.timeout)
    else:
        problem = check_grpc(args.address, args.service, args.timeout)
    if problem is not None:
        print(f"{args.address} unhealthy: {problem}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
