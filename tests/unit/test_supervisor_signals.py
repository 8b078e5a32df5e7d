"""The supervisor's stop signals, wherever they land in the supervisor's own code."""

import asyncio
import os
import signal

import pytest

from services.launcher.supervisor import Stop, _install_stop_handlers


@pytest.fixture
def stop_handlers():
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGALRM)}
    _install_stop_handlers(None)
    yield
    signal.alarm(0)
    for sig, handler in previous.items():
        signal.signal(sig, handler)


def test_a_cancel_inside_an_asyncio_callback_stops_the_loop(stop_handlers):
    """The start-up's health wait runs an event loop; a SIGTERM handled inside one of its callbacks must end
    the wait with Stop, not be logged by asyncio and dropped."""
    steps = []

    async def health_wait():
        loop = asyncio.get_running_loop()
        loop.call_soon(os.kill, os.getpid(), signal.SIGTERM)  # the handler runs inside this callback
        for _ in range(3):
            await asyncio.sleep(0.01)
            steps.append("polled")

    with pytest.raises(Stop) as stopped:
        asyncio.run(health_wait())
    assert stopped.value.state == "cancelled" and stopped.value.error is None
    assert steps == [], "the wait went on after the cancel"
