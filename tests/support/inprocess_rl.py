"""RL in one process, deterministic: the real learner (`PolicyTrainer`), the real environment classes, prompt
format, action parser and reward functions, and a policy sampled with torch from the trainer's own weights.

No services run: each step plays `groups_per_step` groups of `group_size` episodes in lockstep (every live
episode's next reply sampled in one batched forward), scores them with the configured reward functions, trains
one step on them and copies the new weights into the sampler (the weight push). An episode is built as the
rollout's agent loop builds it (services/rollout/agent_loop.py `AgentLoop._play`): the same prompt and
observation tokens, per-turn anchors and env rewards, an unparsed reply answered with the parser's format hint
(one difference: a turn's token budget is the smallest of the live episodes', which matters only near
`model.max_model_len`).

Given the seed the whole loop is deterministic: tasks and samples are drawn from seeded generators, torch runs
with deterministic algorithms on a fixed number of threads (both restored afterwards), and the batch order is
fixed, so two runs of one seed give the same success curve.

With `algorithm.dynamic_sampling` a group whose episodes all got the same reward (the learner's `same_reward`) is
dropped, as the learner drops it, and a group on a fresh task (from a generator of its own, so each step's first
groups are the same tasks with or without it) is played in its place until the step has `groups_per_step`
informative groups; past `dynamic_sampling_max_gen_batches` the step fails with the learner's
`DynamicSamplingExhausted`. With `env.validation_every` the policy plays each held-out task (the validation split,
as services/rollout/evaluation.py plays it) once at `env.validation_temperature` whenever its version is a
multiple of it, 0 included, from a generator of its own: validation leaves the training draws as they are.
"""

from __future__ import annotations

import contextlib
import random
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch

from services.common.config import EnvConfig, TrainConfig, load_config
from services.common.trajectory import Trajectory, TrajectoryBuilder
from services.learner.service import by_group, check_sampling_budget, same_reward, uniform_groups

RECIPE = str(Path(__file__).resolve().parents[2] / "configs" / "tiny_model_rl.yaml")
RACE = [
    "learner.device=cpu",
    "rollout.groups_per_step=16",
    "rollout.group_size=2",
    "rollout.max_new_tokens=8",  # a reply is 4 tokens; one that runs on is invalid anyway
    "env.max_turns=50",  # the env's own limit ends an episode
    "algorithm.ppo_epochs=1",
    "algorithm.lr=1.5e-3",
    "algorithm.lr_warmup_steps=0",
    "algorithm.lr_schedule=constant",
]
"""The GiGPO-against-GRPO comparison's settings over the recipe (configs/tiny_model_rl.yaml): 16 groups of 2 a step
(many tasks a step), one pass, a constant lr; a step of corridor {length: 12, distance: 5, max_turns: 11} took
about 5 s on the project's loaded 2-core machine."""


def race_config(
    env: str, options: str, advantage: str, seed: int, steps: int, overrides: list[str] | None = None
) -> TrainConfig:
    """The recipe with `RACE` on `env` with `options` (YAML), one estimator, seed and step budget."""
    task = [f"env.name={env}", f"env.options={options}"]
    run = [f"algorithm.advantage={advantage}", f"seed={seed}", f"learner.steps={steps}"]
    return load_config(RECIPE, [*task, *RACE, *run, *(overrides or [])])


@dataclass
class Reply:
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str  # "stop" (a stop token, kept as its last token) or "length"


