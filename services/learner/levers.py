"""What the learner's `auto` settings become on the device it runs on: on a GPU the levers that make a step fast
(packed rows, varlen attention, compiled layers, 16k-token head chunks, token-budget micro-batches sized from the
GPU's memory), on CPU what the CPU runs best (padded rows, sdpa, eager layers, 4096-token chunks, micro-batches
counted in sequences). A value set by hand is kept; `deterministic` keeps every `auto` at the CPU choice, whose
kernels reduce in a fixed order.

The token budget: the GPU's memory, less a margin, the model's training states (fp32 weights, gradients and AdamW
moments, sharded over the learner processes, plus a gathered bf16 copy), the reference's and the critic's, and the
head's chunk of logits, divided by what a token's activations take (about layers x (8 hidden + 8 intermediate)
bytes without activation checkpointing: fitted to the 0.5B shape's peak memory at 16k-64k-token micro-batches on
H200s, docs/benchmarks.md). Where that leaves under 16k tokens, activation checkpointing turns on (`auto`).

With `sequence_parallel` N > 1 rows are always packed under varlen attention (on CPU too), and a process holds
1/N of each row's activations: the budget and the longest row are N times one process's (not measured on GPUs
yet)."""

from __future__ import annotations

import importlib.util
import logging
import shutil
from dataclasses import dataclass
from typing import Any

from services.common.config import TrainConfig

log = logging.getLogger(__name__)

GPU_CHUNK, CPU_CHUNK = 16384, 4096
MIN_TOKENS, MAX_TOKENS, TOKEN_STEP = 4096, 65536, 4096
CHECKPOINT_BELOW = 16384
MEMORY_MARGIN = 0.85  # of the GPU's memory: the allocator's fragmentation, the CUDA context, NCCL buffers
RESERVE_BYTES = 2 * 2**30
EAGER_ACTIVATIONS = 1.5
"""Eager (uncompiled) layers keep this many times the activations of compiled ones, whose fused kernels free
intermediates: one row of the 0.5B shape on an H200 took 1.53 MiB a token eager against 1.17 compiled
(bench/longest_row.py, docs/benchmarks.md)."""


