"""A synchronous run's learner waits for each step's groups and for nothing else. With `max_staleness: 0` the rollout
falls behind the learner at every step: it holds the previous version until the learner's push lands, and while
it plays the step's groups the learner checks between reads of the stream (50 ms blocks here) for servers its
registry shows behind, to push them the current version. The registry hears from a server every 2 s; before a
landed push was registered at once, and counted as landed by the learner, a heartbeat from before the push had the
learner push the same version again (issue 39's "rollout ... was behind: pushed v15"), which the server applied while
the step's requests waited; and an idle vLLM worker that missed its wake-up slept 5 s (vllm_idle.RECHECK_MS).
Counted per step: the learner's wait for the step's groups (`collect_seconds`) and its catch-up pushes."""

import statistics

import pytest

from tests.support.short_run import short_run

pytestmark = [pytest.mark.e2e]

STEPS = 8
STALL_S = 1.0
"""A step may wait this much longer than 3x the median step's wait (a loaded machine's noise); the stalls it catches
were 5 s."""


def test_the_learner_waits_for_its_groups_only_and_pushes_each_version_once(learning_tiny_model, tmp_path):
    config, history = short_run(learning_tiny_model, tmp_path, "wait", STEPS, "stream.read_block_ms=50")
    waits = [m["collect_seconds"] for m in history]
    print("learner wait per step (s):", [round(w, 3) for w in waits])
    log = (config.run_dir / "logs" / "learner.log").read_text()
    assert "was behind" not in log, [line for line in log.splitlines() if "was behind" in line]
    assert all(len(m["pushes"]) == 1 and m["pushes"][0]["ok"] for m in history)  # one push a step, applied
    median = statistics.median(waits)
    assert max(waits) <= 3 * median + STALL_S, waits