class Sampler:
    """A plain Hugging Face causal LM with the policy's weights: batched multinomial sampling (at temperature 1 the
    policy itself, as the rollout samples for training; 0: greedy) with each token's logprob under the policy, from
    a seeded generator."""

    def __init__(self, model_path: str, stop_token_ids: list[int], pad_id: int):
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
        self.stop, self.pad = set(stop_token_ids), pad_id

    def load(self, named_weights: list[tuple[str, torch.Tensor]]) -> None:
        """The learner's new weights (`PolicyTrainer.named_weights_for_push`), by Hugging Face name."""
        self.model.load_state_dict(dict(named_weights), strict=True)

    @torch.no_grad()
    def sample(
        self, contexts: list[list[int]], max_tokens: int, generator: torch.Generator, temperature: float = 1.0
    ) -> list[Reply]:
        """One reply per context (left-padded into one batch, decoded with a KV cache) of at most `max_tokens`."""
        width = max(len(c) for c in contexts)
        ids = torch.tensor([[self.pad] * (width - len(c)) + c for c in contexts])
        mask = torch.tensor([[0] * (width - len(c)) + [1] * len(c) for c in contexts])
        replies = [Reply([], [], "length") for _ in contexts]
        live = list(range(len(contexts)))
        past, step_ids = None, ids
        for _ in range(max_tokens):
            positions = (mask.cumsum(-1) - 1).clamp(min=0)[:, -step_ids.shape[1] :]
            out = self.model(
                input_ids=step_ids, attention_mask=mask, position_ids=positions, past_key_values=past, use_cache=True
            )
            past = out.past_key_values
            logprobs = torch.log_softmax(out.logits[:, -1].float(), dim=-1)
            tokens = _draw(logprobs, temperature, generator)
            picked = logprobs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
            for row in live:
                replies[row].token_ids.append(int(tokens[row]))
                replies[row].logprobs.append(float(picked[row]))
                if int(tokens[row]) in self.stop:
                    replies[row].finish_reason = "stop"
            live = [row for row in live if replies[row].finish_reason != "stop"]
            if not live:
                break
            step_ids = tokens.unsqueeze(-1)
            mask = torch.cat([mask, torch.ones_like(step_ids)], dim=-1)
        return replies


def _draw(logprobs: torch.Tensor, temperature: float, generator: torch.Generator) -> torch.Tensor:
    if temperature == 0:
        return logprobs.argmax(-1)
    weights = logprobs.exp() if temperature == 1 else torch.softmax(logprobs / temperature, dim=-1)
    return torch.multinomial(weights, 1, generator=generator).squeeze(-1)


@dataclass
class _Episode:
    env: object
    builder: TrajectoryBuilder
    anchor: str
    env_return: float = 0.0
    record: Trajectory | None = None


def _anchor(env, observation: str) -> str:
    anchor = env.anchor_observation()
    return observation if anchor is None else str(anchor)  # as the env service reports it


@dataclass
class Rollout:
    """The agent loop's episode logic over in-process envs, every live episode's turn sampled in one batch."""

    config: TrainConfig
    sampler: Sampler
    formatter: object
    parser: object
    reward: object
    max_model_len: int = 0  # 0: the config's model.max_model_len

    def play(
        self,
        tasks: list[int],
        generator: torch.Generator,
        step: int,
        policy_version: int,
        *,
        first_group: int = 0,
        size: int | None = None,
        temperature: float = 1.0,
    ) -> list[Trajectory]:
        """`size` (default `group_size`) episodes of each task, scored: group i is `g<step>-<first_group + i>`."""
        from services.envs.registry import ENVS

        env_cfg, size = self.config.env, size or self.config.rollout.group_size
        max_len = self.max_model_len or self.config.model.max_model_len
        episodes = []
        for group, task in enumerate(tasks, start=first_group):
            for member in range(size):
                env = ENVS.create(env_cfg.name)
                observation = env.reset(task, dict(env_cfg.options))
                builder = TrajectoryBuilder(
                    env=env_cfg.name,
                    task_index=task,
                    group_id=f"g{step}-{group}",
                    prompt_ids=self.formatter.initial(observation),
                    trajectory_id=f"s{step}-g{group}-e{member}",
                )
                episodes.append(_Episode(env, builder, _anchor(env, observation)))
        for _ in range(env_cfg.max_turns):
            live = [e for e in episodes if e.record is None]
            for e in live:
                if min(self.config.rollout.max_new_tokens, max_len - e.builder.length) <= 0:
                    e.record = e.builder.finish(env_return=e.env_return, success=False, stop_reason="max_length")
            live = [e for e in live if e.record is None]
            if not live:
                break
            budget = min(self.config.rollout.max_new_tokens, *(max_len - e.builder.length for e in live))
            contexts = [list(e.builder.record.token_ids) for e in live]
            replies = self.sampler.sample(contexts, budget, generator, temperature)
            for e, reply in zip(live, replies):
                self._turn(e, reply, policy_version, max_len)
        for e in episodes:
            if e.record is None:
                e.record = e.builder.finish(env_return=e.env_return, success=False, stop_reason="max_turns")
            e.env.close()
            self.reward.score(e.record).apply_to(e.record)
        return [e.record for e in episodes]

    def _turn(self, e: _Episode, reply: Reply, policy_version: int, max_len: int) -> None:
        text = self.formatter.decode(reply.token_ids)
        parsed = self.parser.parse(text)
        e.builder.add_model_turn(
            reply.token_ids,
            reply.logprobs,
            policy_version=policy_version,
            text=text,
            action=parsed.action,
            action_valid=parsed.valid,
            finish_reason=reply.finish_reason,
            anchor=e.anchor,
        )
        if parsed.valid:
            result = e.env.step(parsed.action)
            e.env_return += result.reward
            e.builder.record.turns[-1].action_rejected = result.info.get("action_valid") is False
            e.anchor = _anchor(e.env, result.observation)
            if result.done:
                e.builder.record.turns[-1].env_reward = result.reward
                e.record = e.builder.finish(env_return=e.env_return, success=result.success, stop_reason="done")
                return
            observation, reward = result.observation, result.reward
        else:
            observation, reward = f"{self.parser.format_hint()} ({parsed.error})", 0.0
        obs_ids = self.formatter.observation(observation)
        if e.builder.length + len(obs_ids) >= max_len:
            e.record = e.builder.finish(env_return=e.env_return, success=False, stop_reason="max_length")
            return
        e.builder.add_observation(obs_ids, env_reward=reward)


