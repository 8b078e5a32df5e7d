"""python -m services.jobs: the job API (settings from OMRL_API_* environment variables)."""

import argparse

from services.common.logs import setup_logging


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m services.jobs", description=__doc__)
    parser.add_argument("--host", default=None, help="bind address (default $OMRL_BIND_HOST, else 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8080)
    parser.add_argument("--log-level", default="info")
    args = parser.parse_args()
    setup_logging("jobs-api", args.log_level)
    import uvicorn

    from services.common.grpc_server import bind_host
    from services.jobs.app import create_app

    # log_config=None: uvicorn's loggers go through the shared setup (text or JSON) instead of its own
    uvicorn.run(
        create_app(),
        host=bind_host(args.host),
        port=args.port,
        log_level=args.log_level,
        log_config=None,
        timeout_graceful_shutdown=5,
    )


if __name__ == "__main__":
    main()
