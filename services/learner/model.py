"""The policy network: a Hugging Face causal LM, and its per-token logprobs.

Two paths to the logprobs: dense (the model's [B, T, V] logits, then log-softmax in fp32) and chunked
(`chunk_tokens` > 0: the final hidden states, then the LM head and an fp32 log-softmax on `chunk_tokens`
positions at a time), so no [B, T, V] fp32 tensor ever exists. The chunked head is either `fused`
(`fused_head`: one autograd node, logprob and entropy in one pass, the logits' gradient formed
analytically) or `recompute` (autograd through each chunk's log-softmax, the chunk recomputed in the
backward pass by activation checkpointing). All give the same values and gradients up to float rounding.

A model split over a sequence group (`sequence_parallel.attach`) runs each packed row as its slice on every
process of the group (`_split_token_stats`, `token_values`): the same [B, T] values, on each of them."""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from services.learner import sequence_parallel
from services.learner.batch import entropy_from_logits, logprobs_from_logits
from services.learner.fused_head import KERNELS, head_token_stats
from services.learner.packing import pack_rows
from services.learner.prefix import Prefix, shared_prefix_hidden

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
HEADS = ("fused", "recompute")
TOKEN_STATS_METHOD = "token_stats"
"""The policy's extra forward method, attached by `load_model`: the chunked logprobs and entropies. It runs the
root's layers and head outside `forward`, so FSDP registers it as a forward method (`parallelize.shard_model`)."""


def load_model(
    path: str,
    dtype: str = "float32",
    attention: str = "sdpa",
    head: str = "fused",
    head_kernel: str = "auto",
    keep_logits: bool = False,
    split: bool = False,
) -> torch.nn.Module:
    """Loads on CPU with dropout off (eval mode), so PPO's first-epoch ratio is exactly 1. `head`: how the
    chunked logprobs are computed (`HEADS`); `head_kernel`, `keep_logits`: the fused head's options
    (`fused_head.head_token_stats`); `split`: with the sequence-parallel attention (`attn_name`)."""
    from transformers import AutoModelForCausalLM

    if head not in HEADS:
        raise ValueError(f"unknown logprob head {head!r}: one of {HEADS}")
    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=DTYPES[dtype], attn_implementation=attn_name(attention, split)
    )
    model.config.use_cache = False
    if head_kernel not in KERNELS:
        raise ValueError(f"unknown head kernel {head_kernel!r}: one of {KERNELS}")
    stats = functools.partial(_chunked_token_stats, model, head=head, kernel=head_kernel, keep_logits=keep_logits)
    setattr(model, TOKEN_STATS_METHOD, stats)
    return model.eval()


def compile_head(model: torch.nn.Module) -> None:
    """The fused head's elementwise kernels through torch.compile (`parallelize` with `compile`)."""
    stats = getattr(model, TOKEN_STATS_METHOD, None)
    if isinstance(stats, functools.partial):
        setattr(model, TOKEN_STATS_METHOD, functools.partial(stats, compiled=True))


def attn_name(attention: str, split: bool = False) -> str:
    """The transformers attn_implementation of a `learner.attention` choice; `split` (`learner.sequence_parallel`
    > 1, which needs `varlen`): the Ulysses attention around it."""
    if split:
        if attention != "varlen":
            raise ValueError(f"learner.sequence_parallel splits varlen attention only, not {attention!r}")
        return sequence_parallel.register()
    if attention == "varlen":
        from services.learner import varlen_attention

        return varlen_attention.register()
    return attention


def _logits(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask, position_ids=None, **kw) -> torch.Tensor:
    return model(
        input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False, **kw
    ).logits


def _packed_kwargs(model: torch.nn.Module, rows) -> dict:
    """Document bounds for kernels that read them; other kernels get the block mask from position ids alone."""
    from services.learner.varlen_attention import NAME

    return rows.attention_kwargs() if getattr(model.config, "_attn_implementation", None) == NAME else {}


def token_logprobs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    chunk_tokens: int = 0,
    pack: bool = False,
    prefixes: list[Prefix] | None = None,
) -> torch.Tensor:
    """[B, T] float32: position t = log p(token t | tokens < t), position 0 = 0. `pack`: one forward pass
    over the real tokens only (`packing`), the same values. `prefixes` (not with `pack`; chunked head only):
    each shared prefix computed once (`services.learner.prefix`), the same values."""
    if pack and sequence_parallel.group_of(model) is not None:
        return _split_token_stats(model, input_ids, attention_mask, chunk_tokens, False)[0]
    if pack:
        rows = pack_rows(input_ids, attention_mask)
        kw = _packed_kwargs(model, rows)
        return rows.unpack(_token_logprobs(model, rows.input_ids, None, chunk_tokens, rows.position_ids, **kw))
    return _token_logprobs(model, input_ids, attention_mask, chunk_tokens, prefixes=prefixes)


