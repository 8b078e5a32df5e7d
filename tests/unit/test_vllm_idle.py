"""vLLM's message-queue readers spin at most the configured time before blocking (vLLM's own: 1 s)."""

import pytest

from services.common.cpu_budget import SPIN_ENV

shm_broadcast = pytest.importorskip("vllm.distributed.device_communicators.shm_broadcast")
zmq = pytest.importorskip("zmq")


def reader(tmp_path, name: str):
    return shm_broadcast.SpinCondition(
        is_reader=True, context=zmq.Context.instance(), notify_address=f"ipc://{tmp_path / name}"
    )


def test_readers_spin_only_the_configured_time(tmp_path, monkeypatch):
    from services.rollout.backends import vllm_idle

    original = shm_broadcast.SpinCondition.__init__
    monkeypatch.setattr(shm_broadcast.SpinCondition, "__init__", original)
    assert reader(tmp_path, "a").busy_loop_s == 1  # vLLM's default: what the patch is for
    monkeypatch.setenv(SPIN_ENV, "0.005")
    vllm_idle.shorten_spin_from_env()
    assert reader(tmp_path, "b").busy_loop_s == 0.005
    vllm_idle.shorten_spin(0.02)  # applied again: replaces, does not stack
    assert reader(tmp_path, "c").busy_loop_s == 0.02
    assert shm_broadcast.SpinCondition.__init__.omrl_original is original
