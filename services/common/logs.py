"""One logging setup for every entry point (`python -m services.<name>`): plain lines for people, one JSON
object per line for clusters (`OMRL_LOG_FORMAT=json`, read by Loki, Cloud Logging, Elasticsearch), and no
progress bars in either. Child processes inherit the choice through the environment."""

from __future__ import annotations

import logging
import os
import sys

FORMAT_ENV = "OMRL_LOG_FORMAT"
LEVEL_ENV = "OMRL_LOG_LEVEL"
FORMATS = ("text", "json")
HTTP_CLIENT_LOGGERS = ("httpx", "httpcore", "urllib3")
"""Loggers of HTTP clients that write a line per request at INFO (a warm-start against an AgentGym server:
thousands); at WARNING unless the level is DEBUG."""


def log_format() -> str:
    value = os.environ.get(FORMAT_ENV, "text").strip().lower() or "text"
    if value not in FORMATS:
        raise ValueError(f"{FORMAT_ENV}={value!r} is not one of: {', '.join(FORMATS)}")
    return value


def quiet_progress_bars() -> None:
    """tqdm reads TQDM_DISABLE when it is imported, so this runs before transformers or vLLM are; the
    services and engine workers started from here inherit it. A bar redrawn in a log file is noise."""
    os.environ.setdefault("TQDM_DISABLE", "1")


def setup_logging(service: str, level: str | int | None = None) -> str:
    """Configures the root logger of this process for `service`; returns the format in use."""
    quiet_progress_bars()
    try:
        fmt = log_format()
    except ValueError as exc:
        raise SystemExit(f"{service}: {exc}") from None
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        from pythonjsonlogger.core import RESERVED_ATTRS
        from pythonjsonlogger.json import JsonFormatter

        handler.setFormatter(
            JsonFormatter(
                "%(asctime)s %(levelname)s %(name)s %(message)s",
                rename_fields={"asctime": "time", "levelname": "level", "name": "logger"},
                static_fields={"service": service},
                # uvicorn's ANSI-coloured copy of each message
                reserved_attrs=[*RESERVED_ATTRS, "color_message"],
            )
        )
        # vLLM's own text handler off: its records reach this one (engine workers log to stderr as before)
        os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")
    else:
        handler.setFormatter(logging.Formatter(f"%(asctime)s {service} %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(str(level or os.environ.get(LEVEL_ENV, "INFO")).upper())
    for name in HTTP_CLIENT_LOGGERS:
        logging.getLogger(name).setLevel(logging.NOTSET if root.level <= logging.DEBUG else logging.WARNING)
    logging.captureWarnings(True)
    return fmt
