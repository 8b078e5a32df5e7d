"""The one configuration schema: CLI flags, config files, REST job specs, helm values and compose env
all map onto these models. Every field's docstring doubles as its help text."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Literal, Optional

import yaml
from pydantic import BaseModel, ConfigDict, Field, model_validator


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, validate_assignment=True)


class ModelConfig(Section):
    path: Optional[str] = None
    """Hugging Face model id or local directory. Empty: build the tiny local demo model."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Weights dtype for rollout and learner (float32 on CPU keeps their logprobs identical)."""
    max_model_len: int = Field(512, ge=32, le=131072)
    """Longest token context (prompt plus every turn) an episode may reach."""
    warmstart_steps: int = Field(150, ge=0, le=100000)
    """Supervised steps on the task format before RL, for the tiny model only (0 disables)."""


class EnvConfig(Section):
    name: str = "corridor"
    """Registered environment to train on (see `services.envs.registry`)."""
    options: dict[str, Any] = Field(default_factory=dict)
    """Environment knobs, e.g. {"length": 6} for corridor difficulty."""
    address: str = "127.0.0.1:50052"
    """host:port of the environment service."""
    max_turns: int = Field(6, ge=1, le=1000)
    """Turns after which an episode is cut off (stop_reason max_turns)."""
    step_timeout_s: float = Field(10.0, gt=0, le=600)
    """Deadline of one environment call."""
    train_tasks: int = Field(100000, ge=1)
    """Task indices are drawn from [0, train_tasks)."""


class RolloutConfig(Section):
    backend: str = "vllm"
    """Registered generation backend."""
    addresses: list[str] = Field(default_factory=lambda: ["127.0.0.1:50051"])
    """Rollout servers; the learner pushes weights to every one that is registered and alive."""
    gpu_memory_utilization: float = Field(0.05, gt=0, le=1)
    """vLLM KV-cache share (of RAM on CPU, of GPU memory on GPU)."""
    max_num_seqs: int = Field(256, ge=1)
    """Most sequences the engine batches at once."""
    enforce_eager: bool = True
    """Skip CUDA-graph/compile warm-up (faster start, slower steady state)."""
    max_new_tokens: int = Field(16, ge=1, le=32768)
    """Token budget of one model turn."""
    temperature: float = Field(1.0, ge=0, le=5)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=0)
    """0 disables top-k."""
    action_parser: str = "xml_action"
    """Registered action template; `xml_action` takes the text inside <action>...</action>."""
    group_size: int = Field(8, ge=1, le=1024)
    """Episodes sampled per task (GRPO group)."""
    groups_per_step: int = Field(8, ge=1)
    """Task groups per learner step."""
    trajectories_per_message: int = Field(0, ge=0)
    """Trajectories per stream entry; 0 writes one entry per group."""
    generate_timeout_s: float = Field(120.0, gt=0)
    """Deadline of one generation call."""


class RewardComponentConfig(Section):
    weight: float = 1.0
    params: dict[str, Any] = Field(default_factory=dict)


class RewardConfig(Section):
    address: str = "127.0.0.1:50053"
    """host:port of the reward service."""
    components: dict[str, RewardComponentConfig] = Field(default_factory=lambda: {
        "goal": RewardComponentConfig(weight=1.0),
        "format": RewardComponentConfig(weight=0.1),
        "length_penalty": RewardComponentConfig(weight=0.1, params={"max_tokens": 64}),
    })
    """Registered reward functions and their weights; the total is the weighted sum."""
    allocation: Literal["last_token", "uniform_positive", "discounted"] = "last_token"
    """How a trajectory's reward is placed on its model tokens."""
    gamma: float = Field(1.0, ge=0, le=1)
    """Discount per token for `discounted` allocation."""
    timeout_s: float = Field(30.0, gt=0)


