"""The one configuration schema: CLI flags, config files, REST job specs, helm values and compose env
all map onto these models. Every field's docstring doubles as its help text."""

from __future__ import annotations

import hashlib
import json
import logging
import math
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)

from services.common import choices
from services.common.config_layers import file_layer, merge_layers, set_layer
from services.common.tiny_model import MODEL_SHAPE

log = logging.getLogger(__name__)
TINY_POSITIONS = MODEL_SHAPE["max_position_embeddings"]
"""Positions of the tiny model the launcher builds when `model.path` is empty."""


class Section(BaseModel):
    # NaN/Infinity pass Python's json and compare false with every bound; a stored one reads back as null
    model_config = ConfigDict(
        extra="forbid", use_attribute_docstrings=True, validate_assignment=True, allow_inf_nan=False
    )


MAX_FREE_FORM_DEPTH = 32
"""Deepest nesting of a free-form dict (itself level 1); deeper is a validation error, never a RecursionError."""
MAX_FREE_FORM_BYTES = 64 * 1024
"""Largest free-form dict, as compact JSON."""


def _check_free_form(value: dict[str, Any]) -> dict[str, Any]:
    """Bounded JSON data: finite numbers, at most MAX_FREE_FORM_DEPTH levels, MAX_FREE_FORM_BYTES as JSON.
    Walked without recursion, so any depth is refused with a message."""
    stack: list[tuple[str, Any, int]] = [("", value, 1)]
    while stack:
        path, item, depth = stack.pop()
        if isinstance(item, float) and not math.isfinite(item):
            raise ValueError(f"{path or 'value'} is {item}; numbers must be finite")
        if isinstance(item, dict):
            children = [(f"{path}.{key}" if path else str(key), child) for key, child in item.items()]
        elif isinstance(item, (list, tuple)):
            children = [(f"{path}[{i}]", child) for i, child in enumerate(item)]
        else:
            continue
        if depth > MAX_FREE_FORM_DEPTH:
            where = path if len(path) <= 80 else path[:80] + "..."
            raise ValueError(f"{where} is nested deeper than {MAX_FREE_FORM_DEPTH} levels")
        stack.extend((where, child, depth + 1) for where, child in reversed(children))
    size = len(json.dumps(value, separators=(",", ":"), default=str))
    if size > MAX_FREE_FORM_BYTES:
        raise ValueError(f"{size} bytes as JSON; free-form options take at most {MAX_FREE_FORM_BYTES}")
    return value


FreeForm = Annotated[dict[str, Any], AfterValidator(_check_free_form)]
"""Options of a plugin: bounded JSON data (`_check_free_form`); the plugin's own schema is checked beside it."""


def _plugin(kind: str) -> Any:
    """A plugin name that must be registered (the registry that declares `kind`, see `services.common.choices`)."""
    return Annotated[str, AfterValidator(choices.choice_validator(kind)), choices.PluginChoice(kind)]


RENAMED_FIELDS: dict[str, dict[str, str]] = {
    "learner": {
        "weight_dist_host": "weight_nccl_host",
        "weight_dist_port": "weight_nccl_port",
        "weight_dist_backend": "weight_nccl_backend",
        "weight_dist_timeout_s": "weight_nccl_timeout_s",
    },
}
"""Old field names still accepted, by section: old name -> new name. A config, job spec or helm value with an
old name loads into the new field (a warning, once per process, says it is deprecated); the old and the new
name together are an error naming both; a dumped config has only the new name."""

_warned_renames: set[str] = set()


def _warn_renamed(path: str, new_path: str) -> None:
    if path not in _warned_renames:
        _warned_renames.add(path)
        log.warning("config: %s is deprecated, renamed to %s; it still loads, but rename it", path, new_path)


def _rename_fields(section: str, data: Any) -> Any:
    """`data` (one section's raw values) with its old field names replaced by the new ones; both names of a field
    together raise ValueError naming both."""
    renamed = RENAMED_FIELDS.get(section, {})
    if not isinstance(data, dict) or not any(old in data for old in renamed):
        return data
    both = [(old, new) for old, new in renamed.items() if old in data and new in data]
    if both:
        raise ValueError(
            "; ".join(
                f"{section}.{new} and {section}.{old} are both set: {section}.{old} is the deprecated name of "
                f"{section}.{new}, set only {section}.{new}"
                for old, new in both
            )
        )
    out = dict(data)
    for old, new in renamed.items():
        if old in out:
            out[new] = out.pop(old)
            _warn_renamed(f"{section}.{old}", f"{section}.{new}")
    return out


def rename_old_fields(layer: dict[str, Any]) -> dict[str, Any]:
    """One config layer (a file, `--set` overrides, environment variables, flags) with the old names of renamed
    fields replaced by the new ones before the layers merge, so that a later layer's new name overrides an earlier
    layer's old one. Both names in one layer are left for validation to refuse."""
    out = layer
    for section in RENAMED_FIELDS:
        try:
            data = _rename_fields(section, layer.get(section))
        except ValueError:
            continue
        if data is not layer.get(section):
            out = {**out, section: data}
    return out


def _old_names_in_schema(section: str, schema: dict[str, Any]) -> None:
    """The old names of `section`'s renamed fields in its JSON schema, marked deprecated, so that helm values
    and job specs that still use them validate; both names of a field together are refused."""
    properties = schema.get("properties", {})
    pairs = [(old, new) for old, new in RENAMED_FIELDS.get(section, {}).items() if new in properties]
    for old, new in pairs:
        properties[old] = {
            **{key: value for key, value in properties[new].items() if key != "default"},
            "title": old.replace("_", " ").title(),
            "description": f"Deprecated name of `{new}` (set that instead; not both).",
            "deprecated": True,
        }
    if pairs:
        schema["not"] = {"anyOf": [{"required": [new, old]} for old, new in pairs]}


