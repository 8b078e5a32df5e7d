"""Where a rollout server's time goes between two engine requests of an episode, and around each group:
one histogram, `omrl_rollout_loop_stage_seconds{stage}`, observed by the agent loop and the producer, and
`omrl_rollout_loop_stage_in_flight{stage}`, the calls in each stage now.

Stages (each observation is one call, so `_sum` is busy time summed over concurrent episodes, not wall time):
- generate: an episode waiting on the engine for one model turn (queueing inside vLLM included, and
  weights_wait: the time the request waited for a weight update to finish before entering the engine);
- detokenize, parse, tokenize: the reply's text, its action, the next observation's tokens;
- env_create, env_step, env_close, tool_calls (one turn's tool calls): calls to the environment service
  (env_create: one per group, for all its episodes, and one per episode played again on a fresh environment);
- reward: one scoring call per group, or per episode (`reward.score_each`); reward_wait: once per group, from the
  end of its last episode's play to its last reward (the time the reward service adds to a group);
- publish: the group's encoding and its Redis write;
- slot_wait: a producer worker waiting for a group slot it may start (a fresh enough policy, a free slot).

`omrl_rollout_engine_idle_seconds_total` (services.rollout.core) is the other side: time in which the
engine had no request at all."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager

from services.common import metrics

STAGES = (
    "generate",
    "detokenize",
    "parse",
    "tokenize",
    "env_create",
    "env_step",
    "env_close",
    "tool_calls",
    "reward",
    "reward_wait",
    "publish",
    "slot_wait",
    "weights_wait",
)
# sub-millisecond stages (parsing, detokenising a short reply) need buckets below the latency ones
STAGE_BUCKETS = (0.0001, 0.00025, 0.0005, *metrics.LATENCY_BUCKETS)
LOOP_STAGE_SECONDS = metrics.preset(
    metrics.histogram(
        "rollout",
        "loop_stage_seconds",
        "Time in each stage of the agent loop and the producer (engine wait, detokenise, parse, env and "
        "reward calls, Redis writes, waits for a group slot)",
        ["stage"],
        buckets=STAGE_BUCKETS,
    ),
    *((stage,) for stage in STAGES),
)
LOOP_STAGE_IN_FLIGHT = metrics.preset(
    metrics.gauge(
        "rollout",
        "loop_stage_in_flight",
        "Calls in each stage of the agent loop now (env calls that stay here name a hung env server)",
        ["stage"],
    ),
    *((stage,) for stage in STAGES),
)
_STAGE = {stage: LOOP_STAGE_SECONDS.labels(stage) for stage in STAGES}
"""The histogram's children, looked up once (a `labels` call per observation costs more than the observation)."""
_IN_FLIGHT = {stage: LOOP_STAGE_IN_FLIGHT.labels(stage) for stage in STAGES}


class StageClock:
    """Observes stage durations into the histogram and keeps this process's totals (for tests and logs)."""

    def __init__(self) -> None:
        self.seconds: Counter[str] = Counter()
        self.calls: Counter[str] = Counter()

    def record(self, stage: str, seconds: float) -> None:
        (_STAGE.get(stage) or LOOP_STAGE_SECONDS.labels(stage)).observe(seconds)
        self.seconds[stage] += seconds
        self.calls[stage] += 1

    @contextmanager
    def time(self, stage: str) -> Iterator[None]:
        in_flight = _IN_FLIGHT.get(stage) or LOOP_STAGE_IN_FLIGHT.labels(stage)
        in_flight.inc()
        start = time.perf_counter()
        try:
            yield
        finally:
            in_flight.dec()
            self.record(stage, time.perf_counter() - start)
