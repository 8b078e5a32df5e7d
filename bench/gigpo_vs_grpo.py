"""GiGPO against GRPO in one process, deterministic (tests/support/inprocess_rl.py): the real learner, envs, prompt
format, parser and reward functions, the policy sampled with torch from the learner's weights. Same model, seeds,
batch and step budget for both estimators; per seed, the success curve of each and the ratio of their final
success (mean of the last `--last` steps).

    python bench/gigpo_vs_grpo.py --model runs/maze-warm/warm --seeds 0,1,2
    python bench/gigpo_vs_grpo.py --env corridor --options '{length: 12, distance: 5, max_turns: 9}' --steps 12

Without `--model` the tiny model is built and warm-started on the task first (`--warmstart-steps`, seed 0) into
`--build-dir`, once. The learner's settings are configs/tiny_model_rl.yaml with `inprocess_rl.RACE` on top
(`--set` adds more). JSON goes to `--out` (default bench/results/)."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.result_path import result_path  # noqa: E402


def race_arguments(doc: str, steps: int, last: int) -> argparse.ArgumentParser:
    """The arguments of an in-process race (this bench, bench/process_rewards.py): task, model, seeds, budget."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--env", default="corridor")
    parser.add_argument("--options", default="{length: 12, distance: 5, max_turns: 11}")
    parser.add_argument("--warmstart-options", default="{max_turns: 3}", help="env.options of the model's warm-start")
    parser.add_argument("--model", default=None, help="a Hugging Face model dir; default: build one")
    parser.add_argument("--build-dir", default="runs/bench-gigpo-vs-grpo")
    parser.add_argument("--warmstart-steps", type=int, default=150)
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--steps", type=int, default=steps)
    parser.add_argument("--last", type=int, default=last, help="final success: mean of the last this many steps")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--set", action="append", default=[], help="a config override, e.g. rollout.group_size=8")
    parser.add_argument("--out", default=None)
    return parser


def main() -> int:
    args = race_arguments(__doc__, steps=15, last=5).parse_args()

    from services.common.config import load_config
    from tests.support.inprocess_rl import race_config, train

    warm = [f"env.name={args.env}", f"env.options={args.warmstart_options}"]
    warm.append(f"model.warmstart_steps={args.warmstart_steps}")
    model = args.model or build_model(load_config(None, warm), Path(args.build_dir))
    results: dict[str, dict[str, list[float]]] = {}
    for seed in [int(s) for s in args.seeds.split(",")]:
        for advantage in ("grpo", "gigpo"):
            config = race_config(args.env, args.options, advantage, seed, args.steps, args.set)
            start = time.perf_counter()
            curve = train(config, model, threads=args.threads)
            took = time.perf_counter() - start
            results.setdefault(str(seed), {})[advantage] = curve.success
            line = " ".join(f"{s:.0%}" for s in curve.success)
            print(f"seed {seed} {advantage:5}: {line}  (last {args.last}: {curve.last(args.last):.0%}, {took:.0f} s)")
        runs = results[str(seed)]
        grpo, gigpo = (sum(runs[a][-args.last :]) / args.last for a in ("grpo", "gigpo"))
        ratio = gigpo / grpo if grpo else float("inf")
        # step 1 is the same for both (one policy, the same draws): the margin the slow test asserts leaves it out
        after = [sum(runs[a][1:]) / max(1, len(runs[a]) - 1) for a in ("gigpo", "grpo")]
        print(
            f"seed {seed}: GiGPO / GRPO over the last {args.last} steps = {ratio:.2f}; "
            f"GiGPO - GRPO over steps 2-{args.steps} = {after[0] - after[1]:+.1%}"
        )
    out = result_path(args.out, "gigpo_vs_grpo")
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"env": args.env, "options": args.options, "model": model, "steps": args.steps, "set": args.set}
    out.write_text(json.dumps({**meta, "load_avg_at_end": os.getloadavg(), "success": results}, indent=1))
    print(f"wrote {out}")
    return 0


def build_model(config, folder: Path) -> str:
    from services.launcher.tiny import prepare_tiny_model

    done = folder / "model.built"
    if not done.exists():
        done.parent.mkdir(parents=True, exist_ok=True)
        done.write_text(str(prepare_tiny_model(config, folder, say=print)))
    return done.read_text()


if __name__ == "__main__":
    sys.exit(main())