@contextlib.contextmanager
def deterministic_torch(threads: int) -> Iterator[None]:
    """Deterministic algorithms on `threads` intra-op threads for the block; torch's settings restored after."""
    before_threads, before_mode = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    torch.set_num_threads(threads)
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before_mode)
        torch.set_num_threads(before_threads)


@dataclass
class Curve:
    """Per step: the trained batch's success rate and mean reward (before that step's update), the episodes played
    (dropped groups' included), the groups dynamic sampling dropped, the trained groups whose episodes all got the
    same reward (zero advantage under the group-relative estimators) and the seconds the step took (validation
    not counted). Per validated policy version: each held-out task's outcome, in `held_out` order."""

    success: list[float] = field(default_factory=list)
    reward: list[float] = field(default_factory=list)
    episodes: list[int] = field(default_factory=list)
    dropped: list[int] = field(default_factory=list)
    uniform: list[int] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)
    held_out: list[int] = field(default_factory=list)
    validation: dict[int, list[bool]] = field(default_factory=dict)
    validation_seconds: float = 0.0

    def last(self, steps: int) -> float:
        return sum(self.success[-steps:]) / steps

    def validation_success(self, version: int) -> float:
        won = self.validation[version]
        return sum(won) / len(won)


@dataclass
class Collected:
    """A step's trained batch, with what dynamic sampling played and dropped to fill it."""

    batch: list[Trajectory]
    episodes: int
    dropped: int


def held_out_tasks(env: EnvConfig) -> list[int]:
    """The validation split's task indices, the ones the rollout's evaluator plays, without writing a generated
    split to disk (services/envs/datasets.py)."""
    from services.envs.datasets import TaskSplit, split_range

    if env.dataset:
        return TaskSplit.load(env, "validation").task_indices
    return list(split_range(env, "validation"))


def validation_due(config: TrainConfig, version: int) -> bool:
    """As `services.rollout.evaluation.Evaluator.due`."""
    every = config.env.validation_every
    return every > 0 and version % every == 0 and version <= config.learner.steps


def collect(
    rollout: Rollout, tasks: list[int], refill: random.Random, generator: torch.Generator, step: int, version: int
) -> Collected:
    """The step's groups on `tasks`; with dynamic sampling, each uniform group replaced by one on a task drawn from
    `refill` (as the learner has the producers replace it) until `groups_per_step` are informative."""
    config = rollout.config
    if not config.algorithm.dynamic_sampling:
        batch = rollout.play(tasks, generator, step, version)
        return Collected(batch, len(batch), 0)
    kept: list[list[Trajectory]] = []
    episodes = dropped = 0
    while tasks:
        groups = by_group(rollout.play(tasks, generator, step, version, first_group=len(kept) + dropped))
        episodes += sum(len(members) for members in groups)
        informative = [members for members in groups if not same_reward(members)]
        kept += informative
        dropped += len(groups) - len(informative)
        check_sampling_budget(config, step + 1, dropped, len(kept))
        tasks = [refill.randrange(config.env.train_tasks) for _ in range(config.rollout.groups_per_step - len(kept))]
    return Collected([t for members in kept for t in members], episodes, dropped)


