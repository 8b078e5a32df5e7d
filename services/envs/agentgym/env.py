"""The `agentgym` env: each episode is one environment on an AgentGym HTTP server of the configured
family, pinned to that server from create to close. Train against running servers with one entry:

    env:
      name: agentgym
      options: {family: textcraft, base_url: "http://127.0.0.1:8000"}

`base_url` may list several servers of the family; each episode goes to the one with the fewest open
episodes and stays there. Every call has a deadline (`timeout_s`), and every failure is a typed
error: an `{"error": ...}` reply in an HTTP 200 body (ErrorReply, INTERNAL), no reply in time
(DEADLINE_EXCEEDED), a server that is gone (UNAVAILABLE). The rollout retries such episodes on a
fresh environment and never scores them."""

from __future__ import annotations

import json
import logging
import random
import threading
from typing import Any

from pydantic import Field, field_validator

from services.common.errors import Internal, ServiceError
from services.envs.agentgym.profiles import PROFILES, Profile
from services.envs.agentgym.servers import Server, ServerPool
from services.envs.base import EnvOptions, StepResult, TextEnv, action_format
from services.envs.registry import register_env

log = logging.getLogger(__name__)


class AgentGymOptions(EnvOptions):
    family: str
    """AgentGym family: textcraft, babyai, maze, wordle, webshop, alfworld, sciworld."""
    base_url: str | list[str]
    """The family's server(s), e.g. http://127.0.0.1:8000."""
    timeout_s: float = Field(8.0, gt=0, le=600)
    """Deadline of one HTTP call (keep it below the env service's step timeout)."""
    max_turns: int = Field(30, ge=1, le=10000)
    """Turns after which the episode ends (done, not a success)."""
    recycle_after: int | None = Field(None, ge=1)
    """Environments a server creates before it is recycled; default: the family's (WebShop 7000)."""
    recycle_command: str | None = None
    """Command that restarts one server ({url} and {port} are filled in); needed to recycle."""
    recycle_wait_s: float = Field(120.0, gt=0)
    """How long a recycled server may take to answer GET / again."""

    @field_validator("family")
    @classmethod
    def _known(cls, family: str) -> str:
        if family not in PROFILES:
            raise ValueError(f"unknown AgentGym family {family!r}; known: {', '.join(sorted(PROFILES))}")
        return family

    @property
    def urls(self) -> list[str]:
        return [self.base_url] if isinstance(self.base_url, str) else list(self.base_url)


# Shared by every episode of this process: the servers' HTTP connections and their open-episode and
# creation counts are per server, while the service builds one env instance per episode.
_POOLS: dict[str, ServerPool] = {}
_POOLS_LOCK = threading.Lock()


def pool_for(opts: AgentGymOptions, profile: Profile) -> ServerPool:
    key = json.dumps(
        [opts.family, opts.urls, opts.timeout_s, opts.recycle_after, opts.recycle_command, opts.recycle_wait_s]
    )
    with _POOLS_LOCK:
        if key not in _POOLS:
            _POOLS[key] = ServerPool(
                opts.urls,
                opts.timeout_s,
                opts.recycle_after or profile.recycle_after,
                opts.recycle_command,
                opts.recycle_wait_s,
                profile.id_reuse_after,
            )
        return _POOLS[key]


@register_env("agentgym")
class AgentGymEnv(TextEnv):
    description = "An environment on an AgentGym server (TextCraft, BabyAI, Maze, Wordle, WebShop, ALFWorld, SciWorld)."
    max_turns = 30
    Options = AgentGymOptions
    offline_prompts = False

    server: Server | None = None
    remote_id: Any = None

    def reset(self, task_index: int, options: dict) -> str:
        opts = self.parse_options(options)
        self.close()  # a second reset of this episode starts on a fresh remote environment
        self.profile, self.max_turns, self.turn = PROFILES[opts.family], opts.max_turns, 0
        self.pool = pool_for(opts, self.profile)
        self.server = self.pool.acquire()
        p = self.profile
        try:
            kwargs = {} if p.create_body is None else {"json": p.create_body}
            created = self.server.call("POST", p.route("create"), "create", **kwargs)
            self.remote_id = created if p.create_returns == "bare" else _field(created, "id", "create")
            reply = self.server.call(
                "POST",
                p.route("reset"),
                f"reset env {self.remote_id}",
                json={p.id_field: self.remote_id, p.task_field: task_index},
            )
            observation = reply[0] if p.reset_returns == "pair" else _field(reply, "observation", "reset")
        except BaseException:
            self.close()
            raise
        self.last_observation = str(observation)
        return f"{observation}\n{p.action_help} {action_format(p.action_example)}"

    def step(self, action: str) -> StepResult:
        p = self.profile
        reply = self.server.call(
            "POST",
            p.route("step"),
            f"step env {self.remote_id}",
            json={p.id_field: self.remote_id, "action": p.clean_action(action)},
        )
        self.turn += 1
        observation = str(_field(reply, p.observation_key, "step"))
        reward, done = float(reply.get("reward") or 0.0), bool(reply.get("done"))
        success = bool(p.success(reward, done, reply))
        info = {"turn": self.turn, "server": self.server.url, "remote_id": self.remote_id}
        if not done and self.turn >= self.max_turns:
            done, observation = True, f"{observation}\nOut of turns."
        self.last_observation = observation
        return StepResult(observation, reward, done, success, info)

    def random_action(self, rng: random.Random) -> str:
        return self.profile.random_action(self.last_observation, rng)

    def close(self) -> None:
        server, remote_id = self.server, self.remote_id
        self.server = self.remote_id = None
        if server is None:
            return
        try:
            if remote_id is not None and self.profile.has_close:
                server.call("POST", self.profile.route("close"), f"close env {remote_id}", json={"id": remote_id})
        except ServiceError as exc:
            log.info("closing AgentGym env %s on %s failed: %s", remote_id, server.url, exc)
        finally:
            self.pool.release(server)


def _field(reply: Any, key: str, what: str) -> Any:
    if not isinstance(reply, dict) or key not in reply:
        raise Internal(f"AgentGym {what} reply has no {key!r}: {str(reply)[:200]}")
    return reply[key]
