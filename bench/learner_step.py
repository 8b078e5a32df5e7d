"""Learner step benchmark: the project's PolicyTrainer (FSDP2 full sharding, bf16 mixed precision) on a
Qwen2.5-0.5B-shaped model with random weights and synthetic multi-turn trajectories. Needs torch and
transformers only (no vLLM, no Redis).

    python bench/learner_step.py --out result.json                                  # 1 GPU
    torchrun --standalone --nproc_per_node 2 bench/learner_step.py --out result.json  # 2 GPUs, FSDP
    torchrun --standalone --nproc_per_node 4 bench/learner_step.py --shape 7b --bare \
        --set learner.activation_checkpointing=true                                  # Qwen2.5-7B shape
    python bench/learner_step.py --tiny --bare --steps 1 --warmup 1                  # CPU: checks the script

Step time is the wall time of `PolicyTrainer.train_step` (collate, scoring forward, advantages, update),
the median over `--steps` timed steps after `--warmup` untimed ones (with compiled layers, the warm-up also runs
each timed batch once, so that no graph is built inside a timed step: `--no-rehearsal` skips that).
FLOPs per step (dense, causal attention; N = parameters that take part in matmuls: the LM head, not the input
embedding, which is a lookup (a tied embedding is counted once, as the head); recomputed activations are not
counted):
  forward of one sequence of S tokens = 2 * N * S + 2 * L * d * S^2
  step = (1 + 3 * ppo_epochs) * sum over sequences of that forward      (scoring pass + fwd/bwd per epoch)
  (+ the critic's (1 + 3 * ppo_epochs) forwards for gae, + one reference forward when a KL term is on)
MFU = FLOPs / time / (GPUs * peak) over the timed steps, each batch's FLOPs from its own real (unpadded)
sequence lengths, summed, over their times summed (the batches are ragged: 62k-79k tokens at the defaults);
peak = 989.4 TFLOP/s (H100 SXM dense bf16, datasheet). `mfu_batch0_median` is the earlier figure (the first
batch's FLOPs over the median step), kept to compare with older results.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

QWEN25_05B = dict(
    hidden_size=896,
    num_hidden_layers=24,
    num_attention_heads=14,
    num_key_value_heads=2,
    intermediate_size=4864,
    vocab_size=151936,
    tie_word_embeddings=True,
    max_position_embeddings=32768,
    rope_theta=1000000.0,
    rms_norm_eps=1e-6,
    pad_token_id=151643,
    eos_token_id=151645,
)
QWEN25_7B = dict(
    QWEN25_05B,
    hidden_size=3584,
    num_hidden_layers=28,
    num_attention_heads=28,
    num_key_value_heads=4,
    intermediate_size=18944,
    vocab_size=152064,
    tie_word_embeddings=False,
)
TINY = dict(
    QWEN25_05B,
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    intermediate_size=128,
    vocab_size=1024,
    pad_token_id=0,
    eos_token_id=1,
)
SHAPES = {"0.5b": QWEN25_05B, "7b": QWEN25_7B, "tiny": TINY}
PEAK_TFLOPS = {"H100": 989.4, "H200": 989.4}


def build_model(path: Path, shape: dict) -> Path:
    import torch
    from transformers import Qwen2Config

    from services.common.tiny_model import build_random_model

    device = "cuda" if torch.cuda.is_available() else "cpu"
    return build_random_model(path, Qwen2Config(**shape), seed=0, dtype="bfloat16", device=device)


def default_model_dir(shape: str) -> Path:
    return Path(tempfile.gettempdir()) / f"omrl-bench-qwen25-{shape}"


def trajectories(num: int, group_size: int, seq_len: int, vocab: int, seed: int, min_len: int = 0) -> list:
    """Multi-turn episodes of `seq_len` tokens (or of a length drawn uniformly from [min_len, seq_len]): a
    prompt, then model turns (about 60% of the tokens, trained on) separated by observations."""
    from services.common.trajectory import TrajectoryBuilder

    rng = random.Random(seed)
    out = []
    longest = seq_len
    for i in range(num):
        seq_len = rng.randint(min_len, longest) if min_len else longest
        prompt_len = seq_len // 4
        b = TrajectoryBuilder(
            env="bench",
            task_index=i // group_size,
            group_id=f"g{i // group_size}",
            prompt_ids=[rng.randrange(vocab) for _ in range(prompt_len)],
        )
        while b.length < seq_len:
            n = min(rng.randint(64, 192), seq_len - b.length)
            b.add_model_turn(
                [rng.randrange(vocab) for _ in range(n)],
                [-rng.uniform(0.1, 4.0) for _ in range(n)],
                policy_version=0,
                text="",
                action="",
                action_valid=True,
                finish_reason="stop",
            )
            obs = min(rng.randint(16, 96), seq_len - b.length)
            b.add_observation([rng.randrange(vocab) for _ in range(obs)], env_reward=0.0)
        traj = b.finish(env_return=0.0, success=rng.random() < 0.5, stop_reason="done")
        traj.reward = float(traj.success)
        out.append(traj)
    return out


def matmul_params(model) -> int:
    """Parameters used in matmuls: everything but norms and an untied input embedding (a lookup); a tied
    embedding is counted once, as the LM head."""
    embedding, head = model.get_input_embeddings(), model.get_output_embeddings()
    seen, total = set(), 0
    if head is not None and embedding.weight is not head.weight:
        seen.add(id(embedding.weight))
    for name, p in model.named_parameters():
        if id(p) in seen or p.dim() < 2:
            continue
        seen.add(id(p))
        total += p.numel()
    return total


def forward_flops(n_params: int, layers: int, width: int, lengths: list[int]) -> float:
    return float(sum(2 * n_params * s + 2 * layers * width * s * s for s in lengths))


class CollectionClock:
    """Seconds and runs (by generation) of Python's garbage collections since `reset` (gc.callbacks)."""

    def __init__(self):
        import gc

        self.reset()
        self._start = 0.0
        gc.callbacks.append(self._on_gc)

    def reset(self) -> None:
        self.seconds, self.runs = 0.0, [0, 0, 0]

    def _on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self.seconds += time.perf_counter() - self._start
            self.runs[info["generation"]] += 1

    def close(self) -> None:
        import gc

        gc.callbacks.remove(self._on_gc)