def validate(rollout: Rollout, held_out: list[int], version: int, curve: Curve) -> None:
    """Each held-out task played once by the policy of `version`, from a generator of its own."""
    start = time.perf_counter()
    config = rollout.config
    generator = torch.Generator().manual_seed(config.seed * 7_919 + version)
    played = rollout.play(held_out, generator, version, version, size=1, temperature=config.env.validation_temperature)
    curve.validation[version] = [t.success for t in played]
    curve.validation_seconds += time.perf_counter() - start


def policy_rollout(config: TrainConfig, model_path: str) -> Rollout:
    """The in-process rollout of the policy at `model_path`: its sampler, the run's prompt format, action parser
    and reward functions."""
    from transformers import AutoTokenizer

    from services.reward.composer import RewardComposer
    from services.rollout.action_parsers import PARSERS
    from services.rollout.prompting import ChatFormatter

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    formatter = ChatFormatter(tokenizer)
    sampler = Sampler(model_path, formatter.stop_token_ids, tokenizer.pad_token_id or 0)
    parser, reward = PARSERS.create(config.rollout.action_parser), RewardComposer.from_config(config.reward)
    return Rollout(config, sampler, formatter, parser, reward)


def held_out_outcomes(config: TrainConfig, model_path: str, *, threads: int = 1) -> list[bool]:
    """Each held-out task (`env.validation_tasks` of the validation split) played once by the policy at
    `model_path`, as a run's validation of v0 plays them (`env.validation_temperature`), with no training."""
    curve = Curve()
    with deterministic_torch(threads):
        validate(policy_rollout(config, model_path), held_out_tasks(config.env), 0, curve)
    return curve.validation[0]


def train(
    config: TrainConfig,
    model_path: str,
    *,
    threads: int = 1,
    say: Callable[[str], None] | None = None,
    curve: Curve | None = None,
) -> Curve:
    """`config.learner.steps` steps of `config.rollout.groups_per_step` groups on `config.env`, from `model_path`,
    seeded by `config.seed` (tasks drawn from the env's first `config.env.train_tasks` indices). `curve` (a fresh
    one by default) is filled step by step, so a caller keeps the steps done before one fails."""
    from services.learner.trainer import PolicyTrainer

    curve = Curve() if curve is None else curve
    with deterministic_torch(threads):
        trainer = PolicyTrainer(config, model_path)
        rollout = policy_rollout(config, model_path)
        sampler = rollout.sampler
        tasks_rng, refill = random.Random(f"tasks:{config.seed}"), random.Random(f"refill:{config.seed}")
        generator = torch.Generator().manual_seed(config.seed)
        curve.held_out = held_out_tasks(config.env) if config.env.validation_every else []
        for step in range(config.learner.steps):
            if validation_due(config, trainer.policy_version):
                validate(rollout, curve.held_out, trainer.policy_version, curve)
            start = time.perf_counter()
            tasks = [tasks_rng.randrange(config.env.train_tasks) for _ in range(config.rollout.groups_per_step)]
            step_groups = collect(rollout, tasks, refill, generator, step, trainer.policy_version)
            record(curve, step_groups)
            trainer.train_step(step_groups.batch)
            trainer.policy_version += 1
            sampler.load(trainer.named_weights_for_push())
            curve.seconds.append(time.perf_counter() - start)
            if say:
                say(step_line(curve))
        if validation_due(config, trainer.policy_version):
            validate(rollout, curve.held_out, trainer.policy_version, curve)
    return curve


def record(curve: Curve, step: Collected) -> None:
    batch = step.batch
    curve.success.append(sum(t.success for t in batch) / len(batch))
    curve.reward.append(sum(t.reward for t in batch) / len(batch))
    curve.episodes.append(step.episodes)
    curve.dropped.append(step.dropped)
    curve.uniform.append(uniform_groups(batch))


def step_line(curve: Curve) -> str:
    line = f"step {len(curve.success)}: success {curve.success[-1]:.0%}, reward {curve.reward[-1]:.3f}"
    if curve.dropped[-1]:
        line += f", dropped {curve.dropped[-1]} groups ({curve.episodes[-1]} episodes played)"
    return line
