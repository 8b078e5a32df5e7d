"""What an env's backend does that the person running the run must hear of at once (an AgentGym server restarted,
left the rotation, came back): besides the env service's log and metrics, each is published as a `kind: alert`
entry of the run's metrics stream, which the launcher's live view, the job's events and `omrl follow` show. The
env service adds the sink (`services.envs.__main__`); without one (in-process tests, a library user) an alert is
only logged. Publishing never blocks the caller: one thread sends, a full queue drops, a failure is logged."""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)
QUEUE_SIZE = 256

_sinks: list[Callable[[dict[str, Any]], None]] = []
_queue: queue.Queue[dict[str, Any]] = queue.Queue(QUEUE_SIZE)
_sender: threading.Thread | None = None
_lock = threading.Lock()


def alert(what: str, message: str, **fields: Any) -> None:
    """Tells every sink of `message` (one line naming the server, and the task where there is one)."""
    if not _sinks:
        return
    try:
        _queue.put_nowait({"kind": "alert", "source": "envs", "what": what, "message": message, **fields})
    except queue.Full:
        log.warning("alert dropped (%d waiting): %s", QUEUE_SIZE, message)


def add_sink(sink: Callable[[dict[str, Any]], None]) -> None:
    global _sender
    with _lock:
        _sinks.append(sink)
        if _sender is None:
            _sender = threading.Thread(target=_send_forever, name="env alerts", daemon=True)
            _sender.start()


def clear_sinks() -> None:
    with _lock:
        _sinks.clear()


def _send_forever() -> None:
    while True:
        record = _queue.get()
        for sink in list(_sinks):
            try:
                sink(record)
            except Exception as exc:  # noqa: BLE001 - an alert is best effort; the log has it anyway
                log.warning("could not publish alert %r: %s", record.get("message"), exc)


def run_stream_sink(config: Any) -> Callable[[dict[str, Any]], None]:
    """Publishes to the run's metrics stream (RunState.publish_metrics), with short Redis timeouts."""
    from services.common.run_state import RunState, redis_client

    state = RunState(redis_client(config.stream.redis_url, timeout_s=2.0, retries=0), config)
    return lambda record: state.publish_metrics(0, record)