class ModelConfig(Section):
    path: str | None = None
    """Hugging Face model id or local directory. Empty: build the tiny local demo model."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Weights dtype for rollout and learner (float32 on CPU keeps their logprobs identical)."""
    max_model_len: int = Field(512, ge=32, le=131072)
    """Longest token context (prompt plus every turn) an episode may reach; at most the model's positions (the
    tiny model's: 1024)."""
    warmstart_steps: int = Field(150, ge=0, le=100000)
    """Supervised steps on the task format before RL, for the tiny model only (0 disables)."""
    warmstart_lr: float | None = Field(None, gt=0, le=1)
    """The warm-start's AdamW learning rate; empty: 2e-3, or 1e-3 for the tool-calling loop."""
    warmstart_warmup_steps: int = Field(0, ge=0, le=100000)
    """Warm-start steps over which the learning rate ramps up linearly (step k of N at k/N of it)."""
    warmstart_reads_observations: bool = True
    """Warm-start also trains next-token prediction on prompts and observations (the reading a pretrained
    model brings), while the actions it sees stay random: the starting success rate stays that of the
    random policy, and RL has words to key on (a hint) instead of spurious features."""

    @field_validator("max_model_len")
    @classmethod
    def _fits_the_tiny_model(cls, length: int, info: ValidationInfo) -> int:
        """The tiny model's positions are known here; a local model's are checked when the launcher starts
        (services.common.model_context)."""
        if "path" in info.data and not info.data["path"] and length > TINY_POSITIONS:
            raise ValueError(
                f"{length} is more than the {TINY_POSITIONS} positions of the tiny model (built when model.path is "
                f"empty); set it to {TINY_POSITIONS} or less, or set model.path"
            )
        return length


TOOLSET_NAME = r"^[A-Za-z][A-Za-z0-9_.-]{0,63}$"


class ToolsetConfig(Section):
    type: _plugin("toolset")
    """Registered toolset type: calculator, python, search, editor, mcp (see `services.envs.tools`)."""
    options: FreeForm = Field(default_factory=dict, validate_default=True)
    """That toolset's settings, e.g. {"corpus": "data/wiki.parquet"} for search, {"transport": "stdio",
    "command": [...]} for an MCP server."""

    @field_validator("options")
    @classmethod
    def _check_options(cls, options: dict[str, Any], info: ValidationInfo) -> dict[str, Any]:
        if "type" in info.data:  # else the type itself was rejected
            choices.check_toolset_options(info.data["type"], options)
        return options


class EnvConfig(Section):
    name: _plugin("env") = "corridor"
    """Registered environment to train on (see `services.envs.registry`)."""
    options: FreeForm = Field(default_factory=dict, validate_default=True)
    """Environment knobs, e.g. {"length": 6} for corridor difficulty."""
    address: str = "127.0.0.1:50052"
    """host:port of the environment service; several replicas as `ipv4:h1:p1,h2:p2` or one DNS name."""
    replicas: int = Field(1, ge=1, le=64)
    """Env-service processes the local launcher starts; they route each episode's calls to its owner."""
    max_turns: int = Field(6, ge=1, le=1000)
    """Turns after which an episode is cut off (stop_reason max_turns)."""
    batch_steps: bool = True
    """The rollout sends the steps of episodes that are ready together as one StepBatch call (fewer calls, the
    same per-step semantics); false: one Step call per episode turn."""
    step_timeout_s: float = Field(10.0, gt=0, le=600)
    """Deadline of one environment call that does not queue; times the queue waves of an env that serves a
    limited number of calls at once (AgentGym: servers x max_concurrent; see services/envs/deadlines.py)."""
    max_episode_attempts: int = Field(3, ge=1, le=20)
    """Tries of one episode on a fresh environment after infrastructure failures; then its group is dropped."""
    dataset: str | None = None
    """Folder with train.parquet and validation.parquet; empty: `<data_dir>/<name>`, generated on first use."""
    data_dir: str = "data"
    """Where generated task datasets are written."""
    train_tasks: int = Field(10000, ge=1, le=100_000_000)
    """Rows of a generated train split (task indices 0..train_tasks-1); tasks are drawn from the train split."""
    validation_tasks: int = Field(32, ge=1, le=100000)
    """Rows of a generated validation split (the task indices right after the train ones)."""
    validation_every: int = Field(0, ge=0, le=100_000_000)
    """Run the whole validation split whenever the policy version is a multiple of this (0: never)."""
    validation_temperature: float = Field(0.0, ge=0, le=5)
    """Sampling temperature of validation episodes (0: greedy)."""
    tools: dict[Annotated[str, Field(pattern=TOOLSET_NAME)], ToolsetConfig] = Field(default_factory=dict)
    """Toolsets the env service adds to the env's own (a tool task declares its own), by instance name; one of
    the env's names is replaced. The model sees them with `rollout.agent_loop: tools`."""
    tool_timeout_s: float = Field(10.0, gt=0, le=600)
    """Deadline of one tool call; times the queue waves ahead of it where a toolset runs a limited number of
    calls at once (the python sandbox)."""
    max_tool_calls: int = Field(4, ge=1, le=16)
    """Tool calls one model turn may make; the rest are answered with an error and counted as invalid."""

    def toolset_entries(self) -> dict[str, dict[str, Any]]:
        """`tools` as the env service takes them: {instance name: {"type", "options"}}."""
        return {name: toolset.model_dump() for name, toolset in self.tools.items()}

    @field_validator("options")
    @classmethod
    def _check_options(cls, options: dict[str, Any], info: ValidationInfo) -> dict[str, Any]:
        if "name" in info.data:  # else the name itself was rejected
            choices.check_env_options(info.data["name"], options)
        return options


