"""Reward-model scoring throughput: the `reward_model` component (services/reward/reward_model.py) at batch 1 against
batched, and a bare Hugging Face forward of the same batches as the limit, in one process on the same model.

    python bench/reward_model.py                       # the tiny classifier (hidden 128, 2 layers), CPU
    python bench/reward_model.py --shape 0.5b --episodes 64 --tokens 256   # Qwen2.5-0.5B-shaped, random weights
    python bench/reward_model.py --group 8 --prompt-tokens 96               # GRPO groups sharing a prompt

Episodes are random token ids of `--tokens` each (the component's `tokens` input); with `--group G`, each Score call
is a group of G episodes whose first `--prompt-tokens` are the same (a task's prompt), as `reward.score_each: group`
sends them. Scored four ways:
  single   the component with max_batch 1: `--callers` threads each scoring its calls one at a time
  batched  the component with max_batch `--batch`: the same threads; the batcher merges the calls of the threads into
           passes (max_wait_ms `--wait-ms`); shared prefixes and repeats computed once (`share_prefixes`, the default)
  unshared the same with `share_prefixes: false`: every episode's every token computed
  bare     the component's forward on slices of `--batch` episodes, one thread: the passes alone
Episodes per second of each, the median of `--rounds` rounds after a warm-up round; batched / single, batched /
bare, and batched / unshared."""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.result_path import result_path  # noqa: E402

TINY = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2)
QWEN25_05B = dict(
    hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2
)


def build(out: Path, shape: dict, vocab: int, dtype: str) -> str:
    import torch
    from tokenizers import Tokenizer, models
    from transformers import LlamaConfig, LlamaForSequenceClassification, PreTrainedTokenizerFast

    config = LlamaConfig(vocab_size=vocab, num_labels=1, pad_token_id=0, max_position_embeddings=4096, **shape)
    torch.manual_seed(0)
    LlamaForSequenceClassification(config).to(getattr(torch, dtype)).save_pretrained(out)
    vocab_map = {"<pad>": 0, **{f"t{i}": i for i in range(1, vocab)}}
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab_map, unk_token="t1")))
    tok.pad_token = "<pad>"
    tok.save_pretrained(out)
    return str(out)


def episodes(count: int, tokens: int, vocab: int, group: int = 1, prompt_tokens: int = 0):
    """Random episodes of `tokens`; with `prompt_tokens`, each run of `group` shares its first `prompt_tokens`."""
    from services.common.trajectory import TrajectoryBuilder

    rng, out = random.Random(0), []
    prompt_len = prompt_tokens or tokens // 2
    for i in range(count):
        if i % group == 0 or not prompt_tokens:
            prompt = [rng.randrange(1, vocab) for _ in range(prompt_len)]
        b = TrajectoryBuilder(env="bench", task_index=i // group, group_id=f"g{i // group}", prompt_ids=list(prompt))
        reply = [rng.randrange(1, vocab) for _ in range(tokens - prompt_len)]
        b.add_model_turn(
            reply, [-1.0] * len(reply), policy_version=0, text="", action="", action_valid=True, finish_reason="stop"
        )
        out.append(b.finish(env_return=0.0, success=False, stop_reason="done"))
    return out


def threaded(score, trajs, callers: int, group: int) -> float:
    """Seconds for `callers` threads to score `trajs` (their calls split evenly), one Score call per `group`."""
    calls = [trajs[i : i + group] for i in range(0, len(trajs), group)]
    shares = [calls[i::callers] for i in range(callers)]
    start = time.perf_counter()
    threads = [threading.Thread(target=lambda s=s: [score(call) for call in s]) for s in shares]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - start


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=["tiny", "0.5b"], default="tiny")
    ap.add_argument("--episodes", type=int, default=256)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--callers", type=int, default=8, help="concurrent Score callers (the rollout's groups in flight)")
    ap.add_argument("--group", type=int, default=1, help="episodes a Score call (a GRPO group)")
    ap.add_argument("--prompt-tokens", type=int, default=0, help="tokens a group's episodes share (its prompt)")
    ap.add_argument("--wait-ms", type=float, default=5.0)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--out")
    args = ap.parse_args()
    if args.prompt_tokens >= args.tokens or args.episodes % args.group:
        ap.error("--prompt-tokens must be under --tokens, and --episodes a multiple of --group")

    import torch

    from services.reward.reward_model import RewardModel

    vocab = 4096 if args.shape == "tiny" else 151936
    shape = TINY if args.shape == "tiny" else QWEN25_05B
    with tempfile.TemporaryDirectory() as tmp:
        path = build(Path(tmp) / "rm", shape, vocab, args.dtype)
        common = dict(max_length=args.tokens, device=args.device, dtype=args.dtype)
        single = RewardModel(path, max_batch=1, max_wait_ms=0, **common)
        batched = RewardModel(path, max_batch=args.batch, max_wait_ms=args.wait_ms, **common)
        unshared = RewardModel(path, max_batch=args.batch, max_wait_ms=args.wait_ms, share_prefixes=False, **common)
    trajs = episodes(args.episodes, args.tokens, vocab, args.group, args.prompt_tokens)
    ids = [batched.input_ids(t) for t in trajs]
    sizes: list[int] = []  # the batched side's pass sizes: far under --batch when the callers cannot keep it full
    batched.batcher.on_batch = lambda size, seconds: sizes.append(size)

    def bare() -> float:
        start = time.perf_counter()
        for i in range(0, len(ids), args.batch):
            batched._forward(ids[i : i + args.batch])
        if batched.device.startswith("cuda"):
            torch.cuda.synchronize()
        return time.perf_counter() - start

    sides = {
        "single": lambda: threaded(single.score_batch, trajs, args.callers, args.group),
        "batched": lambda: threaded(batched.score_batch, trajs, args.callers, args.group),
        "unshared": lambda: threaded(unshared.score_batch, trajs, args.callers, args.group),
        "bare": bare,
    }
    seconds: dict[str, list[float]] = {name: [] for name in sides}
    for round_ in range(args.rounds + 1):
        for name, run in sides.items():
            took = run()
            if round_:
                seconds[name].append(took)
            print(
                f"round {round_}{' (warm-up)' if not round_ else ''} {name:8s} {args.episodes / took:9.1f} episodes/s",
                flush=True,
            )
        if not round_:
            sizes.clear()
    rate = {name: args.episodes / statistics.median(s) for name, s in seconds.items()}
    for name, r in rate.items():
        print(f"median {name:8s} {r:9.1f} episodes/s")
    ratios = rate["batched"] / rate["single"], rate["batched"] / rate["bare"], rate["batched"] / rate["unshared"]
    print(f"batched / single {ratios[0]:.2f}x; batched / bare {ratios[1]:.2f}x; batched / unshared {ratios[2]:.2f}x")
    print(f"batched passes {len(sizes)}, mean size {statistics.mean(sizes):.1f} of {args.batch}")
    out = result_path(args.out, f"reward_model_{args.shape}")
    out.write_text(
        json.dumps(
            {
                "args": vars(args),
                "torch": torch.__version__,
                "threads": torch.get_num_threads(),
                "device": batched.device,
                "gpu": torch.cuda.get_device_name() if batched.device.startswith("cuda") else None,
                "batched_mean_batch": statistics.mean(sizes),
                "episodes_per_s": rate,
                "seconds": seconds,
            },
            indent=1,
        )
    )
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
