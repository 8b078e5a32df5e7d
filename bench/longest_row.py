"""The longest trajectory one GPU trains against the learner's own estimate (`PolicyTrainer.max_row_tokens`,
services/learner/levers.py `longest_row`), the length past which the poison guard refuses a trajectory.

Trains one-trajectory steps of growing length (fractions of the estimate) with the learner's defaults and prints,
for each, whether it trained or ran out of memory, its time and the peak memory. Needs a CUDA device:

    python bench/longest_row.py --shape 0.5b --fractions 0.5,0.8,1.0,1.3 --out result.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.learner_step import SHAPES, build_model, default_model_dir, trajectories  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="0.5b")
    parser.add_argument("--fractions", default="0.5,0.8,1.0,1.3", help="row lengths as fractions of the estimate")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a run-config override")
    parser.add_argument("--out", help="write the JSON result here")
    args = parser.parse_args()

    import torch

    from services.common.config import load_config
    from services.learner.trainer import PolicyTrainer

    model_dir = default_model_dir(args.shape)
    if not (model_dir / "config.json").exists():
        build_model(model_dir, SHAPES[args.shape])
    overrides = [
        "algorithm.advantage=reinforce_plus_plus",  # one trajectory a step: no group needed
        "rollout.group_size=1",
        f"model.path={model_dir}",
        "model.dtype=bfloat16",
        "model.max_model_len=131072",
        "learner.steps=100",
        *args.set,
    ]
    trainer = PolicyTrainer(load_config(None, overrides), str(model_dir))
    estimate = trainer.max_row_tokens
    learner, algo = trainer.config.learner, trainer.config.algorithm
    print(
        f"estimate: {estimate} tokens in one row (attention {learner.attention}, checkpointing "
        f"{learner.activation_checkpointing}, chunk {learner.logprob_chunk_tokens}, micro-batch budget "
        f"{algo.micro_batch_tokens}, compile {learner.compile})",
        flush=True,
    )
    rows = []
    for fraction in (float(f) for f in args.fractions.split(",")):
        length = int(estimate * fraction)
        (traj,) = trajectories(1, 1, length, SHAPES[args.shape]["vocab_size"], seed=1)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        try:
            trainer.train_step([traj])
            torch.cuda.synchronize()
            outcome = "trained"
        except torch.OutOfMemoryError:
            outcome = "out of memory"
            trainer.optimizer.zero_grad(set_to_none=True)
        seconds = time.perf_counter() - start
        peak = torch.cuda.max_memory_allocated() / 2**30
        rows.append({"fraction": fraction, "tokens": length, "outcome": outcome, "seconds": seconds, "peak_gib": peak})
        print(f"{fraction:4.2f} x estimate = {length:7d} tokens: {outcome:13s} {seconds:6.2f} s, peak {peak:6.1f} GiB")
    total = torch.cuda.get_device_properties(0).total_memory / 2**30
    result = {
        "shape": args.shape,
        "gpu": torch.cuda.get_device_name(0),
        "gpu_gib": total,
        "estimate_tokens": estimate,
        "levers": {
            "attention": learner.attention,
            "activation_checkpointing": learner.activation_checkpointing,
            "logprob_chunk_tokens": learner.logprob_chunk_tokens,
            "micro_batch_tokens": algo.micro_batch_tokens,
            "compile": learner.compile,
        },
        "overrides": args.set,
        "rows": rows,
    }
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