class RolloutConfig(Section):
    backend: _plugin("backend") = "vllm"
    """Registered generation backend."""
    addresses: list[str] = Field(default_factory=lambda: ["127.0.0.1:50051"])
    """Rollout servers; the learner pushes weights to every one that is registered and alive."""
    gpu_memory_utilization: float = Field(0.05, gt=0, le=1)
    """vLLM KV-cache share (of RAM on CPU, of GPU memory on GPU)."""
    max_num_seqs: int = Field(256, ge=1, le=65536)
    """Most sequences the engine batches at once."""
    enforce_eager: bool = True
    """Skip CUDA-graph/compile warm-up (faster start, slower steady state)."""
    gpus: int = Field(1, ge=1, le=64)
    """GPUs of one rollout server: vLLM's tensor-parallel size (1 on CPU; scale out with more servers)."""
    engine_args: FreeForm = Field(default_factory=dict)
    """More vLLM AsyncEngineArgs, e.g. {"max_num_batched_tokens": 8192, "kv_cache_dtype": "fp8"}; checked
    against vLLM 0.32's fields (keys with their own field here, or that the backend sets, are refused)."""
    weight_staging: Literal["file", "memory"] = "file"
    """Where a rollout server stages an `nccl` weight push until its commit verifies: `file`, a spool file in
    the temp folder (page cache; on GPU bound by its writes, ~4 GB/s); `memory`, a host buffer of the set's
    size in the engine's worker, kept from push to push (pinned on GPU: one DMA copy each way; needs
    `gpus: 1` and the set's size in host memory beyond the pod's usual needs)."""
    vllm_metrics: bool = True
    """Also export vLLM's own `vllm:*` Prometheus series (request-latency histograms and more). They cost the
    rollout process about 0.5 CPU-s per 512 short requests on CPU (bench/loop_front.py, variant `prom`); the
    engine statistics on the dashboards (`omrl_rollout_engine_*`) come from the rollout's own logger either way."""
    max_new_tokens: int = Field(16, ge=1, le=32768)
    """Token budget of one model turn."""
    temperature: float = Field(1.0, ge=0, le=5)
    """Sampling temperature of training rollouts (1.0 samples the policy itself; 0 is greedy)."""
    top_p: float = Field(1.0, gt=0, le=1)
    """Nucleus sampling: keep the smallest token set holding this much probability (1.0 keeps all)."""
    top_k: int = Field(0, ge=0, le=10_000_000)
    """0 disables top-k."""
    action_parser: _plugin("action_parser") = "xml_action"
    """Registered action template; `xml_action` takes the text inside <action>...</action>."""
    agent_loop: _plugin("agent_loop") = "text"
    """Registered agent loop: `text` (each reply's action steps the env) or `tools` (the model calls the
    episode's tools in its chat format; a reply without a call is its answer)."""
    tool_parser: _plugin("tool_parser") = "hermes"
    """How the `tools` loop reads calls: `hermes` (<tool_call>{"name", "arguments"}</tool_call>, Qwen and Hermes
    models), `json` (the reply is a JSON call or list of calls), `xml_action` (<action>{"name", ...}</action>)."""
    group_size: int = Field(8, ge=1, le=1024)
    """Episodes sampled per task (GRPO group)."""
    groups_per_step: int = Field(8, ge=1, le=100_000)
    """Task groups per learner step."""
    trajectories_per_message: int = Field(0, ge=0, le=100_000)
    """Trajectories per stream entry; 0 writes one entry per group."""
    generate_timeout_s: float = Field(120.0, gt=0, le=86400)
    """Deadline of one generation call."""
    lease_ttl_s: float = Field(30.0, gt=0, le=3600)
    """A claimed group whose holder has not renewed it for this long is taken over (renewed every ttl/3)."""
    max_group_attempts: int = Field(20, ge=1, le=1000)
    """Attempts at one group slot (failures and take-overs) before it is dropped and replaced by a new slot."""
    group_retry_backoff_s: float = Field(1.0, ge=0, le=600)
    """Wait before a failed group is retried; doubles with each failure, up to 30 s."""

    @field_validator("engine_args")
    @classmethod
    def _check_engine_args(cls, engine_args: dict[str, Any], info: ValidationInfo) -> dict[str, Any]:
        if "backend" in info.data:  # else the backend itself was rejected
            choices.check_engine_args(info.data["backend"], engine_args)
        return engine_args

    @model_validator(mode="after")
    def _check_staging(self) -> RolloutConfig:
        if self.weight_staging == "memory" and self.gpus != 1:
            raise ValueError("rollout.weight_staging 'memory' stages in the engine's one worker: set rollout.gpus: 1")
        return self


class RewardComponentConfig(Section):
    weight: float = Field(1.0, ge=-1000, le=1000)
    params: FreeForm = Field(default_factory=dict)
    type: Annotated[str, Field(max_length=64)] = ""
    """The registered reward function this component runs; empty: the one its name names. Lets one function run
    as several components, each its own weight and breakdown entry (two `remote` reward servers, two reward
    models)."""

    def function(self, name: str) -> str:
        """The reward function that the component called `name` runs."""
        return self.type or name


COMPONENT_NAME = r"^[A-Za-z][A-Za-z0-9_.-]{0,63}$"


