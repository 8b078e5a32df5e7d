"""The multi-turn agent loop: generate from the episode's full token context, parse the action, step
the environment, append the observation tokens, until done or a limit. Episodes run as independent
coroutines, so every live episode shares the engine through continuous batching."""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from services.common import metrics
from services.common.config import EnvConfig, RolloutConfig
from services.common.errors import InvalidArgument, ServiceError
from services.common.trajectory import Trajectory, TrajectoryBuilder
from services.engines.base import SamplingSpec
from services.envs.messages import EpisodeState
from services.rollout.action_parsers import ActionParser
from services.rollout.agent_loops import AGENT_LOOPS
from services.rollout.loop_stages import StageClock
from services.rollout.prompting import ChatFormatter

log = logging.getLogger(__name__)

ACTIVE_EPISODES = metrics.gauge("rollout", "active_episodes", "Episodes in the agent loop")
EPISODES = metrics.preset(
    metrics.counter("rollout", "episodes_total", "Finished episodes by outcome", ["outcome"]),
    ("success",),
    ("failure",),
    ("infra_error",),
)
EPISODE_RETRIES = metrics.counter(
    "rollout", "episode_retries_total", "Episodes played again on a fresh environment after an infrastructure failure"
)


class Generator(Protocol):
    async def generate(self, request_id: str, prompt_ids: Sequence[int], sampling: SamplingSpec) -> Any:
        """Returns an object with `.generation` (token_ids, logprobs, finish_reason) and `.policy_version`."""


class EpisodeFailed(RuntimeError):
    """An episode lost to infrastructure (env service, engine), not to the policy: never scored.
    `retryable` is False for failures a fresh environment cannot fix (a bad env name or options)."""

    def __init__(self, message: str, retryable: bool = True):
        super().__init__(message)
        self.retryable = retryable


@dataclass
class LoopLimits:
    max_turns: int
    max_new_tokens: int
    max_model_len: int


