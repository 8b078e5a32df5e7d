"""The cases that compare Ulysses sequence parallelism with the unsplit computation: attention alone, the policy's
logprobs/entropy and the critic's values with the gradient of every parameter, and whole PPO steps. Each case
runs split (`group` given, inside `torchrun`) or unsplit (in one process) and returns full tensors on CPU, so a
test compares the two:

    torchrun --nproc_per_node 2 -m tests.support.sequence_parallel --model DIR --out results.pt
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

LENGTHS = (6, 1, 9, 5, 4)
"""Ragged sequences of one packed row (25 tokens: a split pads it with one more sequence)."""
HEADS = 4
KV_CASES = (4, 2, 1)
"""Key/value heads of the attention cases: as many as the query heads, a divisor of 2, fewer than 2 (repeated)."""
CASES = ("attention", "model", "trainer")


def build_model(
    path: str | Path, *, kv_heads: int = 1, hidden: int = 32, layers: int = 2, positions: int = 256, seed: int = 0
) -> Path:
    """A tiny random Llama with 4 query heads over `kv_heads` key/value heads (grouped-query attention)."""
    from transformers import LlamaConfig

    from services.common.tiny_model import build_random_model

    config = LlamaConfig(
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=HEADS,
        num_key_value_heads=kv_heads,
        vocab_size=64,
        max_position_embeddings=positions,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    return build_random_model(path, config, seed=seed)


def _rows(lengths, device):
    from services.learner.packing import pack_rows

    ids = torch.zeros(len(lengths), max(lengths), dtype=torch.long, device=device)
    mask = (torch.arange(max(lengths)) < torch.tensor(lengths)[:, None]).long().to(device)
    return pack_rows(ids, mask)


def gather_full(x: torch.Tensor, group, dim: int) -> torch.Tensor:
    """The group's slices of `x` joined along `dim` (no autograd)."""
    import torch.distributed as dist

    parts = [torch.empty_like(x) for _ in range(group.size)]
    dist.all_gather(parts, x.contiguous(), group=group.group)
    return torch.cat(parts, dim=dim)


def attention_case(
    kv_heads: int,
    group=None,
    *,
    lengths=LENGTHS,
    head_dim: int = 8,
    device: str = "cpu",
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
) -> dict[str, torch.Tensor]:
    """Attention over one packed row of `lengths` on random q/k/v, and the gradients of q, k and v of a weighted
    sum of the output: unsplit (varlen attention) or split over `group` (Ulysses), as full tensors."""
    from services.learner import sequence_parallel
    from services.learner.varlen_attention import varlen_attention_forward

    gen = torch.Generator().manual_seed(seed)
    rows = _rows(lengths, device)
    n = rows.input_ids.shape[1]
    q = torch.randn(1, HEADS, n, head_dim, generator=gen)
    k, v = (torch.randn(1, kv_heads, n, head_dim, generator=gen) for _ in range(2))
    weights = torch.randn(1, n, HEADS, head_dim, generator=gen).to(device, dtype)
    q, k, v = (t.to(device, dtype) for t in (q, k, v))
    if group is None:
        q, k, v = (t.requires_grad_() for t in (q, k, v))
        out, _ = varlen_attention_forward(None, q, k, v, None, **rows.attention_kwargs())
        (out * weights).sum().backward()
        return {name: t.detach().cpu() for name, t in (("out", out), ("dq", q.grad), ("dk", k.grad), ("dv", v.grad))}
    shard = sequence_parallel.split_packed(rows, group.size, group.rank)
    width = shard.input_ids.shape[1]
    pad = width * group.size - n
    part = slice(group.rank * width, (group.rank + 1) * width)
    q, k, v = (torch.nn.functional.pad(t, (0, 0, 0, pad))[:, :, part].clone().requires_grad_() for t in (q, k, v))
    out, _ = sequence_parallel.ulysses_attention_forward(None, q, k, v, None, **shard.attention_kwargs(group))
    (out * torch.nn.functional.pad(weights, (0, 0, 0, 0, 0, pad))[:, part]).sum().backward()
    full = {"out": gather_full(out.detach(), group, 1)[:, :n]}
    for name, t in (("dq", q), ("dk", k), ("dv", v)):
        full[name] = gather_full(t.grad, group, 2)[:, :, :n]
    return {name: t.cpu() for name, t in full.items()}


def _batch(lengths, vocab: int = 64, seed: int = 1):
    """A right-padded micro-batch of random rows of `lengths`, and per-token weights for a loss."""
    gen = torch.Generator().manual_seed(seed)
    b, t = len(lengths), max(lengths)
    ids = torch.randint(3, vocab, (b, t), generator=gen)
    mask = (torch.arange(t) < torch.tensor(lengths)[:, None]).long()
    return ids * mask, mask, torch.randn(2, b, t, generator=gen) * mask