class RewardConfig(Section):
    address: str = "127.0.0.1:50053"
    """host:port of the reward service."""
    components: dict[
        Annotated[str, Field(pattern=COMPONENT_NAME), choices.PluginChoice("reward")], RewardComponentConfig
    ] = Field(
        default_factory=lambda: {
            "goal": RewardComponentConfig(weight=1.0),
            "format": RewardComponentConfig(weight=0.1),
            "length_penalty": RewardComponentConfig(weight=0.1, params={"max_tokens": 64}),
        }
    )
    """Reward components by name, each a registered reward function (its name, or its `type`) with a weight and
    params; the total is the weighted sum, and each component's raw score is in the breakdown under its name."""

    @field_validator("components")
    @classmethod
    def _check_params(cls, components: dict[str, RewardComponentConfig]) -> dict[str, RewardComponentConfig]:
        for name, component in components.items():
            function = component.function(name)
            choices.check_reward_function(name, function, named_by_type=bool(component.type))
            if function != name and choices.is_choice("reward", name):
                raise ValueError(
                    f"reward component {name!r} is named after a reward function and runs {function!r}: "
                    "name it otherwise"
                )
            choices.check_reward_params(name, component.params, function)
        return components

    allocation: Literal["last_token", "uniform_positive", "discounted"] = "last_token"
    """How a trajectory's reward is placed on its model tokens."""
    gamma: float = Field(1.0, ge=0, le=1)
    """Discount per token for `discounted` allocation."""
    timeout_s: float = Field(30.0, gt=0, le=86400)
    """Deadline of one Score call (a trajectory's reward functions together)."""
    score_each: Literal["group", "episode"] = "group"
    """When the rollout asks for rewards: `group`, once all of a group's episodes have ended, in one Score call;
    `episode`, each episode's as it ends, so a slow component's scoring overlaps the rest of the group's play
    (where a group's episodes end at different times; a reward model's or judge's batches take in the concurrent
    calls)."""

    @model_validator(mode="after")
    def _deadlines_nest(self) -> RewardConfig:
        # a component's own deadline (a judge's fallback, a remote server's error) must come before the Score call's,
        # or the call is cut off first and the whole group fails where the component would have scored it
        for name, component in self.components.items():
            own = choices.reward_deadline(component.function(name), component.params)
            if own is not None and own >= self.timeout_s:
                raise ValueError(
                    f"reward component {name!r} waits up to timeout_s={own:g} s, not below reward.timeout_s="
                    f"{self.timeout_s:g} s, the deadline of the whole Score call: lower its timeout_s or raise "
                    "reward.timeout_s"
                )
        return self


KLEstimator = Literal["kl", "abs", "mse", "low_var_kl", "k1", "k2", "k3", "kl+", "abs+", "low_var_kl+", "k1+", "k3+"]
"""verl's `kl_penalty` names (services/learner/kl.py): `+` takes the value of the estimator and k2's gradient."""


