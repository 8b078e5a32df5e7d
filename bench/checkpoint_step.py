"""Sharded checkpoint benchmark: save and load time and size of the learner's checkpoint (policy weights and
AdamW state, `learner.checkpoint_format`), and exact resume, also on another number of GPUs.

    torchrun --standalone --nproc_per_node 4 bench/checkpoint_step.py --phase save --dir /tmp/ck --out save.json
    torchrun --standalone --nproc_per_node 2 bench/checkpoint_step.py --phase load --dir /tmp/ck --out load.json

`save`: one train step on batch 0, the checkpoint (timed), then a step on batch 1 (the reference for the
resume). `load`: a fresh trainer loads the checkpoint (timed) and takes the step on batch 1; its loss and
gradient norm are compared with the saved run's.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.learner_step import SHAPES, build_model, trajectories  # noqa: E402


def folder_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--phase", choices=["save", "load"], required=True)
    parser.add_argument("--dir", required=True, help="checkpoint folder (shared by all processes)")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="7b")
    parser.add_argument("--model", help="model directory (default: built under the system temp folder)")
    parser.add_argument("--format", default="sharded", choices=["sharded", "full"])
    parser.add_argument("--trajectories", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--out", help="write the JSON result here (rank 0)")
    args = parser.parse_args()

    import torch

    from services.common.config import load_config
    from services.learner import collectives
    from services.learner.checkpoint import latest_checkpoint
    from services.learner.trainer import PolicyTrainer

    cpu = args.shape == "tiny"
    device = collectives.resolve_device("cpu" if cpu else "cuda")
    collectives.init_distributed(device)
    model_dir = args.model or str(Path(tempfile.gettempdir()) / f"omrl-ckpt-bench-{args.shape}")
    if collectives.is_rank0() and not (Path(model_dir) / "config.json").is_file():
        build_model(Path(model_dir), SHAPES[args.shape])
    collectives.barrier()
    config = load_config(
        None,
        [
            "seed=0",
            f"model.dtype={'float32' if cpu else 'bfloat16'}",
            "rollout.group_size=4",
            f"learner.device={'cpu' if cpu else 'cuda'}",
            f"learner.checkpoint_format={args.format}",
            "algorithm.micro_batch_size=1",
            "algorithm.lr=1e-5",
        ],
    )
    trainer = PolicyTrainer(config, model_dir)
    vocab = trainer.model.config.vocab_size
    batches = [trajectories(args.trajectories, 4, args.seq_len, vocab, seed=s) for s in range(2)]
    sync = torch.cuda.synchronize if not cpu else (lambda: None)
    result: dict = {"phase": args.phase, "gpus": collectives.world_size(), "shape": args.shape, "format": args.format}
    if not cpu:
        result["gpu"] = torch.cuda.get_device_name(device)
    if args.phase == "save":
        trainer.train_step(batches[0])
        trainer.policy_version = 1
        sync()
        start = time.perf_counter()
        path = trainer.save_checkpoint(args.dir)
        result["save_seconds"] = time.perf_counter() - start
        result["checkpoint_bytes"] = folder_bytes(path) if collectives.is_rank0() else 0
        continued = trainer.train_step(batches[1])
        result["next_step"] = {k: continued[k] for k in ("loss", "grad_norm", "entropy")}
    else:
        path = latest_checkpoint(args.dir)
        sync()
        start = time.perf_counter()
        trainer.load_checkpoint(path)
        sync()
        result["load_seconds"] = time.perf_counter() - start
        resumed = trainer.train_step(batches[1])
        result["next_step"] = {k: resumed[k] for k in ("loss", "grad_norm", "entropy")}
        saved = Path(args.dir) / "save.json"
        if saved.is_file():
            before = json.loads(saved.read_text())["next_step"]
            result["saved_run_next_step"] = before
            result["max_relative_difference"] = max(
                abs(result["next_step"][k] - before[k]) / max(abs(before[k]), 1e-12) for k in before
            )
    if not cpu:
        result["max_memory_gib_per_rank"] = collectives.all_gather_object(
            torch.cuda.max_memory_allocated(device) / 2**30
        )
    if collectives.is_rank0():
        text = json.dumps(result, indent=1)
        print(text, flush=True)
        if args.out:
            Path(args.out).write_text(text)
        if args.phase == "save":
            (Path(args.dir) / "save.json").write_text(text)


if __name__ == "__main__":
    main()