@AGENT_LOOPS.register("text")
class AgentLoop:
    """The text loop, and the base of every loop: groups, retries on a fresh environment and the episode's
    lifecycle live here; a loop of another kind overrides `_play`, one episode's turns."""

    def __init__(
        self,
        generator: Generator,
        env_client: Any,
        formatter: ChatFormatter,
        parser: ActionParser,
        rollout: RolloutConfig,
        env: EnvConfig,
        max_model_len: int,
        server_name: str = "",
        greedy_baseline: bool = False,
    ):
        """`greedy_baseline`: each group also plays one greedy episode, marked `baseline` (advantage `remax`)."""
        self.generator, self.envs, self.formatter, self.parser = generator, env_client, formatter, parser
        self.rollout, self.env = rollout, env
        self.limits = LoopLimits(env.max_turns, rollout.max_new_tokens, max_model_len)
        self.server_name = server_name
        self.greedy_baseline = greedy_baseline
        self.stats: Counter[str] = Counter()
        """episode_retries and episodes_failed (infrastructure failures of single attempts), for the producer."""
        self.clock = StageClock()

    def _sampling(self, budget: int, seed: int | None, greedy: bool = False) -> SamplingSpec:
        r = self.rollout
        return SamplingSpec(
            max_tokens=budget,
            temperature=0.0 if greedy else r.temperature,
            top_p=r.top_p,
            top_k=r.top_k,
            stop_token_ids=self.formatter.stop_token_ids,
            seed=seed,
        )

    async def run_group(
        self,
        task_index: int,
        group_id: str | None = None,
        seed: int | None = None,
        on_episode: Callable[[int, Trajectory], Awaitable[None]] | None = None,
    ) -> list[Trajectory]:
        """`group_size` episodes of one task, concurrently, and last the greedy baseline episode with
        `greedy_baseline`. Their environments are created in one call
        (`create_batch`), and each episode sends its first request as soon as that call returns. An
        episode lost to infrastructure (its create included) is played again on a fresh environment (up to
        env.max_episode_attempts tries); once one runs out of tries the group fails as a whole and its
        other episodes are cancelled, so a partial group never reaches advantage statistics. `on_episode(i,
        trajectory)` is awaited as episode i ends, while the others play on (the producer scores it there); an error
        it raises fails the group like a lost episode."""
        group_id = group_id or uuid.uuid4().hex
        sampled = self.rollout.group_size
        size = sampled + int(self.greedy_baseline)
        prepared: list[Any] = await self._create_group(task_index, size)

        async def episode(i: int) -> Trajectory:
            state, prepared[i] = prepared[i], None  # this episode closes it from here on
            traj = await self.run_episode_with_retries(
                task_index, group_id, None if seed is None else seed * 1000 + i, state, baseline=i >= sampled
            )
            if on_episode is not None:
                await on_episode(i, traj)
            return traj

        tasks = [asyncio.create_task(episode(i)) for i in range(size)]
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)  # cancelled episodes close their envs first
            for state in prepared:  # created for an episode that was cancelled before it started
                if isinstance(state, EpisodeState):
                    await self._close_quietly(state.episode_id)
        failed = next((t for t in tasks if t in done and not t.cancelled() and t.exception() is not None), None)
        if failed is not None:
            exc = failed.exception()
            raise EpisodeFailed(f"group {group_id} dropped: {exc}", getattr(exc, "retryable", True)) from exc
        return [t.result() for t in tasks]

    async def _create_group(self, task_index: int, count: int) -> list[EpisodeState | ServiceError]:
        """The group's environments in one call; a call that fails as a whole fails every episode's first try."""
        try:
            with self.clock.time("env_create"):
                return await self.envs.create_batch(self.env.name, task_index, self.env.options, count)
        except ServiceError as exc:
            return [exc] * count

    async def run_episode_with_retries(
        self,
        task_index: int,
        group_id: str,
        seed: int | None = None,
        state: EpisodeState | ServiceError | None = None,
        *,
        baseline: bool = False,
    ) -> Trajectory:
        """`state`: the first try's environment, already created (or the error its create ended in); `baseline`:
        the group's greedy baseline episode."""
        attempts = self.env.max_episode_attempts
        for attempt in range(1, attempts + 1):
            try:
                return await self.run_episode(
                    task_index, group_id, seed, state if attempt == 1 else None, baseline=baseline
                )
            except EpisodeFailed as exc:
                self.stats["episodes_failed"] += 1
                if not exc.retryable or attempt == attempts:
                    raise EpisodeFailed(
                        f"episode of task {task_index} failed {attempt} time(s), last: {exc}", exc.retryable
                    ) from exc
                self.stats["episode_retries"] += 1
                EPISODE_RETRIES.inc()
                log.warning(
                    "episode of task %d (group %s) lost, retrying on a fresh environment (%d/%d): %s",
                    task_index,
                    group_id,
                    attempt,
                    attempts,
                    exc,
                )
        raise AssertionError("unreachable")

    async def run_episode(
        self,
        task_index: int,
        group_id: str,
        seed: int | None = None,
        state: EpisodeState | ServiceError | None = None,
        *,
        baseline: bool = False,
    ) -> Trajectory:
        """Plays one episode on `state`'s environment (None: a new one); it is closed when this returns.
        `baseline`: greedy (temperature 0) and marked `baseline` in its record."""
        ACTIVE_EPISODES.inc()
        episode_id = state.episode_id if isinstance(state, EpisodeState) else None
        try:
            if isinstance(state, ServiceError):
                raise state
            if state is None:
                with self.clock.time("env_create"):
                    state = await self.envs.create(self.env.name, task_index, self.env.options)
                episode_id = state.episode_id
            traj = await self._play(state, task_index, group_id, seed, baseline)
            EPISODES.labels(outcome="success" if traj.success else "failure").inc()
            return traj
        except ServiceError as exc:
            EPISODES.labels(outcome="infra_error").inc()
            raise EpisodeFailed(
                f"env service: {type(exc).__name__}: {exc}", retryable=not isinstance(exc, InvalidArgument)
            ) from exc
        finally:
            ACTIVE_EPISODES.dec()
            if episode_id is not None:
                await self._close_quietly(episode_id)

    async def _play(self, state: Any, task_index: int, group_id: str, seed: int | None, baseline: bool) -> Trajectory:
        builder = TrajectoryBuilder(
            env=self.env.name,
            task_index=task_index,
            group_id=group_id,
            prompt_ids=self.formatter.initial(state.observation),
            rollout_server=self.server_name,
        )
        builder.record.baseline = baseline
        env_return, lim, anchor = 0.0, self.limits, state.anchor
        for turn in range(lim.max_turns):
            budget = min(lim.max_new_tokens, lim.max_model_len - builder.length)
            if budget <= 0:
                return builder.finish(env_return=env_return, success=False, stop_reason="max_length")
            clock = self.clock
            with clock.time("generate"):
                out = await self.generator.generate(
                    f"{builder.record.trajectory_id}-{turn}",
                    builder.record.token_ids,
                    self._sampling(budget, None if seed is None else seed + turn, greedy=baseline),
                )
            gen = out.generation
            with clock.time("detokenize"):
                text = self.formatter.decode(gen.token_ids)
            with clock.time("parse"):
                parsed = self.parser.parse(text)
            builder.add_model_turn(
                gen.token_ids,
                gen.logprobs,
                policy_version=out.policy_version,
                text=text,
                action=parsed.action,
                action_valid=parsed.valid,
                finish_reason=gen.finish_reason,
                anchor=anchor,
            )
            if parsed.valid:
                with clock.time("env_step"):
                    state = await self.envs.step(state.episode_id, parsed.action)
                env_return += state.reward
                builder.record.turns[-1].action_rejected = state.info.get("action_valid") is False
                anchor = state.anchor  # an unparsed action leaves the env, so the anchor, as it was
                if state.done:
                    builder.record.turns[-1].env_reward = state.reward
                    return builder.finish(env_return=env_return, success=state.success, stop_reason="done")
                observation, reward = state.observation, state.reward
            else:
                observation, reward = f"{self.parser.format_hint()} ({parsed.error})", 0.0
            with clock.time("tokenize"):
                obs_ids = self.formatter.observation(observation)
            if builder.length + len(obs_ids) >= lim.max_model_len:
                return builder.finish(env_return=env_return, success=False, stop_reason="max_length")
            builder.add_observation(obs_ids, env_reward=reward)
        return builder.finish(env_return=env_return, success=False, stop_reason="max_turns")

    async def _close_quietly(self, episode_id: str) -> None:
        try:
            with self.clock.time("env_close"):
                await self.envs.close(episode_id)
        except Exception as exc:  # closing is best effort: the env service may be the thing that failed
            log.debug("close of episode %s failed: %s", episode_id, exc)