class AlgorithmConfig(Section):
    advantage: _plugin("advantage") = "grpo"
    """Registered advantage estimator: grpo, rloo, gae (critic), reinforce_plus_plus(_baseline), gigpo, opo, remax."""
    norm_adv_by_std: bool = True
    """GRPO: divide by the group std (False gives Dr.GRPO)."""
    gigpo_step_weight: float = Field(1.0, ge=0, le=1000)
    """GiGPO: weight of the step-level (anchor-state group) advantage added to the episode-level one."""
    gigpo_norm: Literal["mean_norm", "mean_std_norm"] = "mean_norm"
    """GiGPO, both levels: score minus its group's mean (`mean_norm`), or that over the group std + 1e-6."""
    gigpo_episode_stats: Literal["steps", "episodes"] = "steps"
    """GiGPO: episode-level mean and std over the group's turns (a K-turn episode counts K times) or episodes."""
    gigpo_gamma: float = Field(0.95, ge=0, le=1)
    """GiGPO: discount per turn of the step returns that anchor-state groups compare."""
    gigpo_anchor_similarity: float = Field(1.0, gt=0, le=1)
    """GiGPO: turns whose anchor observations match this closely (difflib ratio) share a group; 1: identical only."""
    gigpo_step_reward: Literal["env", "process", "env+process"] = "env+process"
    """GiGPO: a turn's reward in the step returns: the env's, its process reward (per-turn reward components), or
    their sum."""
    gigpo_invalid_action_penalty: float = Field(0.0, ge=0, le=1000)
    """GiGPO: subtracted from the reward of each turn whose action did not parse or the env refused."""
    policy_loss: _plugin("policy_loss") = "ppo_clip"
    """Registered policy loss: ppo_clip (PPO's clipped surrogate, dual-clip), gspo (sequence-level ratio), cispo
    (clipped detached ratio times log p); all clip with clip_ratio_low/high."""
    clip_ratio_low: float = Field(0.2, ge=0, le=1)
    """PPO clip below: the ratio is kept >= 1 - this for negative advantages."""
    clip_ratio_high: float = Field(0.2, ge=0, le=10)
    """PPO clip above: the ratio is kept <= 1 + this for positive advantages (> low: DAPO's clip-higher)."""
    loss_agg_mode: Literal[
        "token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"
    ] = "token-mean"
    """How token losses become the batch loss (verl's agg_loss): mean or sum over all tokens, or per sequence (sum,
    mean, or sum / loss_scale_factor) then mean."""
    loss_scale_factor: float = Field(0.0, ge=0, le=1e9)
    """seq-mean-token-sum-norm: the constant each sequence's token sum is divided by (Dr.GRPO's generation budget);
    0: the mini-batch's most model tokens in one sequence."""
    lr: float = Field(1e-3, gt=0, le=1)
    """AdamW learning rate."""
    weight_decay: float = Field(0.0, ge=0, le=100)
    """AdamW decoupled weight decay."""
    grad_clip: float = Field(1.0, gt=0, le=1e6)
    """Largest global gradient norm; larger gradients are scaled down to it."""
    ppo_epochs: int = Field(1, ge=1, le=100)
    """Passes over each batch."""
    micro_batch_size: int = Field(16, ge=1, le=65536)
    """Sequences per forward/backward; gradients accumulate across micro-batches."""
    micro_batch_tokens: Annotated[int, Field(ge=0, le=16_777_216)] | Literal["auto"] = "auto"
    """Tokens per forward/backward instead (verl's dynamic batch size): consecutive sequences up to this many
    real tokens (a longer sequence alone); 0: count by `micro_batch_size`; `auto`: with packed rows on a GPU, what
    its memory holds beside the model's states (services/learner/levers.py), else 0."""
    ppo_mini_batch_size: int = Field(0, ge=0, le=1_000_000)
    """Sequences per optimizer step (consecutive, in batch order); 0: the whole batch, one step per epoch."""
    max_staleness: int = Field(0, ge=0, le=1000)
    """Rollout may run this many policy versions ahead of the learner; 0 is synchronous on-policy."""
    dynamic_sampling: bool = False
    """DAPO's dynamic sampling (verl's filter_groups.enable): drop groups whose episodes all got the same reward and
    train on fresh ones in their place."""
    dynamic_sampling_max_gen_batches: int = Field(10, ge=0, le=1_000_000)
    """Dynamic sampling (verl's filter_groups.max_num_gen_batches): a step fails once it needs more than this many
    times groups_per_step groups; 0: no limit."""
    clip_ratio_c: float = Field(3.0, gt=1, le=1e6)
    """Dual-clip: for negative advantages the per-token loss is capped at -A * clip_ratio_c."""
    entropy_coeff: float = Field(0.0, ge=0, le=1000)
    """Entropy bonus: the loss subtracts this times the aggregated token entropy."""
    gamma: float = Field(1.0, ge=0, le=1)
    """Discount per model token for GAE and REINFORCE++ returns."""
    lam: float = Field(1.0, ge=0, le=1)
    """GAE lambda (0: one-step TD errors, 1: Monte-Carlo returns minus values)."""
    singleton_group_advantage: Literal["zero", "score"] = "zero"
    """GRPO/RLOO/OPO, a group of one: advantage 0 (TRL), or its raw score as verl gives (GRPO with std: / 1+1e-6)."""
    tis_cap: float = Field(2.0, ge=0, le=1e6)
    """Rollout correction's upper threshold (verl's rollout_is_threshold): token losses are weighted by
    min(pi_learner / pi_rollout, tis_cap) at `rollout_is_level`; 0 disables the rollout correction."""
    rollout_is_level: Literal["token", "sequence", "geometric", "turn"] = "token"
    """Importance ratio of the rollout correction: per token, per sequence (product), the sequence's geometric
    mean, or each model turn's geometric mean (every token of a sequence or turn gets its ratio)."""
    rollout_is_mode: Literal["truncate", "mask"] = "truncate"
    """`truncate`: weights cut to tis_cap (TIS); `mask`: tokens (sequences, turns at those levels) whose ratio is
    outside [rollout_is_threshold_lower, tis_cap] leave the loss and its divisors, the rest keep their weight (MIS)."""
    rollout_is_threshold_lower: float | None = Field(None, ge=0, le=1e6)
    """Lower bound of the mask mode's band; None: 1 / tis_cap; 0: no lower bound."""
    rollout_is_veto_threshold: float | None = Field(None, gt=0, le=1)
    """Reject a whole sequence (from the loss and its divisors) when any token's ratio is below this; None: off."""
    rollout_is: bool = True
    """Multiply the token losses by the rollout-correction weights; false: only its rejections and metrics."""
    lr_schedule: Literal["constant", "cosine"] = "constant"
    """Learning-rate shape after warm-up, for policy and critic (cosine decays over learner.steps)."""
    lr_warmup_steps: int = Field(0, ge=0, le=100_000_000)
    """Steps of linear warm-up: step k (0-based) runs at lr * (k + 1) / lr_warmup_steps."""
    min_lr_ratio: float = Field(0.0, ge=0, le=1)
    """Cosine schedule: the final learning rate as a fraction of lr."""
    critic_lr: float = Field(1e-3, gt=0, le=1)
    """AdamW learning rate of the critic (advantage `gae`)."""
    value_clip: float = Field(0.5, gt=0, le=1e6)
    """Clipped value loss: new values are clipped to within this of the step's initial values."""
    use_kl_in_reward: bool = False
    """Subtract kl_coef * KL(policy || reference) from each token's reward before the advantages."""
    kl_penalty: KLEstimator = "kl"
    """KL estimator in the reward: k1 `kl`, `abs`, k2 `mse`, k3 `low_var_kl` (aliases k1, k2, k3)."""
    kl_ctrl: Literal["fixed", "adaptive"] = "fixed"
    """In-reward KL coefficient: fixed, or adapted towards kl_target (Ziegler et al.)."""
    kl_coef: float = Field(0.001, ge=0, le=1e6)
    """In-reward KL coefficient (the adaptive controller's starting value)."""
    kl_target: float = Field(0.1, gt=0, le=1e6)
    """Adaptive controller: the KL per token it steers towards."""
    kl_horizon: int = Field(10000, ge=1, le=1_000_000_000)
    """Adaptive controller: trajectories over which the coefficient may change by about 20%."""
    use_kl_loss: bool = False
    """Add kl_loss_coef * KL(policy || reference) to the policy loss."""
    kl_loss_coef: float = Field(0.001, ge=0, le=1e6)
    """Weight of the KL loss term."""
    kl_loss_type: KLEstimator = "low_var_kl"
    """KL estimator of the loss term; a `+` suffix (k3+) keeps its value and takes k2's unbiased gradient."""

    @model_validator(mode="after")
    def _check_rollout_band(self) -> AlgorithmConfig:
        lower = self.rollout_is_threshold_lower
        if self.tis_cap > 0 and lower is not None and lower > self.tis_cap:
            raise ValueError(f"algorithm.rollout_is_threshold_lower {lower} is above algorithm.tis_cap {self.tis_cap}")
        return self


class StreamConfig(Section):
    redis_url: str = "redis://127.0.0.1:6379/0"
    """Redis holding the trajectory stream, the rollout registry and run state."""
    prefix: str = "omrl"
    """Key prefix; every key of a run lives under `<prefix>:<run>:`."""
    read_block_ms: int = Field(1000, ge=1, le=600_000)
    """How long one stream read blocks before the learner re-checks for shutdown."""
    max_len: int = Field(10000, ge=100, le=1_000_000_000)
    """Approximate cap on stream entries (XADD MAXLEN ~); acked entries are trimmed first."""
    max_entry_bytes: int = Field(16 * 1024 * 1024, ge=1024, le=512 * 1024 * 1024)
    """Largest stream entry the learner decodes; a larger one goes to the dead-letter stream unread."""


