"""The `agentgym` env: each episode is one environment on an AgentGym HTTP server of the configured
family, pinned to that server from create to close. Train against running servers with one entry:

    env:
      name: agentgym
      options: {family: textcraft, base_url: "http://127.0.0.1:8000"}

`base_url` may list several servers of the family; each episode goes to the one with the fewest open
episodes and stays there. At most `max_concurrent` calls are in flight per server; the others queue
here, within the caller's deadline (which grows with the queue: services.envs.deadlines). Every HTTP
call has a deadline (`timeout_s`), and every failure is a typed error: an `{"error": ...}` reply in an
HTTP 200 body (ErrorReply, INTERNAL), no reply in time (DEADLINE_EXCEEDED), a server that is gone
(UNAVAILABLE). The rollout retries such episodes on a fresh environment and never scores them. A task
the server cannot play (outside its task range, an error that says so, a reset that never answers) is
rejected instead (TaskRejected, INVALID_ARGUMENT): retrying it cannot help, so the group is dropped at
once and its slot replayed on a fresh task."""

from __future__ import annotations

import json
import logging
import random
import threading
from typing import Any

from pydantic import Field, field_validator

from services.common import trust
from services.common.errors import DeadlineExceeded, Internal, ServiceError
from services.envs.agentgym.health import HealthWatch
from services.envs.agentgym.preflight import check_servers
from services.envs.agentgym.probe import known_range, probed_range
from services.envs.agentgym.profiles import PROFILES, Profile
from services.envs.agentgym.servers import MARGIN_S, ErrorReply, Server, ServerPool
from services.envs.agentgym.tasks import TaskGate
from services.envs.base import EnvOptions, StepResult, TaskRejected, TextEnv, action_format, call_time_left
from services.envs.registry import register_env

log = logging.getLogger(__name__)


class AgentGymOptions(EnvOptions):
    family: str
    """AgentGym family: textcraft, babyai, maze, wordle, webshop, alfworld, sciworld."""
    base_url: str | list[str] = Field(json_schema_extra=trust.URL)
    """The family's server(s), e.g. http://127.0.0.1:8000 (the job API takes only hosts its operator allows)."""
    timeout_s: float = Field(8.0, gt=0, le=600)
    """Deadline of one HTTP call (keep it below the env service's step timeout)."""
    max_concurrent: int = Field(8, ge=1, le=1024)
    """Calls in flight at once per server; more queue here (an AgentGym server slows down under load)."""
    task_range: tuple[int, int] | None = None
    """[start, stop) of the task indices the servers serve; default: the family's (maze 0..24; ALFWorld:
    probed at start-up), else any."""
    max_turns: int = Field(30, ge=1, le=10000)
    """Turns after which the episode ends (done, not a success)."""
    recycle_after: int | None = Field(None, ge=1)
    """Environments a server creates before it is recycled; default: the family's (WebShop 7000)."""
    recycle_command: str | None = Field(None, json_schema_extra=trust.OPERATOR)
    """Command that restarts one server ({url} and {port} are filled in); needed to recycle. The deployment's
    to set: the job API refuses it from a job spec and adds its own (`OMRL_API_ENV_OPTIONS`)."""
    recycle_wait_s: float = Field(120.0, gt=0)
    """How long a recycled server may take to answer GET / again."""
    health_every_s: float = Field(0.5, ge=0, le=60)
    """How often each server is asked GET / (0: never): a refused connection marks a restart, so episodes
    created before it are failed; see services.envs.agentgym.health."""
    stuck_after_s: float = Field(30.0, gt=0, le=3600)
    """GET / unanswered this long: the server is out of rotation until it answers (recycled at once with a
    recycle_command)."""

    @field_validator("family")
    @classmethod
    def _known(cls, family: str) -> str:
        if family not in PROFILES:
            raise ValueError(f"unknown AgentGym family {family!r}; known: {', '.join(sorted(PROFILES))}")
        return family

    @field_validator("task_range")
    @classmethod
    def _ordered(cls, bounds: tuple[int, int] | None) -> tuple[int, int] | None:
        if bounds is not None and not 0 <= bounds[0] < bounds[1]:
            raise ValueError(f"task_range must be [start, stop) with 0 <= start < stop, got {list(bounds)}")
        return bounds

    @property
    def urls(self) -> list[str]:
        return [self.base_url] if isinstance(self.base_url, str) else list(self.base_url)

    def tasks(self) -> range | None:
        bounds = self.task_range or PROFILES[self.family].task_range
        return None if bounds is None else range(*bounds)

    @property
    def servers_key(self) -> str:
        return json.dumps([self.family, self.urls])


# Shared by every episode of this process: the servers' HTTP connections and their open-episode and
# creation counts are per server, while the service builds one env instance per episode.
_POOLS: dict[str, ServerPool] = {}
_POOLS_LOCK = threading.Lock()


