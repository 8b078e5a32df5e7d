"""vLLM's message-queue readers spin at most the configured time before blocking (vLLM's own: 1 s), and once
blocked re-read the queue every 20 ms (vLLM's own: 5 s, the cost of a lost notification)."""

import pytest

from services.common.cpu_budget import SPIN_ENV

shm_broadcast = pytest.importorskip("vllm.distributed.device_communicators.shm_broadcast")
zmq = pytest.importorskip("zmq")


def reader(tmp_path, name: str):
    return shm_broadcast.SpinCondition(
        is_reader=True, context=zmq.Context.instance(), notify_address=f"ipc://{tmp_path / name}"
    )


def test_readers_spin_only_the_configured_time(tmp_path, monkeypatch):
    from services.engines import vllm_idle

    original = shm_broadcast.SpinCondition.__init__
    monkeypatch.setattr(shm_broadcast.SpinCondition, "__init__", original)
    monkeypatch.setattr(shm_broadcast, "SHM_READER_RECHECK_INTERVAL_MS", shm_broadcast.SHM_READER_RECHECK_INTERVAL_MS)
    assert reader(tmp_path, "a").busy_loop_s == 1  # vLLM's default: what the patch is for
    monkeypatch.setenv(SPIN_ENV, "0.005")
    vllm_idle.shorten_spin_from_env()
    assert reader(tmp_path, "b").busy_loop_s == 0.005
    vllm_idle.shorten_spin(0.02)  # applied again: replaces, does not stack
    assert reader(tmp_path, "c").busy_loop_s == 0.02
    assert shm_broadcast.SpinCondition.__init__.omrl_original is original


def test_an_idle_reader_rereads_the_queue_every_recheck_ms_not_every_5_s(monkeypatch):
    """A lost notification cost a step 5 s (vLLM 0.32's recheck interval): the bench's stalls, issue 39."""
    from services.engines import vllm_idle

    monkeypatch.setattr(shm_broadcast, "SHM_READER_RECHECK_INTERVAL_MS", 5000)  # vLLM 0.32's
    monkeypatch.setattr(shm_broadcast.SpinCondition, "__init__", shm_broadcast.SpinCondition.__init__)
    idle_wait = shm_broadcast.MessageQueue.ReadTimeoutWithWarnings(timeout=None, should_warn=False)
    assert idle_wait.timeout_ms() == 5000  # what acquire_read polls for while no notification comes
    monkeypatch.setenv(SPIN_ENV, "0.005")
    vllm_idle.shorten_spin_from_env()
    assert idle_wait.timeout_ms() == vllm_idle.RECHECK_MS == 20