class LearnerConfig(Section):
    steps: int = Field(40, ge=0, le=100_000_000)
    """Policy updates to run."""
    stop_at_success: float | None = Field(None, gt=0, le=1)
    """End the run early, with a checkpoint and an export as at its last step, once the success rate averaged over
    the last `stop_window` steps reaches this (None: run every step)."""
    stop_window: int = Field(5, ge=1, le=10_000)
    """Steps that `stop_at_success` averages over."""
    checkpoint_dir: str = "runs/default/checkpoints"
    """Where checkpoints go (a volume every learner process shares); a run resumes from its newest one."""
    checkpoint_every: int = Field(1, ge=1, le=100_000_000)
    """Checkpoint (and acknowledge consumed batches) every this many steps."""
    keep_checkpoints: int = Field(2, ge=1, le=10_000)
    """Newest committed checkpoints kept; older ones are deleted."""
    checkpoint_format: Literal["auto", "sharded", "full"] = "auto"
    """`sharded`: torch.distributed.checkpoint, every learner process writes its own shards (the folder must be
    shared by all of them); `full`: rank 0 writes whole state dicts; `auto`: sharded with several learner processes
    or `checkpoint_async`, full with one (the same state, less overhead). Either resumes on any number of
    processes; a resume reads either."""
    checkpoint_async: bool = False
    """Write sharded checkpoints in the background while the next steps train; consumed batches are acknowledged
    once their checkpoint is committed (at the next checkpoint, or at the end)."""
    export_dir: str = ""
    """At the end of training, write the policy as a Hugging Face model directory (weights, config, tokenizer)
    that vLLM and transformers load; empty: `policy_hf` beside `checkpoint_dir`."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Learner device; `auto`: CUDA where a GPU is visible, else CPU."""
    nproc: int = Field(1, ge=1, le=1024)
    """Learner processes (torchrun); FSDP shards over them."""
    push_timeout_s: float = Field(120.0, gt=0, le=86400)
    """Deadline of one weight push to a rollout server."""
    weight_push: _plugin("weight_push") = "grpc"
    """Registered weight transport; `none` trains on the stream without rollout servers (recorded batches)."""
    weight_bucket_mb: int = Field(256, ge=1, le=4096)
    """A weight push travels in buckets of at most this many MiB (a larger tensor alone): the learner holds the
    bucket it sends and the one it gathers, a rollout server the one it checks."""
    weight_nccl_host: str = ""
    """`weight_push: nccl`: the address at which the rollout servers' engine workers reach the learner's
    rendezvous store (the learner's Service name or host); required with that transport."""
    weight_nccl_port: int = Field(29600, ge=1024, le=65535)
    """`weight_push: nccl`: TCP port of the rendezvous store the learner's rank 0 hosts."""
    weight_nccl_backend: Literal["auto", "gloo", "nccl"] = "auto"
    """`weight_push: nccl`: process-group backend the buckets travel on; `auto`: nccl when the learner runs on
    CUDA, else gloo (CPU). The rollout servers must run on the same kind of device."""
    weight_nccl_timeout_s: float = Field(60.0, gt=0, le=3600)
    """`weight_push: nccl`: longest wait to form a process group and for one bucket's broadcast."""
    step_timeout_s: float = Field(900.0, gt=0, le=7 * 86400)
    """Longest wait for one step's trajectories before the learner gives up."""
    logprob_chunk_tokens: Annotated[int, Field(ge=0, le=16_777_216)] | Literal["auto"] = "auto"
    """Logprobs/entropy from the LM head on this many positions at a time (no [B, T, V] fp32 logits); 0: dense;
    `auto`: 16384 on a GPU, 4096 on CPU."""
    logprob_head: Literal["fused", "recompute"] = "fused"
    """How the chunked head computes them: `fused`, one autograd node that takes each chunk's logprob and entropy
    in one fp32 pass and forms the logits' gradient analytically (compiled with `compile`); `recompute`,
    autograd through each chunk's log-softmax, recomputed in the backward pass (activation checkpointing)."""
    head_kernel: Literal["auto", "triton", "torch"] = "auto"
    """The fused head's elementwise passes (the logsumexp, logprob and entropy; the logits' gradient): `triton`,
    kernels that read each chunk's logits once (CUDA); `torch`, the torch formulation (compiled with `compile`);
    `auto`: triton on CUDA where the kernels build, else torch."""
    head_keep_logits: bool = False
    """With the fused head: keep each chunk's logits from the forward pass for the backward pass instead of
    recomputing them (one matmul of the LM head fewer a micro-batch, for [micro-batch tokens, vocabulary] in
    the compute dtype held until the backward pass: 12 GB at 40k tokens and Qwen's 152k vocabulary in bf16)."""
    fused_optimizer: bool = False
    """AdamW's fused kernel (torch's `fused=True`: one kernel per step over all of a device's parameters) for the
    policy and critic, instead of the default foreach kernels; the same update up to float rounding."""
    activation_checkpointing: bool | Literal["auto"] = "auto"
    """Recompute each decoder layer's activations in the backward pass instead of keeping them (policy, critic);
    `auto`: on a GPU where a micro-batch of 16k tokens would not fit otherwise, never on CPU."""
    fsdp_wrap: Literal["auto", "layers", "root"] = "auto"
    """FSDP2's units for the policy, critic and reference: `layers`, each decoder layer gathered before it runs and
    freed after it (the memory that sharding over GPUs is for); `root`, the whole model one unit, gathered once a
    forward pass and kept through its backward pass (no per-layer hooks; on one process kept across a mini-batch's
    micro-batches and the gradient reduced once: one all-gather and bf16 cast of the weights a mini-batch);
    `auto`: `root` on one process, where sharding saves nothing, `layers` otherwise."""
    compile: bool | Literal["auto"] = "auto"
    """torch.compile each decoder layer of the policy and critic (after activation checkpointing, before FSDP);
    `auto`: on a GPU where Triton and a C compiler are present, never on CPU."""
    compile_scope: Literal["layers", "decoder"] = "layers"
    """With `compile`: `layers`, each decoder layer its own graph (one compiled graph shared by identical layers);
    `decoder`, the whole decoder stack one graph (kernels fuse across layers; longer compile); `decoder` needs
    `fsdp_wrap` root (or auto on one process)."""
    fuse_scoring: bool = True
    """With one optimizer step per batch (one epoch, one mini-batch), no KL in the reward and no rollout-correction
    rejection (`rollout_is_mode: mask`, `rollout_is_veto_threshold`), take the pre-update
    logprobs from the update's own forward pass instead of a separate scoring pass (the same values)."""
    share_prefix: bool = False
    """Run the prompt that a group's sequences share once per group (its key/value cache repeated over the group's
    rows) in the policy's and the reference's passes, instead of once per sequence; the same logprobs and
    gradients. Saves (group_size - 1) / group_size of the prompt tokens' compute (69% of the tokens at 8 samples of
    a 59-token prompt with 16 new tokens). Two decoder calls per group instead of one per micro-batch (with FSDP
    `layers` units, as many gathers of each layer). Needs the chunked head (`logprob_chunk_tokens` > 0); not with
    `pack_sequences` or `activation_checkpointing`; the critic's pass does not share."""
    pack_sequences: bool | Literal["auto"] = "auto"
    """Each micro-batch's real tokens as one row, positions restarting per sequence and attention kept within
    each (no compute on padding); the same losses and gradients as padded rows. Pair with `micro_batch_tokens`.
    `auto`: on a GPU whose attention keeps to each sequence (`varlen`, flash, flex), never on CPU, nor with
    `share_prefix`."""
    sequence_parallel: int = Field(1, ge=1, le=1024)
    """Ulysses sequence parallelism: each packed row split over this many learner processes, attention over the
    whole row on 1/N of the heads (all-to-all of queries, keys and values), so one process holds 1/N of a long
    trajectory's activations; the batch is split over the world's processes / N groups. The same logprobs,
    losses and gradients as 1 (the unsplit row). Needs packed rows and varlen attention (`auto` picks them); must divide
    `nproc` (a group stays within a node) and, at start, the model's attention heads, and its key/value heads
    or be a multiple of them. 1: no split."""
    attention: Literal["auto", "sdpa", "eager", "flex_attention", "flash_attention_2", "varlen"] = "auto"
    """Attention kernel of the policy, critic and reference (transformers' attn_implementation). Packed rows
    use a block-diagonal mask with sdpa/eager (every score of the row computed), a document mask with
    flex_attention, varlen kernels with flash_attention_2 and `varlen` (torch's varlen flash kernel on GPU, one
    causal SDPA call per sequence on CPU: no work across sequences; needs `pack_sequences`). `auto`: `varlen`
    with packed rows on a GPU whose torch has the kernel, else `sdpa`."""

    @model_validator(mode="before")
    @classmethod
    def _rename_old_fields(cls, data: Any) -> Any:
        return _rename_fields("learner", data)

    @classmethod
    def __get_pydantic_json_schema__(cls, core_schema: Any, handler: Any) -> dict[str, Any]:
        # in either mode: one schema of a job spec for requests and responses (the old names are optional)
        schema = handler(core_schema)
        _old_names_in_schema("learner", handler.resolve_ref_schema(schema))
        return schema

    @model_validator(mode="after")
    def _check_attention(self) -> LearnerConfig:
        if self.attention == "varlen" and not self.pack_sequences:
            raise ValueError("learner.attention 'varlen' attends over packed rows: set learner.pack_sequences")
        if self.share_prefix and self.pack_sequences is True:
            raise ValueError("learner.share_prefix runs padded rows: unset learner.pack_sequences")
        if self.share_prefix and self.attention == "varlen":
            raise ValueError("learner.share_prefix runs padded rows; varlen attention needs packed ones")
        if self.share_prefix and not self.logprob_chunk_tokens:
            raise ValueError("learner.share_prefix needs the chunked head: set learner.logprob_chunk_tokens > 0")
        sp = self.sequence_parallel
        if sp > 1:
            if self.nproc % sp:
                raise ValueError(
                    f"learner.sequence_parallel {sp} must divide learner.nproc {self.nproc}: each group of "
                    f"{sp} processes splits one row, within a node"
                )
            if self.pack_sequences is False:
                raise ValueError(f"learner.sequence_parallel {sp} splits packed rows: set learner.pack_sequences")
            if self.share_prefix:
                raise ValueError(
                    f"learner.sequence_parallel {sp} splits packed rows; learner.share_prefix runs padded ones"
                )
            if self.attention not in ("auto", "varlen"):
                raise ValueError(
                    f"learner.sequence_parallel {sp} runs varlen attention over the split rows, not "
                    f"{self.attention!r}: set learner.attention to varlen (or auto)"
                )
        if self.share_prefix and self.activation_checkpointing is True:
            # a recomputed layer would append its keys to the shared cache a second time
            raise ValueError("learner.share_prefix keeps a key/value cache: unset learner.activation_checkpointing")
        if self.weight_push == "nccl":
            if not self.weight_nccl_host:
                raise ValueError(
                    "learner.weight_push 'nccl' needs learner.weight_nccl_host: the address the rollout servers "
                    "reach the learner's rendezvous store at"
                )
            if self.weight_nccl_backend == "nccl" and self.device == "cpu":
                raise ValueError("learner.weight_nccl_backend 'nccl' moves CUDA tensors: the learner runs on CPU")
            if self.weight_nccl_backend == "gloo" and self.device == "cuda":
                raise ValueError("learner.weight_nccl_backend 'gloo' on a CUDA learner: use nccl (or auto)")
        return self