def pool_for(opts: AgentGymOptions, profile: Profile) -> ServerPool:
    key = json.dumps(
        [
            opts.family,
            opts.urls,
            opts.timeout_s,
            opts.recycle_after,
            opts.recycle_command,
            opts.recycle_wait_s,
            opts.max_concurrent,
            opts.health_every_s,
            opts.stuck_after_s,
        ]
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
                family=opts.family,
                max_concurrent=opts.max_concurrent,
                profile=profile,
                tasks=TaskGate(),
                watch=_watch(opts),
            )
        return _POOLS[key]


def _watch(opts: AgentGymOptions):
    if not opts.health_every_s:
        return None
    return lambda pool: HealthWatch(pool, opts.health_every_s, min(opts.timeout_s, 2.0), opts.stuck_after_s)


@register_env("agentgym")
class AgentGymEnv(TextEnv):
    description = "An environment on an AgentGym server (TextCraft, BabyAI, Maze, Wordle, WebShop, ALFWorld, SciWorld)."
    max_turns = 30
    Options = AgentGymOptions
    offline_prompts = False

    server: Server | None = None
    remote_id: Any = None
    epoch: int | None = None
    """The server's epoch when this episode's environment was created (Server.epoch)."""
    task_index: int | None = None

    @classmethod
    def task_range(cls, options: dict | None) -> range | None:
        """The configured or known range; for a family whose server indexes a loaded list, probed on
        its first server (once per process: the launcher's datasets and warm-start ask here)."""
        try:
            opts = cls.parse_options(options)
        except Exception:  # noqa: BLE001 - bad options fail at reset, with their message
            return None
        profile = PROFILES[opts.family]
        if opts.tasks() is not None or not profile.probe_range:
            return opts.tasks()
        return probed_range(opts.servers_key, pool_for(opts, profile).servers[0], profile)

    @classmethod
    def preflight(cls, options: dict | None) -> str:
        """Every server answers GET /, and creates (and closes) an environment in the family's shape."""
        opts = cls.parse_options(options)
        return check_servers(opts.family, opts.urls, opts.timeout_s)

    @classmethod
    def call_capacity(cls, options: dict | None) -> int | None:
        """Every server serves `max_concurrent` calls at once."""
        try:
            opts = cls.parse_options(options)
        except Exception:  # noqa: BLE001 - bad options fail at reset, with their message
            return None
        return len(opts.urls) * opts.max_concurrent

    def reset(self, task_index: int, options: dict) -> str:
        opts = self.parse_options(options)
        self.close()  # a second reset of this episode starts on a fresh remote environment
        self.profile, self.max_turns, self.turn = PROFILES[opts.family], opts.max_turns, 0
        p, tasks = self.profile, opts.tasks() or known_range(opts.servers_key)
        if tasks is not None and task_index not in tasks:
            raise TaskRejected(
                f"AgentGym {p.family}: task {task_index} is outside the tasks its server serves "
                f"({tasks.start}..{tasks.stop - 1})"
            )
        self.pool = pool_for(opts, p)
        left = call_time_left()
        with self.pool.tasks.first_reset(task_index, None if left is None else left - MARGIN_S):
            self.server, self.task_index = self.pool.acquire(), task_index
            try:
                kwargs = {} if p.create_body is None else {"json": p.create_body}
                before = self.server.before_create()
                created = self.server.call("POST", p.route("create"), "create", **kwargs)
                self.remote_id = _remote_id(created if p.create_returns == "bare" else _field(created, "id", "create"))
                self.epoch = self.server.note_created(self.remote_id, before)
                self.server.count_live(+1)
                reply = self._reset_call(task_index)
                observation = reply[0] if p.reset_returns == "pair" else _field(reply, "observation", "reset")
            except BaseException:
                self.close()
                raise
        self.last_observation = str(observation)
        return f"{observation}\n{p.action_help} {action_format(p.action_example)}"

    def _reset_call(self, task_index: int) -> Any:
        p, server = self.profile, self.server
        tasks = self.pool.tasks
        try:
            reply = server.call(
                "POST",
                p.route("reset"),
                f"reset env {self.remote_id}, task {task_index}",
                epoch=self.epoch,
                json={p.id_field: self.remote_id, p.task_field: task_index, **p.reset_extra},
            )
            tasks.proved(task_index)
            return reply
        except ErrorReply as exc:
            if p.rejects_task(exc.text):
                rejected = TaskRejected(
                    f"AgentGym {p.family} server {server.url} rejects task {task_index}: "
                    f"{exc.text.strip() or '(an empty error: a failed assertion)'}"
                )
                tasks.reject(task_index, rejected)
                raise rejected from exc
            raise
        except DeadlineExceeded as exc:
            # after queueing the server had less than timeout_s: slow or hung, it cannot tell; the
            # episode is retried once, and a second such reset of the task counts as hung
            if not getattr(exc, "full_wait", False) and tasks.cut_short(task_index) < 2:
                raise
            log.warning(
                "AgentGym %s server %s: reset of task %d did not answer (%s); task abandoned (the server "
                "may stay busy on it until restarted)",
                p.family,
                server.url,
                task_index,
                "within timeout_s" if getattr(exc, "full_wait", False) else "twice, after queueing",
            )
            hung = TaskRejected(
                f"AgentGym {p.family} server {server.url}: reset of task {task_index} never answered ({exc})", "hung"
            )
            tasks.reject(task_index, hung)
            raise hung from exc

    def anchor_observation(self) -> str:
        """The server's last observation, without the action help of the first one; an action refused
        here leaves it as it was."""
        return self.last_observation

    def episode_info(self) -> dict:
        if self.server is None:
            return {}
        return {
            "family": self.profile.family,
            "server": self.server.url,
            "remote_id": self.remote_id,
            "task_index": self.task_index,
        }

    def step(self, action: str) -> StepResult:
        p = self.profile
        cleaned = p.clean_action(action)
        if p.valid_actions is not None and cleaned not in p.valid_actions:
            return self._not_understood(action)
        try:
            reply = self.server.call(
                "POST",
                p.route("step"),
                f"step env {self.remote_id}, task {self.task_index}",
                epoch=self.epoch,
                json={p.id_field: self.remote_id, "action": cleaned},
            )
        except DeadlineExceeded as exc:
            # the server had all of timeout_s; a second such step of the task and no episode plays it again
            if getattr(exc, "full_wait", False) and self.pool.tasks.step_hung(self.task_index) >= 2:
                self.pool.tasks.reject(
                    self.task_index,
                    TaskRejected(
                        f"AgentGym {p.family} server {self.server.url}: steps of task {self.task_index} never "
                        f"answered, twice (last: {exc})",
                        "hung",
                    ),
                )
            raise
        self.turn += 1
        observation = str(_field(reply, p.observation_key, "step"))
        reward, done = float(reply.get("reward") or 0.0), bool(reply.get("done"))
        success = bool(p.success(reward, done, reply))
        info = {"turn": self.turn, "server": self.server.url, "remote_id": self.remote_id, "action_valid": True}
        if isinstance(reply, dict) and isinstance(reply.get("score"), (int, float)):
            info["score"] = reply["score"]
        if not done and self.turn >= self.max_turns:
            done, observation = True, f"{observation}\nOut of turns."
        self.last_observation = observation
        return StepResult(observation, reward, done, success, info)

    def _not_understood(self, action: str) -> StepResult:
        """The server would ignore it without a word: say so here, and count the turn."""
        self.turn += 1
        observation = (
            f"Action not understood: {action.strip()[:60]!r}. Answer exactly one of: "
            f"{', '.join(self.profile.valid_actions)}."
        )
        done = self.turn >= self.max_turns
        if done:
            observation += "\nOut of turns."
        return StepResult(
            observation,
            0.0,
            done,
            False,
            {"turn": self.turn, "server": self.server.url, "remote_id": self.remote_id, "action_valid": False},
        )

    def random_action(self, rng: random.Random) -> str:
        p = self.profile
        if p.vocabulary_route is None:
            return p.random_action(self.last_observation, rng)
        return p.random_action(self.last_observation, rng, self._vocabulary())

    def _vocabulary(self) -> list[str] | None:
        """The words the server still accepts in this episode (Wordle's filtered vocabulary)."""
        try:
            words = self.server.call(
                "GET",
                self.profile.route(self.profile.vocabulary_route),
                "vocabulary",
                epoch=self.epoch,
                params={"id": self.remote_id},
            )
        except ServiceError as exc:
            log.info("AgentGym %s: no vocabulary (%s); random letters instead", self.profile.family, exc)
            return None
        return [w.strip() for w in words if isinstance(w, str) and w.strip()] if isinstance(words, list) else None

    def close(self) -> None:
        """A close that fails or is refused is left to the pool's health watch to retry; one for an environment
        of an earlier epoch (the server restarted since) is not sent: its id may be another episode's now."""
        server, remote_id, epoch = self.server, self.remote_id, self.epoch
        self.server = self.remote_id = self.epoch = None
        if server is None:
            return
        try:
            if remote_id is not None and self.profile.has_close:
                if server.close_checked:
                    server.close_env(self.profile.route("close"), remote_id, epoch)
                else:  # the first closes go one at a time, so a missing /close is called once, not by all
                    with server.close_probe:
                        server.close_env(self.profile.route("close"), remote_id, epoch)
        finally:
            self.pool.release(server)


def _remote_id(value: Any) -> Any:
    """Ids are ints in every family; a JSON float like 3.0 is still id 3."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


def _field(reply: Any, key: str, what: str) -> Any:
    if not isinstance(reply, dict) or key not in reply:
        raise Internal(f"AgentGym {what} reply has no {key!r}: {str(reply)[:200]}")
    return reply[key]
