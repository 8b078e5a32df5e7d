"""`omrl inspect`: the trajectory inspector. A local path is served on loopback (no token: only this machine's
users reach it); a job id names its page in the job API's inspector, which serves it behind the API's token."""

from __future__ import annotations

import socket
from pathlib import Path
from urllib.parse import quote

from services.common.config_cli import UsageError

HOST = "127.0.0.1"


def serve(path: Path, port: int) -> None:
    """Serves until interrupted; prints the URL once the port is bound (0: any free port)."""
    import uvicorn

    from services.jobs.inspector.app import create_inspector
    from services.jobs.inspector.sources.folders import FolderSource

    if not path.is_dir():
        raise UsageError(f"{path}: no such folder")
    app = create_inspector(FolderSource(path))
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((HOST, port))
    except OSError as exc:
        raise UsageError(f"cannot listen on {HOST}:{port}: {exc.strerror}") from None
    sock.listen(128)
    # bound and listening before the URL is printed: whoever reads it (a person, a test) can open it at once
    print(f"inspector: http://{HOST}:{sock.getsockname()[1]}/ (Ctrl-C stops it)", flush=True)
    uvicorn.Server(uvicorn.Config(app, log_level="warning")).run(sockets=[sock])


def job_url(api: str, job_id: str) -> str:
    return f"{api.rstrip('/')}/inspect/runs/{quote(job_id)}"