class LoggingConfig(Section):
    trackers: list[Literal["jsonl", "tensorboard", "mlflow", "wandb"]] = Field(default_factory=list, max_length=4)
    """Experiment trackers that receive each step's metrics (the names Prometheus shows), the run's config and, every
    `tracker_episodes_every` steps, a table of the recorded episodes; written under the run folder (`trackers/`).
    A tracker that fails is logged once and dropped: it never stops training."""
    mlflow_tracking_uri: str = Field("", max_length=512)
    """MLflow tracking server or store; empty: an SQLite store in the run folder (`trackers/mlflow/mlflow.db`).
    A job spec may not set it (the deployment names a tracking server)."""
    tracker_episodes_every: int = Field(10, ge=1, le=1_000_000)
    """Steps between two tables of sample episodes sent to the trackers."""
    episodes_per_step: int = Field(16, ge=-1, le=1_000_000)
    """Episodes of each step kept with what the learner computed for them (per-token logprobs under rollout and
    learner, advantages, allocated rewards, loss mask), whole groups in batch order, as parquet under the run
    folder (`episodes/`); -1: every episode, 0: none."""
    episodes_max_bytes: int = Field(256 * 1024 * 1024, ge=1024 * 1024, le=1 << 40)
    """The recorded episodes' size limit on disk: the oldest steps' files are deleted past it."""