class AlgorithmConfig(Section):
    advantage: str = "grpo"
    """Registered advantage estimator."""
    norm_adv_by_std: bool = True
    """GRPO: divide by the group std (False gives Dr.GRPO)."""
    clip_ratio_low: float = Field(0.2, ge=0, le=1)
    clip_ratio_high: float = Field(0.2, ge=0, le=10)
    loss_agg_mode: Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"] = "token-mean"
    lr: float = Field(1e-3, gt=0, le=1)
    """AdamW learning rate."""
    weight_decay: float = Field(0.0, ge=0)
    grad_clip: float = Field(1.0, gt=0)
    ppo_epochs: int = Field(1, ge=1, le=100)
    """Passes over each batch."""
    micro_batch_size: int = Field(16, ge=1)
    """Sequences per forward/backward; gradients accumulate across micro-batches."""
    max_staleness: int = Field(0, ge=0, le=1000)
    """Rollout may run this many policy versions ahead of the learner; 0 is synchronous on-policy."""


class StreamConfig(Section):
    redis_url: str = "redis://127.0.0.1:6379/0"
    """Redis holding the trajectory stream, the rollout registry and run state."""
    prefix: str = "omrl"
    """Key prefix; every key of a run lives under `<prefix>:<run>:`."""
    read_block_ms: int = Field(1000, ge=1)
    """How long one stream read blocks before the learner re-checks for shutdown."""
    max_len: int = Field(10000, ge=100)
    """Approximate cap on stream entries (XADD MAXLEN ~); acked entries are trimmed first."""


class LearnerConfig(Section):
    steps: int = Field(40, ge=0)
    """Policy updates to run."""
    checkpoint_dir: str = "runs/default/checkpoints"
    checkpoint_every: int = Field(1, ge=1)
    """Checkpoint (and acknowledge consumed batches) every this many steps."""
    keep_checkpoints: int = Field(2, ge=1)
    device: Literal["auto", "cpu", "cuda"] = "auto"
    nproc: int = Field(1, ge=1)
    """Learner processes (torchrun); FSDP shards over them."""
    push_timeout_s: float = Field(120.0, gt=0)
    """Deadline of one weight push to a rollout server."""
    step_timeout_s: float = Field(900.0, gt=0)
    """Longest wait for one step's trajectories before the learner gives up."""


class TrainConfig(Section):
    run: str = "default"
    """Run name; scopes Redis keys, output and checkpoint folders."""
    seed: int = 0
    output_dir: str = "runs"
    """Where runs write checkpoints, logs and plots."""
    model: ModelConfig = Field(default_factory=ModelConfig)
    env: EnvConfig = Field(default_factory=EnvConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    reward: RewardConfig = Field(default_factory=RewardConfig)
    algorithm: AlgorithmConfig = Field(default_factory=AlgorithmConfig)
    learner: LearnerConfig = Field(default_factory=LearnerConfig)
    stream: StreamConfig = Field(default_factory=StreamConfig)

    @model_validator(mode="after")
    def _check(self) -> "TrainConfig":
        if self.algorithm.advantage in {"grpo", "rloo"} and self.rollout.group_size < 2:
            raise ValueError("rollout.group_size must be at least 2 for group-based advantages")
        return self

    @property
    def run_dir(self) -> Path:
        return Path(self.output_dir) / self.run

    def key(self, name: str) -> str:
        """Redis key of this run."""
        return f"{self.stream.prefix}:{self.run}:{name}"


def load_config(path: Optional[str] = None, overrides: Optional[list[str]] = None) -> TrainConfig:
    """Reads a YAML/JSON file (optional) and applies `a.b.c=value` overrides (values parsed as YAML)."""
    data: dict[str, Any] = {}
    if path:
        data = yaml.safe_load(Path(path).read_text()) or {}
    for item in overrides or []:
        key, sep, raw = item.partition("=")
        if not sep:
            raise ValueError(f"override {item!r} is not key=value")
        node = data
        *parents, leaf = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = yaml.safe_load(raw)
    return TrainConfig.model_validate(data)


def dump_config(config: TrainConfig) -> str:
    return yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False)
