"""The env service core: many concurrent episodes, each env call in a worker thread under a deadline, or on
the event loop for an env that never waits (`TextEnv.runs_inline`). Failures are typed errors
(services.common.errors), the same either way; one failing episode never affects another."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import logging
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry

from services.common import metrics
from services.common.errors import (
    DeadlineExceeded,
    FailedPrecondition,
    Internal,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    ServiceError,
)
from services.common.registry import Registry
from services.envs.base import InvalidTask, StepResult, TaskRejected, TextEnv, abandoned_text, call_deadline_at
from services.envs.messages import EnvInfo, EpisodeState, ToolCall, ToolResult
from services.envs.registry import ENVS
from services.envs.tool_host import EpisodeTools, ToolHost

ERROR_KINDS = (NotFound, InvalidArgument, FailedPrecondition, DeadlineExceeded, ResourceExhausted, Internal)

log = logging.getLogger(__name__)
TRUNCATION_MARK = "\n[observation truncated]"


@dataclass
class _Episode:
    id: str
    env_name: str
    env: TextEnv
    options: dict[str, Any]
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    done: bool = False
    broken: str | None = None
    """Why the episode can no longer be used (its env call timed out or was abandoned mid-run)."""
    running: concurrent.futures.Future | None = None
    """The latest env call; closing waits for it, as it may outlive a caller that gave up."""
    last_used: float = field(default_factory=time.monotonic)
    steps: int = 0
    tools: EpisodeTools | None = None
    """Its tools and workspace folder, where its env or the run has toolsets."""

    def close_env(self) -> None:
        _close_quietly(self.env)
        ToolHost.remove_workspace(self.tools)


def owner_of(episode_id: str) -> str | None:
    """The replica that created an episode: ids are `<replica id>.<hex>` (see services.envs.replicas)."""
    owner, sep, _ = episode_id.rpartition(".")
    return owner if sep else None


class EnvService:
    def __init__(
        self,
        *,
        step_timeout_s: float = 10.0,
        max_observation_chars: int = 4096,
        workers: int = 32,
        max_episodes: int = 4096,
        idle_ttl_s: float = 900.0,
        max_episode_steps: int = 1000,
        replica_id: str | None = None,
        envs: Registry[TextEnv] = ENVS,
        metrics_registry: CollectorRegistry | None = None,
        tools: ToolHost | None = None,
    ):
        """`max_episode_steps`: a step that reaches it ends the episode (done, info.truncated) whatever
        the env says, so a runaway client cannot keep an episode forever. `replica_id` prefixes every
        episode id so that replicas can route calls to the owner."""
        if max_observation_chars <= len(TRUNCATION_MARK):
            raise ValueError(f"max_observation_chars must exceed {len(TRUNCATION_MARK)}")
        if replica_id is not None and (not replica_id or any(ch.isspace() for ch in replica_id)):
            raise ValueError(f"replica_id must be a non-empty word, got {replica_id!r}")
        self.step_timeout_s = step_timeout_s
        self.max_observation_chars = max_observation_chars
        self.max_episodes = max_episodes
        self.max_episode_steps = max_episode_steps
        self.idle_ttl_s = idle_ttl_s
        self.replica_id = replica_id or uuid.uuid4().hex[:8]
        self.metrics_registry = metrics_registry
        self._envs = envs
        self.tools = tools or ToolHost(
            call_timeout_s=step_timeout_s, max_output_chars=max_observation_chars, metrics_registry=metrics_registry
        )
        self._episodes: dict[str, _Episode] = {}
        self._pool = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="env")
        self._last_sweep = time.monotonic()
        reg = metrics_registry
        self._m_active = metrics.gauge("envs", "active_episodes", "Open episodes", registry=reg)
        self._m_latency = metrics.histogram(
            "envs", "call_seconds", "Env call latency (create, reset, step)", ["env", "op"], registry=reg
        )
        self._m_errors = metrics.counter(
            "envs", "errors_total", "Failed calls by error kind", ["env", "kind"], registry=reg
        )
        metrics.preset(self._m_errors, *((name, kind.__name__) for name in envs.names() for kind in ERROR_KINDS))
        self._m_finished = metrics.counter(
            "envs", "episodes_finished_total", "Episodes that reached done", ["env", "success"], registry=reg
        )
        self._m_abandoned = metrics.counter(
            "envs",
            "tasks_abandoned_total",
            "Tasks an env cannot play (outside its "
            "server's range, or a reset that never answers): skipped, not retried",
            ["env", "reason"],
            registry=reg,
        )
        self._m_reaped = metrics.counter(
            "envs", "episodes_reaped_total", "Idle episodes closed by the reaper", ["env"], registry=reg
        )
        self.abandoned_tasks = 0
        self.reaped_episodes = 0

    @property
    def active(self) -> int:
        return len(self._episodes)

    async def list_envs(self) -> list[EnvInfo]:
        infos = []
        for name in self._envs.names():
            try:
                cls = self._envs.get(name)
            except Exception:  # noqa: BLE001 - one broken plugin must not hide the others
                log.exception("cannot load env %s", name)
                continue
            infos.append(EnvInfo(name, cls.description, int(cls.max_turns)))
        return infos

    async def create(self, env: str, task_index: int = 0, options: dict[str, Any] | None = None) -> EpisodeState:
        with self._errors(env if env in self._envs.names() else "unknown"):
            cls, options = self._admit(env, task_index, options, 1)
            return await self._create(env, cls, task_index, options)

    async def create_batch(
        self, env: str, task_index: int = 0, options: dict[str, Any] | None = None, count: int = 1
    ) -> list[EpisodeState | ServiceError]:
        """`count` episodes of one env and task (a group's), each built as `create` builds one: concurrently,
        each in its own worker call under its own deadline. The arguments are checked once and fail the call
        as a whole (as Create's would, or InvalidArgument for a count outside 1..max_episodes, or
        ResourceExhausted when the episodes would not all fit); an episode whose build fails is that
        error in its place of the list, in order, and the others are unaffected."""
        with self._errors(env if env in self._envs.names() else "unknown"):
            if isinstance(count, bool) or not isinstance(count, int) or not 1 <= count <= self.max_episodes:
                raise InvalidArgument(f"count must be an int in 1..{self.max_episodes}, got {count!r}")
            cls, options = self._admit(env, task_index, options, count)
            tasks = [asyncio.ensure_future(self._create(env, cls, task_index, options)) for _ in range(count)]
            try:
                await asyncio.wait(tasks)
            except asyncio.CancelledError:  # the caller is gone: nobody will close what was built
                for task in tasks:
                    task.cancel()
                    if task.done() and not task.cancelled() and task.exception() is None:
                        await self.close(task.result().episode_id)
                raise
        results = [task.exception() or task.result() for task in tasks]
        for result in results:
            if isinstance(result, ServiceError):
                self._m_errors.labels(env, type(result).__name__).inc()
            elif isinstance(result, BaseException):
                raise result  # cancelled, or a bug of ours (env failures are ServiceErrors already)
        return results

    def _admit(
        self, env: str, task_index: int, options: dict[str, Any] | None, count: int
    ) -> tuple[type[TextEnv], dict[str, Any]]:
        """Checks a create's arguments and that `count` more episodes fit; the env class and a copy of the options."""
        _check_task_index(task_index)
        if options is not None and not isinstance(options, dict):
            raise InvalidArgument(f"options must be a mapping, got {type(options).__name__}")
        try:
            cls = self._envs.get(env)
        except KeyError as exc:
            raise NotFound(exc.args[0]) from None
        self._sweep_idle()
        if len(self._episodes) + count > self.max_episodes:
            raise ResourceExhausted(
                f"{len(self._episodes)} episodes open, {count} more asked for (max {self.max_episodes}); close some"
            )
        return cls, dict(options or {})

    async def _create(self, env: str, cls: type[TextEnv], task_index: int, options: dict[str, Any]) -> EpisodeState:
        options = dict(options)  # each episode its own (an env may keep or edit what it was given)
        start = time.perf_counter()
        wanted = self.tools.wanted(cls.tools_for(options))
        tools = await self.tools.for_episode(wanted) if wanted else None

        def build() -> tuple[TextEnv, str, dict[str, Any], str | None]:
            instance = cls()
            instance.workspace = tools.workspace if tools is not None else None
            try:
                observation = instance.reset(task_index, options)
                return instance, observation, instance.episode_info(), instance.anchor_observation()
            except BaseException:
                _close_quietly(instance)
                raise

        try:
            instance, observation, info, anchor = await self._run(env, build, inline=cls.runs_inline)
        except BaseException:
            ToolHost.remove_workspace(tools)
            raise
        self._m_latency.labels(env, "create").observe(time.perf_counter() - start)
        episode_id = f"{self.replica_id}.{uuid.uuid4().hex}"
        self._episodes[episode_id] = _Episode(episode_id, env, instance, options, tools=tools)
        self._m_active.set(len(self._episodes))
        return self._state(episode_id, StepResult(observation, info=dict(info)), anchor, tools)

    async def reset(self, episode_id: str, task_index: int) -> EpisodeState:
        ep = self._get(episode_id)
        with self._errors(ep.env_name):
            _check_task_index(task_index)
            async with ep.lock:
                self._usable(ep)
                start = time.perf_counter()
                observation, info, anchor = await self._run(
                    ep.env_name,
                    lambda: (ep.env.reset(task_index, ep.options), ep.env.episode_info(), ep.env.anchor_observation()),
                    ep,
                    inline=ep.env.runs_inline,
                )
                self._m_latency.labels(ep.env_name, "reset").observe(time.perf_counter() - start)
                ep.done, ep.last_used, ep.steps = False, time.monotonic(), 0
                return self._state(episode_id, StepResult(observation, info=dict(info)), anchor, ep.tools)

    async def step(self, episode_id: str, action: str) -> EpisodeState:
        ep = self._get(episode_id)
        with self._errors(ep.env_name):
            if not isinstance(action, str):
                raise InvalidArgument(f"action must be a string, got {type(action).__name__}")
            async with ep.lock:
                self._usable(ep)
                if ep.done:
                    raise FailedPrecondition(f"episode {episode_id} is done; reset or close it")
                start = time.perf_counter()
                result, anchor = await self._run(
                    ep.env_name,
                    lambda: (ep.env.step(action), ep.env.anchor_observation()),
                    ep,
                    inline=ep.env.runs_inline,
                )
                self._m_latency.labels(ep.env_name, "step").observe(time.perf_counter() - start)
                if not isinstance(result, StepResult) or not isinstance(result.info, dict):
                    raise Internal(f"{ep.env_name}.step returned {type(result).__name__}, not a StepResult")
                ep.steps += 1
                if ep.steps >= self.max_episode_steps and not result.done:
                    result.done, result.info["truncated"] = True, f"max_episode_steps ({self.max_episode_steps})"
                ep.done, ep.last_used = bool(result.done), time.monotonic()
                if ep.done:
                    self._m_finished.labels(ep.env_name, str(bool(result.success)).lower()).inc()
                return self._state(episode_id, result, anchor)

    def env_of(self, episode_id: str) -> TextEnv:
        """The env instance playing an episode (in-process callers only: the warm-start's random tool user)."""
        return self._get(episode_id).env

    async def call_tools(
        self, episode_id: str, calls: list[ToolCall], time_left: float | None = None
    ) -> list[ToolResult]:
        """One model turn's tool calls (services.envs.tool_host): each call's failure is its own result. `time_left`:
        what the caller's deadline leaves (no call's deadline goes beyond it)."""
        ep = self._get(episode_id)
        with self._errors(ep.env_name):
            if not isinstance(calls, list) or not all(isinstance(call, ToolCall) for call in calls):
                raise InvalidArgument("calls must be a list of ToolCall")
            self._usable(ep)
            if ep.done:
                raise FailedPrecondition(f"episode {episode_id} is done; reset or close it")
            ep.last_used = time.monotonic()
            results = await self.tools.call(ep.tools or EpisodeTools(), episode_id, calls, time_left)
            ep.last_used = time.monotonic()
            return results

    async def close(self, episode_id: str) -> bool:
        """False when there was no such episode (closing is idempotent)."""
        ep, _ = self._retire(episode_id)
        return ep is not None

    async def aclose(self) -> None:
        """Closes every episode; waits (up to `step_timeout_s`) for the closes queued on the workers, which the
        pool's shutdown would otherwise cancel before they start, leaving those envs open."""
        queued = [self._retire(i)[1] for i in list(self._episodes)]
        waits = [asyncio.wrap_future(f) for f in queued if f is not None]
        if waits:
            await asyncio.wait(waits, timeout=self.step_timeout_s)
        self._pool.shutdown(wait=False, cancel_futures=True)
        await self.tools.aclose()

    def _get(self, episode_id: str) -> _Episode:
        ep = self._episodes.get(episode_id)
        if ep is None:
            self._m_errors.labels("", NotFound.__name__).inc()
            raise NotFound(f"unknown episode {episode_id!r}")
        return ep

    def _usable(self, ep: _Episode) -> None:
        if self._episodes.get(ep.id) is not ep:  # closed while this call waited for the episode's lock
            raise NotFound(f"episode {ep.id} was closed")
        if ep.broken:
            raise FailedPrecondition(f"episode {ep.id} is unusable ({ep.broken}); close it and create another")

    async def _run(
        self, env_name: str, fn: Callable[[], Any], ep: _Episode | None = None, *, inline: bool = False
    ) -> Any:
        """Calls `fn` (an env's create, reset or step) in a worker thread under the deadline, or with
        `inline` on the event loop, where nothing can stop it: only for envs that return at once."""
        deadline = time.monotonic() + self.step_timeout_s

        def call() -> Any:
            with call_deadline_at(deadline):  # an env that waits (a queue, a remote call) ends before we give up
                return fn()

        if inline:
            with self._env_errors(env_name):
                return call()
        cf = self._pool.submit(call)
        if ep is not None:
            ep.running = cf
        fut = asyncio.wrap_future(cf)
        try:
            done, _ = await asyncio.wait({fut}, timeout=self.step_timeout_s)
        except asyncio.CancelledError:
            self._abandon(cf, fut, ep, "a call was cancelled while the env was running")
            raise
        if not done:
            self._abandon(cf, fut, ep, f"a call timed out after {self.step_timeout_s:g}s")
            raise DeadlineExceeded(f"{env_name}: env call timed out after {self.step_timeout_s:g}s")
        with self._env_errors(env_name):
            return fut.result()

    @contextlib.contextmanager
    def _env_errors(self, env_name: str) -> Iterator[None]:
        """What an env call raised, as the service's typed errors."""
        try:
            yield
        except TaskRejected as exc:
            self.abandoned_tasks += 1
            self._m_abandoned.labels(env_name, exc.reason).inc()
            log.warning("task abandoned (%s): %s", exc.reason, exc)
            raise InvalidArgument(abandoned_text(exc)) from None
        except InvalidTask as exc:
            raise InvalidArgument(str(exc)) from None
        except ServiceError:
            raise
        except Exception as exc:  # noqa: BLE001 - an env bug fails this call only
            log.exception("env %s raised", env_name)
            raise Internal(f"{env_name}: {type(exc).__name__}: {exc}") from exc

    @staticmethod
    def _abandon(cf: concurrent.futures.Future, fut: asyncio.Future, ep: _Episode | None, why: str) -> None:
        fut.add_done_callback(lambda f: f.cancelled() or f.exception())  # nobody awaits it any more
        if cf.cancel():  # never started: the env is untouched
            return
        if ep is not None:
            # the worker thread cannot be stopped, so the env's state is unknown from here on
            ep.broken = why
        else:
            cf.add_done_callback(_close_built)

    def _retire(self, episode_id: str) -> tuple[_Episode | None, concurrent.futures.Future | None]:
        """Takes the episode out of the table (the active gauge follows) and closes its env later."""
        ep = self._episodes.pop(episode_id, None)
        self._m_active.set(len(self._episodes))
        return ep, (self._close_later(ep) if ep is not None else None)

    def _close_later(self, ep: _Episode) -> concurrent.futures.Future | None:
        """Closes the env (in a worker unless it runs inline) once any call still running on it has returned;
        the worker's future when the close was queued."""
        if ep.env.runs_inline and ep.tools is None:
            ep.close_env()
            return None
        if ep.running is not None and not ep.running.done():
            ep.running.add_done_callback(lambda _: ep.close_env())
            return None
        try:
            return self._pool.submit(ep.close_env)
        except RuntimeError:  # pool already shut down
            ep.close_env()
            return None

    def _sweep_idle(self) -> None:
        now = time.monotonic()
        if now - self._last_sweep < 1.0:
            return
        self.reap_idle(now)

    def reap_idle(self, now: float | None = None) -> int:
        """Closes every episode idle for longer than `idle_ttl_s` (its caller is gone: a crashed rollout,
        a script that never closed); returns how many."""
        now = time.monotonic() if now is None else now
        self._last_sweep, reaped = now, 0
        for ep in list(self._episodes.values()):
            if now - ep.last_used > self.idle_ttl_s and not ep.lock.locked():
                log.info("closing episode %s (%s) idle for %.0fs", ep.id, ep.env_name, now - ep.last_used)
                self._retire(ep.id)
                self._m_reaped.labels(ep.env_name).inc()
                reaped += 1
        self.reaped_episodes += reaped
        return reaped

    async def reap_forever(self, period_s: float | None = None) -> None:
        """The idle-episode reaper: runs until cancelled, every `period_s` (default a tenth of the TTL,
        1 s to 60 s), so idle episodes are closed even when no Create arrives."""
        period_s = period_s or min(max(self.idle_ttl_s / 10, 1.0), 60.0)
        while True:
            await asyncio.sleep(period_s)
            try:
                self.reap_idle()
            except Exception:  # noqa: BLE001 - the reaper must outlive one bad close
                log.exception("idle-episode reaper failed; it runs again in %.0fs", period_s)

    def _state(
        self, episode_id: str, result: StepResult, anchor: str | None = None, tools: EpisodeTools | None = None
    ) -> EpisodeState:
        """`anchor`: the env's `anchor_observation()` after the call (None: the observation as sent); both
        are capped at `max_observation_chars`."""
        try:
            observation, reward, info = str(result.observation), float(result.reward), _jsonable(result.info)
        except (TypeError, ValueError) as exc:
            raise Internal(f"env returned a malformed StepResult: {exc}") from None
        if len(observation) > self.max_observation_chars:
            observation = observation[: self.max_observation_chars - len(TRUNCATION_MARK)] + TRUNCATION_MARK
            info["observation_truncated"] = True
        anchor = observation if anchor is None else str(anchor)[: self.max_observation_chars]
        schemas = tools.schemas() if tools is not None else []
        return EpisodeState(
            episode_id, observation, reward, bool(result.done), bool(result.success), info, anchor, schemas
        )

    @contextlib.contextmanager
    def _errors(self, env_name: str) -> Iterator[None]:
        try:
            yield
        except ServiceError as exc:
            self._m_errors.labels(env_name, type(exc).__name__).inc()
            raise


def _check_task_index(task_index: Any) -> None:
    if isinstance(task_index, bool) or not isinstance(task_index, int) or task_index < 0:
        raise InvalidArgument(f"task_index must be an int >= 0, got {task_index!r}")


def _close_quietly(env: TextEnv) -> None:
    try:
        env.close()
    except Exception:  # noqa: BLE001
        log.exception("closing env %s failed", env.name)


def _close_built(done: concurrent.futures.Future) -> None:
    """An abandoned create still builds its env: close it once built."""
    if not done.cancelled() and done.exception() is None:
        _close_quietly(done.result()[0])


def _jsonable(info: dict[str, Any]) -> dict[str, Any]:
    """What survives a protobuf Struct, so the in-process and gRPC clients return the same info."""
    return json.loads(json.dumps(info, default=str))