def host_busy_seconds() -> float:
    """CPU seconds every core of the host (or container view) spent busy so far, from /proc/stat; 0 elsewhere."""
    try:
        fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
    except OSError:
        return 0.0
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(f) for f in fields[:8])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def allocator_counts(cuda: bool) -> dict[str, int]:
    """The CUDA caching allocator's retries (a failed cudaMalloc: every cached block freed, the device synced)
    and its cudaMalloc/cudaFree calls so far."""
    if not cuda:
        return {}
    import torch

    stats = torch.cuda.memory_stats()
    return {k: int(stats.get(k, 0)) for k in ("num_alloc_retries", "num_device_alloc", "num_device_free")}


def bare_loop(trainer, batches: list, warmup: int, sync) -> list[float]:
    """Seconds of a plain step on each batch after the first `warmup`: the trainer's own model, optimizer and
    micro-batches (so the same packing, attention kernel, chunked head and FSDP), a mean token NLL, one optimizer
    step."""
    import torch

    from services.learner import parallelize
    from services.learner.batch import collate
    from services.learner.model import token_logprobs

    chunk, times = trainer.config.learner.logprob_chunk_tokens, []
    for i, trajs in enumerate(batches):
        batch = collate(trajs, trainer.pad_id)
        sync()
        start = time.perf_counter()
        trainer.optimizer.zero_grad(set_to_none=True)
        for mini in trainer._mini_batches(batch):
            for j, m in enumerate(mini.micro):
                b = m.batch
                lp = token_logprobs(trainer.model, b.input_ids, b.attention_mask, chunk, trainer.pack)
                loss = -(lp * b.response_mask).sum() / mini.norm["num_tokens"]
                parallelize.set_last_micro_batch(trainer.model, j == len(mini.micro) - 1)
                (loss * trainer.world_size).backward()
        torch.nn.utils.clip_grad_norm_(trainer.model.parameters(), 1.0)
        trainer.optimizer.step()
        sync()
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return times