class ThreadsConfig(Section):
    budget: bool = True
    """Give each process its share of the cores (the cgroup CPU quota and the CPU affinity): the local
    launcher sizes each service's thread pools and binds vLLM's CPU worker to its own cores, idle OpenMP
    threads sleep. False: every library sizes its pools to the whole machine (they oversubscribe it)."""
    learner: int = Field(0, ge=0, le=4096)
    """Torch/OpenMP threads of each learner process; 0: auto (local run: its share, every core but one when
    `max_staleness` is 0 and learner and engine take turns; alone: every core of the budget)."""
    engine: int = Field(0, ge=0, le=4096)
    """vLLM CPU worker threads of a local run, one per bound core; 0: auto (the larger half of the cores, the
    last ones; a `VLLM_CPU_OMP_THREADS_BIND` in the launcher's environment names the cores instead)."""
    service: int = Field(1, ge=1, le=4096)
    """Threads of each small service of a local run (env, reward, the rollout front and vLLM engine core)."""


class TrainConfig(Section):
    run: str = "default"
    """Run name; scopes Redis keys, output and checkpoint folders."""
    seed: int = Field(0, ge=0, le=2**32 - 1)
    """Random seed (numpy takes 0..2**32-1)."""
    deterministic: bool = False
    """Reproduce a run from its seed: on CPU the same per-step rewards, losses and pushed checksums, run after run
    (on the same machine and thread counts). Sampling is seeded per request and batches are trained in slot order
    anyway; this adds kernels that reduce in a fixed order and refuses the settings under which timing decides
    what a step trains on (`algorithm.max_staleness` > 0, `algorithm.dynamic_sampling`). docs/algorithms.md
    says what still varies on a GPU."""
    output_dir: str = "runs"
    """Where runs write checkpoints, logs and plots."""
    model: ModelConfig = Field(default_factory=ModelConfig)
    env: EnvConfig = Field(default_factory=EnvConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    reward: RewardConfig = Field(default_factory=RewardConfig)
    algorithm: AlgorithmConfig = Field(default_factory=AlgorithmConfig)
    learner: LearnerConfig = Field(default_factory=LearnerConfig)
    stream: StreamConfig = Field(default_factory=StreamConfig)
    threads: ThreadsConfig = Field(default_factory=ThreadsConfig)
    logging: LoggingConfig = Field(default_factory=LoggingConfig)

    @model_validator(mode="after")
    def _check(self) -> TrainConfig:
        if self.algorithm.advantage in {"grpo", "rloo", "opo"} and self.rollout.group_size < 2:
            raise ValueError("rollout.group_size must be at least 2 for group-based advantages")
        if self.algorithm.dynamic_sampling and self.rollout.group_size < 2:
            raise ValueError("algorithm.dynamic_sampling needs rollout.group_size >= 2: it drops every group of one")
        if self.deterministic:
            timed = [
                *(["algorithm.max_staleness > 0"] if self.algorithm.max_staleness else []),
                *(["algorithm.dynamic_sampling"] if self.algorithm.dynamic_sampling else []),
            ]
            if timed:
                raise ValueError(
                    f"deterministic: with {' and '.join(timed)} the groups a step trains on depend on which "
                    "rollouts finish first; unset them or deterministic"
                )
        return self

    @property
    def run_dir(self) -> Path:
        return Path(self.output_dir) / self.run

    def key(self, name: str) -> str:
        """Redis key of this run."""
        return f"{self.stream.prefix}:{self.run}:{name}"


def load_config(
    path: str | None = None, overrides: list[str] | None = None, schema: type[TrainConfig] = TrainConfig
) -> TrainConfig:
    """Reads a YAML/JSON file (optional) and applies `a.b.c=value` overrides (values parsed as YAML); the
    command lines' own layers (services.common.config_layers), without environment variables."""
    layers = (rename_old_fields(file_layer(path)), rename_old_fields(set_layer(overrides or [])))
    return schema.model_validate(merge_layers(*layers))


def dump_config(config: TrainConfig) -> str:
    return yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False)


def config_digest(config: TrainConfig) -> str:
    """Names one config: the same fields and values give the same digest, in any process."""
    return hashlib.sha256(dump_config(config).encode()).hexdigest()[:16]
