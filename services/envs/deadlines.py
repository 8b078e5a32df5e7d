"""Deadlines of one env call that cover the time it queues for an env whose backend serves a limited
number of calls at once (`TextEnv.call_capacity`; AgentGym: servers x `max_concurrent`).

    in_flight = rollout servers x groups_per_step x (1 + max_staleness) x group_size
                (+ min(VALIDATION_CONCURRENCY, validation_tasks) when validation runs)
    waves     = max(1, ceil(ceil(in_flight / env.replicas) / capacity))     (1 where capacity is None)
    service   = env.step_timeout_s x waves        the env service's own deadline of one call
    routed    = service + 5 s                     a replica forwarding an episode's call to its owner
    client    = routed + 5 s                      the rollout's gRPC deadline to the env service

Tool calls the same way, with `env.max_tool_calls` calls an episode and the smallest capacity among the run's
toolsets (the python sandbox's `max_concurrent`): `tools_client = env.tool_timeout_s x tool waves + 10 s` is the
rollout's deadline of one CallTools. The env service gives each call `env.tool_timeout_s` times the waves actually
queued ahead of it (services.envs.tool_host), never beyond what is left of the CallTools deadline.

Each rollout server runs groups_per_step x (1 + max_staleness) producer workers, each playing one group
of group_size episodes at once, spread over the env-service replicas. In the worst case every one of
them calls its env at the same moment (the group's creates do), and the calls are served `capacity` at
a time in arrival order, so the last one waits `waves - 1` call times before its own: `step_timeout_s`
bounds one call that does not queue, and the deadline grows with the number of waves. The time one HTTP
call of an AgentGym server may take once it has a slot stays the option `timeout_s`."""

from __future__ import annotations

import math
from dataclasses import dataclass

from services.common.config import TrainConfig
from services.envs.registry import ENVS

VALIDATION_CONCURRENCY = 64
"""Validation episodes a rollout server plays at once (services.rollout.evaluation)."""
FORWARD_MARGIN_S = 5.0
"""How much longer than the service a forwarding replica, and than that the rollout, waits: the inner
deadline fires first, so the caller gets its typed error rather than its own timeout."""


@dataclass(frozen=True)
class EnvDeadlines:
    capacity: int | None
    """Calls the env's backend serves at once (None: no limit)."""
    waves: int
    service_s: float
    routed_s: float
    client_s: float
    tools_client_s: float = 0.0
    """The rollout's gRPC deadline of one CallTools (a turn's tool calls)."""


def episodes_in_flight(config: TrainConfig) -> int:
    """Most episodes the run's rollout servers play at once."""
    r, env = config.rollout, config.env
    per_server = r.groups_per_step * (1 + config.algorithm.max_staleness) * r.group_size
    if env.validation_every:
        per_server += min(VALIDATION_CONCURRENCY, env.validation_tasks)
    return max(1, len(r.addresses)) * per_server


def queue_waves(in_flight: int, replicas: int, capacity: int | None) -> int:
    """How many rounds of `capacity` calls one env-service replica serves before the last queued call."""
    if capacity is None:
        return 1
    per_replica = math.ceil(in_flight / max(1, replicas))
    return max(1, math.ceil(per_replica / max(1, capacity)))


def env_call_capacity(config: TrainConfig) -> int | None:
    return ENVS.get(config.env.name).call_capacity(config.env.options)


def env_deadlines(config: TrainConfig, step_timeout_s: float | None = None) -> EnvDeadlines:
    """The deadlines of one env call for this run; `step_timeout_s` replaces `env.step_timeout_s`
    (the env service's `--step-timeout-s`)."""
    base = step_timeout_s or config.env.step_timeout_s
    capacity = env_call_capacity(config)
    waves = queue_waves(episodes_in_flight(config), config.env.replicas, capacity)
    service = base * waves
    tool_waves = queue_waves(
        episodes_in_flight(config) * config.env.max_tool_calls, config.env.replicas, tool_capacity(config)
    )
    tools_client = config.env.tool_timeout_s * tool_waves + 2 * FORWARD_MARGIN_S
    return EnvDeadlines(
        capacity,
        waves,
        service,
        service + FORWARD_MARGIN_S,
        service + 2 * FORWARD_MARGIN_S,
        max(tools_client, service + 2 * FORWARD_MARGIN_S),
    )


def tool_capacity(config: TrainConfig) -> int | None:
    """The smallest capacity among the run's toolsets (the env's own and `env.tools`); None: none is limited."""
    from services.envs.tools import TOOLSETS

    env = config.env
    toolsets = {**ENVS.get(env.name).tools_for(dict(env.options)), **env.toolset_entries()}
    capacities = []
    for entry in toolsets.values():
        try:
            cls = TOOLSETS.get(str(entry.get("type")))
            capacities.append(cls.capacity_of(cls.Options.model_validate(entry.get("options") or {})))
        except Exception:  # noqa: BLE001 - a toolset that cannot be loaded here fails at the env service, by name
            continue
    known = [c for c in capacities if c]
    return min(known) if known else None
