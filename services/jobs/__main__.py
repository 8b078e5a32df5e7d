"""python -m services.jobs: the job API (settings from OMRL_API_* environment variables)."""
import argparse
import logging


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m services.jobs", description=__doc__)
    parser.add_argument("--host", default="0.0.0.0")
    parser.add_argument("--port", type=int, default=8080)
    parser.add_argument("--log-level", default="info")
    args = parser.parse_args()
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s jobs-api %(levelname)s %(message)s")
    import uvicorn

    from services.jobs.app import create_app

    uvicorn.run(create_app(), host=args.host, port=args.port, log_level=args.log_level,
                timeout_graceful_shutdown=5)


if __name__ == "__main__":
    main()