def dynamo_counts() -> dict:
    """torch.compile's running totals (graphs captured, recompiles, graph breaks): equal before and after the
    timed steps when nothing was compiled during them."""
    try:
        from torch._dynamo.utils import counters
    except ImportError:
        return {}
    return {
        "stats": dict(counters["stats"]),
        "recompiles": sum(counters["recompiles"].values()),
        "graph_breaks": sum(counters["graph_break"].values()),
    }


def profile_step(step, sync, rows: int = 40) -> dict:
    """One profiled call of `step`: wall time, GPU-busy time, kernel launches, and the top operators by
    GPU time and by CPU time (printed on rank 0), to see where a step is launch-bound."""
    from torch.profiler import ProfilerActivity, profile

    from services.learner import collectives

    sync()
    start = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        sync()
    wall = time.perf_counter() - start
    kernels = [e for e in prof.events() if e.device_type.name == "CUDA"]
    averages = prof.key_averages()
    if collectives.is_rank0():
        print(averages.table(sort_by="self_cuda_time_total", row_limit=rows), flush=True)
        print(averages.table(sort_by="self_cpu_time_total", row_limit=rows), flush=True)

    def top(key: str) -> list[dict]:
        ranked = sorted(averages, key=lambda a: getattr(a, key), reverse=True)[:rows]
        return [
            {
                "name": a.key[:80],
                "count": a.count,
                "self_cpu_ms": a.self_cpu_time_total / 1e3,
                "self_gpu_ms": a.self_device_time_total / 1e3,
            }
            for a in ranked
        ]

    return {
        "wall_s": wall,
        "gpu_busy_s": sum(e.time_range.elapsed_us() for e in kernels) / 1e6,  # streams overlapping: counted twice
        "kernels": len(kernels),
        "top_gpu": top("self_device_time_total"),
        "top_cpu": top("self_cpu_time_total"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="model directory (default: a random Qwen2.5-0.5B-shaped model)")
    parser.add_argument("--advantage", default="grpo")
    parser.add_argument("--trajectories", type=int, default=64, help="global batch (sequences per step)")
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument(
        "--min-len",
        type=int,
        default=0,
        help="draw each sequence's length from [min-len, seq-len] (RL batches are ragged); 0: all seq-len",
    )
    parser.add_argument(
        "--bare",
        action="store_true",
        help="also time a bare training loop in the same process: the same model, optimizer, "
        "micro-batches, packing and attention kernel; forward, backward, optimizer step, no RL",
    )
    parser.add_argument("--micro-batch", type=int, default=4, help="sequences per forward/backward per GPU")
    parser.add_argument("--ppo-epochs", type=int, default=1)
    parser.add_argument("--kl-loss", action="store_true", help="also run the reference model (KL loss term)")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument(
        "--no-rehearsal",
        action="store_true",
        help="with compiled layers, do not also run each timed batch once in the warm-up (a graph may then be "
        "built inside a timed step)",
    )
    parser.add_argument("--out", help="write the JSON result here (rank 0)")
    parser.add_argument("--profile", action="store_true", help="print the top CUDA kernels of one extra step")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="0.5b", help="the random model's Qwen2.5 shape")
    parser.add_argument(
        "--tiny", action="store_true", help="a tiny Qwen2 on CPU (any world size): checks the script, measures nothing"
    )
    parser.add_argument("--build-only", action="store_true", help="build the random model directory, then exit")
    parser.add_argument(
        "--bare-warmup", type=int, help="untimed bare steps (default --warmup; the layers are compiled by then)"
    )
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a run-config override, e.g. learner.activation_checkpointing=true (repeatable)",
    )
    args = parser.parse_args()
    if args.tiny:
        args.shape = "tiny"
    tiny = args.shape == "tiny"

    if args.build_only:  # one process, before rows that share the directory start at once
        path = Path(args.model or default_model_dir(args.shape))
        if not (path / "config.json").is_file():
            build_model(path, SHAPES[args.shape])
        return

    import torch

    from services.common.config import load_config
    from services.learner import collectives
    from services.learner.batch import collate
    from services.learner.trainer import PolicyTrainer

    device_name = "cpu" if tiny else "cuda"
    device = collectives.resolve_device(device_name)
    collectives.init_distributed(device)
    model_dir = args.model
    if not model_dir:
        model_dir = str(default_model_dir(args.shape))
        if collectives.is_rank0() and not (Path(model_dir) / "config.json").is_file():
            build_model(Path(model_dir), SHAPES[args.shape])
        collectives.barrier()
    config = load_config(
        None,
        [
            "seed=0",
            f"model.dtype={'float32' if tiny else 'bfloat16'}",
            f"rollout.group_size={args.group_size}",
            f"learner.device={device_name}",
            "learner.steps=1000",
            f"algorithm.advantage={args.advantage}",
            f"algorithm.micro_batch_size={args.micro_batch}",
            f"algorithm.ppo_epochs={args.ppo_epochs}",
            "algorithm.lr=1e-6",
            "algorithm.critic_lr=1e-6",
            f"algorithm.use_kl_loss={str(args.kl_loss).lower()}",
            *args.set,
        ],
    )
    trainer = PolicyTrainer(config, model_dir)
    hf_config = trainer.model.config
    vocab = hf_config.vocab_size
    batches = [
        trajectories(args.trajectories, args.group_size, args.seq_len, vocab, seed=s, min_len=args.min_len)
        for s in range(args.warmup + args.steps)
    ]
    cuda = device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    times, metrics, phases = [], {}, {}
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    compiles, stalls = {}, []
    collections = CollectionClock()
    timed = batches[args.warmup :]
    # compiled layers build a graph for each new shape: the warm-up meets every timed batch once, so no graph is
    # built inside a timed step
    rehearsed = timed if trainer.config.learner.compile and not args.no_rehearsal else []
    schedule = batches[: args.warmup] + rehearsed + timed
    first_timed = len(schedule) - len(timed)
    for i, batch in enumerate(schedule):
        if i == first_timed:
            compiles["after_warmup"] = dynamo_counts()
        sync()
        allocator = allocator_counts(cuda)
        collections.reset()
        cpu_own, cpu_all = time.process_time(), host_busy_seconds()
        start = time.perf_counter()
        metrics = trainer.train_step(batch)
        sync()
        if i >= first_timed:
            times.append(time.perf_counter() - start)
            for key, value in metrics.items():
                if key.startswith("time/"):
                    phases.setdefault(key, []).append(value)
            after = allocator_counts(cuda)
            stalls.append(
                {
                    "gc_s": collections.seconds,
                    "gc_runs": collections.runs,
                    "cpu_own_s": time.process_time() - cpu_own,
                    "cpu_host_busy_s": host_busy_seconds() - cpu_all,
                }
                | {k: after[k] - allocator[k] for k in after}
            )
    collections.close()
    compiles["after_timed_steps"] = dynamo_counts()
    step_s = statistics.median(times)
    lengths = [len(t.token_ids) for t in batches[0]]
    tokens = sum(lengths)
    timed_lengths = [[len(t.token_ids) for t in b] for b in batches[args.warmup :]]
    timed_tokens = sum(map(sum, timed_lengths))
    n_policy = matmul_params(trainer.model)
    layers, width = (
        hf_config.num_hidden_layers,
        hf_config.num_attention_heads
        * (getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads),
    )
    fused = trainer._fused_scoring(len(trainer._mini_batches(collate(batches[0], trainer.pad_id))))
    per_pass = (0 if fused else 1) + 3 * args.ppo_epochs
    n_critic = matmul_params(trainer.critic.model) if trainer.critic is not None else 0

    def step_flops(lens: list[int]) -> float:
        f = per_pass * forward_flops(n_policy, layers, width, lens)
        if n_critic:
            f += per_pass * forward_flops(n_critic, layers, width, lens)
        if trainer.reference is not None:
            f += forward_flops(n_policy, layers, width, lens)
        return f

    flops = step_flops(lengths)
    timed_flops = sum(step_flops(lens) for lens in timed_lengths)
    gpu = torch.cuda.get_device_name(device) if cuda else "cpu"
    peak = next((v for k, v in PEAK_TFLOPS.items() if k in gpu), 989.4)
    world = collectives.world_size()
    mem = collectives.all_gather_object(torch.cuda.max_memory_allocated(device) / 2**30 if cuda else 0.0)
    result = {
        "shape": args.shape,
        "gpu": gpu,
        "gpus": world,
        "advantage": args.advantage,
        "ppo_epochs": args.ppo_epochs,
        "kl_loss": args.kl_loss,
        "trajectories": args.trajectories,
        "seq_len": args.seq_len,
        "micro_batch_per_gpu": args.micro_batch,
        "tokens_per_step": tokens,
        "timed_tokens_per_step": [sum(lens) for lens in timed_lengths],
        "timed_micro_batches_per_step": [
            sum(len(m.micro) for m in trainer._mini_batches(collate(b, trainer.pad_id))) for b in batches[args.warmup :]
        ],
        "dynamo_counts": compiles,
        "rehearsed_batches": len(rehearsed),
        "trained_tokens_per_step": metrics["num_tokens"],
        "matmul_params": n_policy,
        "step_seconds_median": step_s,
        "step_seconds": times,
        "tokens_per_second": timed_tokens / sum(times),
        "tokens_per_second_per_gpu": timed_tokens / sum(times) / world,
        "tflops_per_step": flops / 1e12,
        "achieved_tflops_per_gpu": timed_flops / sum(times) / world / 1e12,
        "peak_tflops_per_gpu": peak,
        "mfu": timed_flops / sum(times) / world / (peak * 1e12),
        "mfu_batch0_median": flops / step_s / world / (peak * 1e12),
        "max_memory_gib_per_rank": mem,
        "loss": metrics["loss"],
        "grad_norm": metrics["grad_norm"],
        "fused_scoring": fused,
        "min_len": args.min_len,
        "torch": torch.__version__,
        "phase_seconds": {k.removeprefix("time/"): v for k, v in phases.items()},
        "stalls_per_step": stalls,
        "phase_seconds_median": {k.removeprefix("time/"): statistics.median(v) for k, v in phases.items()},
        "cuda_alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""),
        "overrides": args.set,
        "levers": {  # what the trainer ran with, its `auto` settings resolved for this device
            "pack_sequences": trainer.config.learner.pack_sequences,
            "attention": trainer.config.learner.attention,
            "compile": trainer.config.learner.compile,
            "logprob_chunk_tokens": trainer.config.learner.logprob_chunk_tokens,
            "activation_checkpointing": trainer.config.learner.activation_checkpointing,
            "micro_batch_tokens": trainer.config.algorithm.micro_batch_tokens,
        },
    }
    if args.bare:
        bare_warmup = args.warmup if args.bare_warmup is None else min(args.bare_warmup, args.warmup)
        # the same timed batches as the learner's steps
        bare_times = bare_loop(trainer, batches[args.warmup - bare_warmup :], bare_warmup, sync)
        bare_flops = sum(3 * forward_flops(n_policy, layers, width, lens) for lens in timed_lengths)
        result.update(
            bare_step_seconds_median=statistics.median(bare_times),
            bare_step_seconds=bare_times,
            bare_mfu=bare_flops / sum(bare_times) / world / (peak * 1e12),
            learner_over_bare=sum(times) / sum(bare_times),
        )
    if args.profile and cuda:
        result["profile"] = {"learner": profile_step(lambda: trainer.train_step(batches[-1]), sync)}
        if args.bare:
            result["profile"]["bare"] = profile_step(lambda: bare_loop(trainer, batches[-1:], 0, sync), sync)
    if collectives.is_rank0():
        text = json.dumps(result, indent=1)
        print(text, flush=True)
        if args.out:
            Path(args.out).write_text(text)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