def model_case(
    model_path: str,
    kind: str,
    group=None,
    *,
    lengths=LENGTHS,
    device: str = "cpu",
    dtype: str = "float32",
    chunk: int = 5,
) -> dict[str, torch.Tensor]:
    """The policy's logprobs and entropy (`kind` `fused`: the chunked head in `chunk`-token chunks; `dense`: full
    logits) or the critic's values (`values`, its zero-initialised head set to random weights) of a packed
    micro-batch of `lengths`, and the gradient of every parameter of a weighted sum of them. Split: the model
    FSDP-sharded over the world, each row over `group`; unsplit: one process, packed rows, varlen attention."""
    from services.learner import sequence_parallel
    from services.learner.model import load_model, load_value_model, token_logprobs_and_entropy, token_values
    from services.learner.parallelize import parallelize

    split = group is not None
    if kind == "values":
        model = load_value_model(model_path, dtype, "varlen", split=split)
        with torch.no_grad():
            random = torch.randn(model.score.weight.shape, generator=torch.Generator().manual_seed(2))
            model.score.weight.copy_(random)
    else:
        model = load_model(model_path, dtype, "varlen", split=split)
    if split:
        parallelize(model, torch.device(device), wrap="layers", sequence_group=group)
        assert sequence_parallel.group_of(model) is group
    else:
        model.to(device)
    ids, mask, weights = (t.to(device) for t in _batch(lengths))
    if kind == "values":
        values = token_values(model, ids, mask, pack=True)
        loss, out = (values * weights[0]).sum(), {"values": values}
    else:
        lp, ent = token_logprobs_and_entropy(model, ids, mask, chunk if kind == "fused" else 0, pack=True)
        loss, out = (lp * weights[0]).sum() + (ent * weights[1]).sum(), {"logprobs": lp, "entropy": ent}
    # each process of a group holds the whole loss, and every data rank (a group) the same one: FSDP's average over
    # the world (data ranks x group size) leaves the gradient of one loss after this scale
    (loss * (group.size if split else 1)).backward()
    out = {name: t.detach().cpu() for name, t in out.items()}
    for name, p in model.named_parameters():
        grad = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        out[f"grad/{name}"] = grad.detach().float().cpu()
    return out


def trainer_case(model_path: str, sp: int, nproc: int | None = None, steps: int = 2, device: str = "cpu") -> dict:
    """`steps` PPO steps (critic, KL in the reward and as a loss, entropy bonus, two epochs, packed token-budget
    micro-batches) with `sp` of `nproc` processes splitting each row; per-step metrics (untimed) and the weights'
    checksum. On `cuda`: bf16 with fp32 master weights, the `auto` levers (compiled layers where Triton builds)."""
    from services.learner.trainer import PolicyTrainer
    from tests.support.learner import untimed
    from tests.support.smoke import param_checksum, synthetic_trajectories

    trainer = PolicyTrainer(trainer_config(sp, nproc or sp, device), model_path)
    metrics = [untimed(trainer.train_step(synthetic_trajectories(6, 2, seed=step))) for step in range(steps)]
    return {"metrics": metrics, "checksum": param_checksum(trainer), "dp_size": trainer.mesh.dp_size}


def trainer_config(sp: int, nproc: int, device: str = "cpu"):
    from services.common.config import TrainConfig
    from tests.support.smoke import PPO_SETTINGS

    return TrainConfig.model_validate(
        {
            "seed": 0,
            "model": {"dtype": "float32" if device == "cpu" else "bfloat16"},
            "rollout": {"group_size": 2},
            "learner": {
                "device": device,
                "nproc": nproc,
                "sequence_parallel": sp,
                "pack_sequences": True,
                "attention": "varlen",
                "logprob_chunk_tokens": 7,
            },
            "algorithm": {**PPO_SETTINGS, "ppo_epochs": 2, "lr": 1e-2, "micro_batch_tokens": 40},
        }
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--sp", type=int, default=0, help="processes that split a row (default: all)")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--lengths", default="", help="comma-separated row lengths of the model cases")
    parser.add_argument("--head-dim", type=int, default=8, help="of the attention cases")
    parser.add_argument("--cases", default=",".join(CASES))
    args = parser.parse_args(argv)
    from services.learner import collectives, sequence_parallel
    from services.learner.model import DTYPES

    device = collectives.resolve_device(args.device)
    rank, world = collectives.init_distributed(device)
    sp = args.sp or world
    group = sequence_parallel.build_mesh(device.type, world, rank, sp).sequence
    lengths = tuple(int(n) for n in args.lengths.split(",")) if args.lengths else LENGTHS
    cases = args.cases.split(",")
    results: dict = {"world_size": world}
    if "attention" in cases:
        for kv in KV_CASES:
            results[f"attention/{kv}"] = attention_case(
                kv, group, lengths=lengths, head_dim=args.head_dim, device=device, dtype=DTYPES[args.dtype]
            )
    if "model" in cases:
        for kind in ("fused", "dense", "values"):
            results[f"model/{kind}"] = model_case(
                args.model, kind, group, lengths=lengths, device=device, dtype=args.dtype
            )
    if "trainer" in cases:
        results["trainer"] = trainer_case(args.model, sp, nproc=world, device=device.type)
    if rank == 0:
        torch.save(results, args.out)
    collectives.barrier()


if __name__ == "__main__":
    main()