def token_logprobs_and_entropy(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    chunk_tokens: int = 0,
    pack: bool = False,
    prefixes: list[Prefix] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    if pack and sequence_parallel.group_of(model) is not None:
        return _split_token_stats(model, input_ids, attention_mask, chunk_tokens, True)
    if pack:
        rows = pack_rows(input_ids, attention_mask)
        kw = _packed_kwargs(model, rows)
        lp, ent = _token_logprobs_and_entropy(model, rows.input_ids, None, chunk_tokens, rows.position_ids, **kw)
        return rows.unpack(lp), rows.unpack(ent)
    return _token_logprobs_and_entropy(model, input_ids, attention_mask, chunk_tokens, prefixes=prefixes)


def _token_logprobs(model, input_ids, attention_mask, chunk_tokens, position_ids=None, **kw) -> torch.Tensor:
    prefixes = kw.pop("prefixes", None)
    if _chunkable(model, chunk_tokens):
        stats = _token_stats(model)
        return stats(input_ids, attention_mask, chunk_tokens, False, position_ids, prefixes=prefixes, **kw)[0]
    return logprobs_from_logits(_logits(model, input_ids, attention_mask, position_ids, **kw), input_ids)


def _token_logprobs_and_entropy(model, input_ids, attention_mask, chunk_tokens, position_ids=None, **kw):
    prefixes = kw.pop("prefixes", None)
    if _chunkable(model, chunk_tokens):
        stats = _token_stats(model)
        return stats(input_ids, attention_mask, chunk_tokens, True, position_ids, prefixes=prefixes, **kw)
    logits = _logits(model, input_ids, attention_mask, position_ids, **kw)
    return logprobs_from_logits(logits, input_ids), entropy_from_logits(logits)


def _split_token_stats(model, input_ids, attention_mask, chunk_tokens: int, with_entropy: bool):
    """([B, T] logprobs, [B, T] entropies, zeros unless `with_entropy`) of a packed micro-batch whose row the
    model's sequence group splits: this process runs its slice, the head on the slice's own tokens against
    targets shifted on the whole row, then the group's values are gathered and put back in the [B, T] layout."""
    group = sequence_parallel.group_of(model)
    rows = pack_rows(input_ids, attention_mask)
    shard = sequence_parallel.split_packed(rows, group.size, group.rank)
    kw = shard.attention_kwargs(group)
    if _chunkable(model, chunk_tokens):
        stats = _token_stats(model)
        lp, ent = stats(
            shard.input_ids, None, chunk_tokens, with_entropy, shard.position_ids, targets=shard.targets, **kw
        )
    else:
        lp, ent = _stats_at_targets(_logits(model, shard.input_ids, None, shard.position_ids, **kw), shard.targets)
    merge = lambda values: rows.unpack(shard.merge(sequence_parallel.gather_sequence(values, group)))  # noqa: E731
    lp = merge(lp)
    return lp, merge(ent) if with_entropy else torch.zeros_like(lp)


def _stats_at_targets(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, L, V] logits, [B, L] targets -> ([B, L] log p(target at l | position l), [B, L] entropy at l), unshifted."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    return logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1), -(logp.exp() * logp).sum(-1)


def _chunkable(model: torch.nn.Module, chunk_tokens: int) -> bool:
    """Models that transform the head's output (soft-capping, logit scaling) keep the dense path."""
    cfg = model.config
    plain = getattr(cfg, "final_logit_softcapping", None) is None and getattr(cfg, "logit_scale", None) is None
    return chunk_tokens > 0 and plain


def _token_stats(model: torch.nn.Module):
    return getattr(model, TOKEN_STATS_METHOD, None) or functools.partial(_chunked_token_stats, model)


def _chunked_token_stats(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask,
    chunk_tokens: int,
    with_entropy: bool,
    position_ids=None,
    head: str = "fused",
    compiled: bool = False,
    prefixes: list[Prefix] | None = None,
    kernel: str = "auto",
    keep_logits: bool = False,
    targets: torch.Tensor | None = None,
    **kw,
) -> tuple[torch.Tensor, torch.Tensor]:
    """([B, T] logprobs, [B, T] entropies, zeros unless `with_entropy`), aligned as `token_logprobs`. With
    `targets` ([B, T], a split row's: `sequence_parallel.RowShard`), position t holds log p(targets[t]) instead,
    unshifted."""
    if prefixes:
        hidden = shared_prefix_hidden(model.get_decoder(), input_ids, attention_mask, prefixes)
    else:
        hidden = model.get_decoder()(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False, **kw
        ).last_hidden_state
    lm_head = model.get_output_embeddings()
    b, t = input_ids.shape
    flat = hidden.reshape(b * t, -1)
    shift = targets is None
    if shift:
        # position t's hidden state predicts token t + 1; the last column's target is a placeholder, dropped below
        targets = F.pad(input_ids[:, 1:], (0, 1))
    targets = targets.reshape(-1)

    def unflatten(parts: list[torch.Tensor]) -> torch.Tensor:
        out = torch.cat(parts).reshape(b, t)
        return F.pad(out[:, :-1], (1, 0)) if shift else out

    if head == "fused":
        lp, ent = head_token_stats(
            flat, lm_head.weight, lm_head.bias, targets, chunk_tokens, with_entropy, compiled, kernel, keep_logits
        )
        return unflatten([lp]), unflatten([ent])
    logps, ents = [], []
    for start in range(0, b * t, chunk_tokens):
        rows = slice(start, start + chunk_tokens)
        args = (flat[rows], lm_head.weight, lm_head.bias, targets[rows], with_entropy)
        if torch.is_grad_enabled():
            lp, ent = checkpoint(_head_chunk, *args, use_reentrant=False)
        else:
            lp, ent = _head_chunk(*args)
        logps.append(lp)
        ents.append(ent)
    return unflatten(logps), unflatten(ents)


def _head_chunk(
    hidden: torch.Tensor, weight: torch.Tensor, bias, targets: torch.Tensor, with_entropy: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    logits = F.linear(hidden, weight, bias).float()
    picked = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    logp = picked - torch.logsumexp(logits, dim=-1)
    if not with_entropy:
        return logp, torch.zeros_like(logp)
    log_probs = torch.log_softmax(logits, dim=-1)
    return logp, -(log_probs.exp() * log_probs).sum(-1)


def load_value_model(
    path: str, dtype: str = "float32", attention: str = "sdpa", split: bool = False
) -> torch.nn.Module:
    """The critic: the policy's architecture and initial weights with a scalar head in place of the LM head.
    The head starts at zero (every value 0), so its first updates fit the head before the trunk moves."""
    from transformers import AutoModelForTokenClassification

    model = AutoModelForTokenClassification.from_pretrained(
        path, num_labels=1, dtype=DTYPES[dtype], attn_implementation=attn_name(attention, split)
    )
    with torch.no_grad():
        model.score.weight.zero_()
        if model.score.bias is not None:
            model.score.bias.zero_()
    model.config.use_cache = False
    return model.eval()


def token_values(
    model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, pack: bool = False
) -> torch.Tensor:
    """[B, T] float32: position t = V(tokens < t), the value of the state token t was sampled in (read
    from the head at position t - 1, the same shift as the logprobs); position 0 = 0."""
    group = sequence_parallel.group_of(model)
    if pack and group is not None:
        rows = pack_rows(input_ids, attention_mask)
        shard = sequence_parallel.split_packed(rows, group.size, group.rank)
        out = _head_values(model, shard.input_ids, None, shard.position_ids, **shard.attention_kwargs(group))
        return rows.unpack(shard.merge(sequence_parallel.gather_sequence(out, group)))
    if pack:
        rows = pack_rows(input_ids, attention_mask)
        return rows.unpack(_token_values(model, rows.input_ids, None, rows.position_ids, **_packed_kwargs(model, rows)))
    return _token_values(model, input_ids, attention_mask)


def _token_values(model, input_ids, attention_mask, position_ids=None, **kw) -> torch.Tensor:
    out = _head_values(model, input_ids, attention_mask, position_ids, **kw)
    return torch.nn.functional.pad(out[:, :-1], (1, 0))


def _head_values(model, input_ids, attention_mask, position_ids=None, **kw) -> torch.Tensor:
    """[B, T] float32: the value head at each position, unshifted."""
    return (
        model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False, **kw)
        .logits[..., 0]
        .float()
    )