@dataclass(frozen=True)
class ModelShape:
    layers: int
    hidden: int
    intermediate: int
    vocab: int
    params: int

    @classmethod
    def of(cls, hf_config: Any) -> ModelShape:
        text = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
        layers, hidden, vocab = text.num_hidden_layers, text.hidden_size, text.vocab_size
        intermediate = getattr(text, "intermediate_size", None) or 4 * hidden
        heads = text.num_attention_heads
        kv = (getattr(text, "num_key_value_heads", None) or heads) * (hidden // heads)
        per_layer = 2 * hidden * hidden + 2 * hidden * kv + 3 * hidden * intermediate
        embeddings = vocab * hidden * (1 if getattr(text, "tie_word_embeddings", False) else 2)
        return cls(layers, hidden, intermediate, vocab, layers * per_layer + embeddings)

    def activation_bytes(self, checkpointed: bool) -> int:
        """A token's activations kept for the backward pass (bf16); checkpointed: each layer's input, and one
        layer's activations recomputed at a time."""
        layer = 8 * self.hidden + 8 * self.intermediate
        return self.layers * 2 * self.hidden + layer if checkpointed else self.layers * layer


def varlen_available() -> bool:
    return importlib.util.find_spec("torch.nn.attention.varlen") is not None


def compiler_available() -> bool:
    return importlib.util.find_spec("triton") is not None and any(shutil.which(cc) for cc in ("cc", "gcc", "clang"))


def token_budget(
    shape: ModelShape,
    gpu_bytes: int,
    world_size: int,
    chunk: int,
    checkpointed: bool,
    critic: bool,
    reference: bool,
    compiled: bool = True,
    sequence_parallel: int = 1,
) -> int:
    """Tokens a micro-batch may hold on a GPU of `gpu_bytes`, a multiple of 4096 in [4096, 65536] (times
    `sequence_parallel`: each process of a group holds that share of the micro-batch)."""
    tokens = fitting_tokens(
        shape, gpu_bytes, world_size, chunk, checkpointed, critic, reference, compiled, sequence_parallel
    )
    return max(MIN_TOKENS, min(MAX_TOKENS * sequence_parallel, tokens // TOKEN_STEP * TOKEN_STEP))


def fitting_tokens(
    shape: ModelShape,
    gpu_bytes: int,
    world_size: int,
    chunk: int,
    checkpointed: bool,
    critic: bool,
    reference: bool,
    compiled: bool = True,
    sequence_parallel: int = 1,
) -> int:
    """Tokens whose activations fit beside the training states on a GPU of `gpu_bytes` (unrounded, unclamped):
    the longest row one learner process can train, times `sequence_parallel` (the processes that split a row)."""
    models = 2 if critic else 1
    states = models * shape.params * (16 / world_size + 2) + (2 * shape.params if reference else 0)
    head = chunk * shape.vocab * 4  # a chunk's fp32 logits; the dense head (chunk 0) holds every token's
    activations = shape.activation_bytes(checkpointed) * (1 if compiled else EAGER_ACTIVATIONS)
    per_token = models * activations + (0 if chunk else shape.vocab * 8)
    free = gpu_bytes * MEMORY_MARGIN - states - head - RESERVE_BYTES
    return int(free // per_token) * sequence_parallel if free > 0 else 0


def resolve(
    config: TrainConfig,
    device_type: str,
    hf_config: Any = None,
    gpu_bytes: int = 0,
    world_size: int = 1,
    critic: bool = False,
) -> TrainConfig:
    """`config` with every `auto` lever set for `device_type` (`cuda` or `cpu`); `hf_config` (the model's),
    `gpu_bytes`, the learner processes and whether a critic trains too size the token budget on a GPU. Logs what
    it chose."""
    learner, algo = config.learner, config.algorithm
    gpu = device_type == "cuda" and not config.deterministic
    chosen: dict[str, Any] = {}

    def pick(section: str, name: str, value: Any) -> Any:
        current = getattr(learner if section == "learner" else algo, name)
        if current != "auto":
            return current
        chosen[f"{section}.{name}"] = value
        return value

    attention = learner.attention
    split = learner.sequence_parallel > 1  # Ulysses splits packed rows under varlen attention (on any device)
    keeps_to_sequences = attention in ("varlen", "flash_attention_2", "flex_attention") or (
        attention == "auto" and gpu and varlen_available()
    )
    # varlen attention reads packed rows only, on any device; the other kernels pack where they keep to sequences
    pack = pick(
        "learner",
        "pack_sequences",
        split or attention == "varlen" or (gpu and keeps_to_sequences and not learner.share_prefix),
    )
    varlen = split or (gpu and pack and varlen_available())
    attention = pick("learner", "attention", "varlen" if varlen else "sdpa")
    compiled = pick("learner", "compile", gpu and compiler_available())
    chunk = pick("learner", "logprob_chunk_tokens", GPU_CHUNK if gpu else CPU_CHUNK)
    checkpointed, tokens = learner.activation_checkpointing, algo.micro_batch_tokens
    if gpu and pack and hf_config is not None and gpu_bytes:
        shape = ModelShape.of(hf_config)
        needs = {"critic": critic, "reference": bool(algo.use_kl_in_reward or algo.use_kl_loss)}

        def budget(with_checkpoints: bool) -> int:
            return token_budget(
                shape,
                gpu_bytes,
                world_size,
                chunk,
                with_checkpoints,
                compiled=compiled,
                sequence_parallel=learner.sequence_parallel,
                **needs,
            )

        if checkpointed == "auto":
            checkpointed = pick(
                "learner",
                "activation_checkpointing",
                budget(False) < CHECKPOINT_BELOW and not learner.share_prefix,
            )
        tokens = pick("algorithm", "micro_batch_tokens", budget(checkpointed))
    if checkpointed == "auto":
        checkpointed = pick("learner", "activation_checkpointing", False)
    if tokens == "auto":
        tokens = pick("algorithm", "micro_batch_tokens", 0)
    if chosen:
        log.info("auto settings on %s: %s", device_type, ", ".join(f"{k}={v}" for k, v in chosen.items()))
    return config.model_copy(
        update={
            "learner": learner.model_copy(
                update={
                    "pack_sequences": pack,
                    "attention": attention,
                    "compile": compiled,
                    "logprob_chunk_tokens": chunk,
                    "activation_checkpointing": checkpointed,
                }
            ),
            "algorithm": algo.model_copy(update={"micro_batch_tokens": tokens}),
        }
    )


def resolve_for_device(config: TrainConfig, device: Any, model_path: str, world_size: int) -> TrainConfig:
    """`resolve` for the learner's torch device and model (its config read from `model_path` on a GPU only)."""
    if device.type != "cuda":
        return resolve(config, device.type)
    import torch
    from transformers import AutoConfig

    from services.learner.advantages import build_estimator

    hf_config = AutoConfig.from_pretrained(model_path)
    memory = torch.cuda.get_device_properties(device).total_memory
    critic = build_estimator(config.algorithm).needs_values
    return resolve(config, "cuda", hf_config, memory, world_size, critic)


LINEAR_MEMORY_ATTENTION = ("varlen", "flash_attention_2", "flex_attention", "sdpa")
"""Kernels whose memory grows with a row's length, not its square (sdpa: its flash and memory-efficient backends
on a GPU); `eager` materialises every [tokens, tokens] score."""


def longest_row(config: TrainConfig, device: Any, model_path: str, world_size: int) -> int | None:
    """The most tokens one trajectory may have for the learner to train it on this GPU (`config` resolved); None
    on CPU, or where the attention kernel's memory is not linear in the length (no estimate)."""
    learner, algo = config.learner, config.algorithm
    if device.type != "cuda" or learner.attention not in LINEAR_MEMORY_ATTENTION:
        return None
    import torch
    from transformers import AutoConfig

    from services.learner.advantages import build_estimator

    return fitting_tokens(
        ModelShape.of(AutoConfig.from_pretrained(model_path)),
        torch.cuda.get_device_properties(device).total_memory,
        world_size,
        learner.logprob_chunk_tokens,
        bool(learner.activation_checkpointing),
        build_estimator(algo).needs_values,
        bool(algo.use_kl_in_reward or algo.use_kl_loss),
        bool(learner.compile),
        learner.sequence_parallel,
    )
