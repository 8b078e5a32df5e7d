"""Process rewards against outcome-only reward in one process, deterministic (tests/support/inprocess_rl.py): the
real learner, env, prompt format, parser and reward functions, the policy sampled with torch from the learner's
weights. Same model, seeds, tasks, batch and step budget for both arms:

  outcome   the recipe's reward (goal, format, length penalty): one score per episode
  process   the same plus `hinted_action` (services/reward/hinted_action.py), a rule per turn: +1 for a move towards
            the exit the observation names, -1 for any other, weighted by `--weight`; each turn's score lands on
            that turn's tokens (services/learner/allocation.py)

    python bench/process_rewards.py --seeds 0,1,2 --steps 12
    python bench/process_rewards.py --advantage gigpo --set algorithm.gigpo_norm=mean_std_norm

Without `--model` the tiny model is built and warm-started on the task first (`--warmstart-steps`, seed 0) into
`--build-dir`, once (bench/gigpo_vs_grpo.py's builder). Per seed, each arm's success curve (the env's success,
which no reward reads directly) and the mean success of its last `--last` steps; JSON to `--out` (default
bench/results/), a PNG of the median curves with `--plot`."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.gigpo_vs_grpo import build_model, race_arguments  # noqa: E402
from bench.result_path import result_path  # noqa: E402

HINTS = '{"exit is to the left": left, "exit is to the right": right}'
OUTCOME = "goal: {weight: 1.0}, format: {weight: 0.1}, length_penalty: {weight: 0.1, params: {max_tokens: 64}}"
"""The default reward components (RewardConfig), spelled out: an override of `reward.components` replaces them all."""


def process_override(weight: float) -> str:
    hinted = f"hinted_action: {{weight: {weight}, params: {{hints: {HINTS}, mismatch: -1.0}}}}"
    return f"reward.components={{{OUTCOME}, {hinted}}}"


def main() -> int:
    parser = race_arguments(__doc__, steps=12, last=4)
    parser.add_argument("--advantage", default="grpo")
    parser.add_argument("--weight", type=float, default=0.1, help="weight of hinted_action")
    parser.add_argument("--plot", default=None, help="write the median success curves to this PNG")
    args = parser.parse_args()

    from services.common.config import load_config
    from tests.support.inprocess_rl import race_config, train

    warm = [f"env.name={args.env}", f"env.options={args.warmstart_options}"]
    warm.append(f"model.warmstart_steps={args.warmstart_steps}")
    model = args.model or build_model(load_config(None, warm), Path(args.build_dir))
    arms = {"outcome": args.set, "process": [*args.set, process_override(args.weight)]}
    results: dict[str, dict[str, list[float]]] = {}
    for seed in [int(s) for s in args.seeds.split(",")]:
        for arm, overrides in arms.items():
            config = race_config(args.env, args.options, args.advantage, seed, args.steps, overrides)
            start = time.perf_counter()
            curve = train(config, model, threads=args.threads)
            took = time.perf_counter() - start
            results.setdefault(str(seed), {})[arm] = curve.success
            line = " ".join(f"{s:.0%}" for s in curve.success)
            print(f"seed {seed} {arm:7}: {line}  (last {args.last}: {curve.last(args.last):.0%}, {took:.0f} s)")
    finals = {arm: [sum(r[arm][-args.last :]) / args.last for r in results.values()] for arm in arms}
    medians = {arm: statistics.median(v) for arm, v in finals.items()}
    print(f"median success over the last {args.last} steps: " + ", ".join(f"{a} {m:.0%}" for a, m in medians.items()))
    out = result_path(args.out, "process_rewards")
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"env": args.env, "options": args.options, "model": model, "advantage": args.advantage}
    meta |= {"weight": args.weight, "steps": args.steps, "set": args.set, "last": args.last}
    out.write_text(json.dumps({**meta, "load_avg_at_end": os.getloadavg(), "success": results}, indent=1))
    print(f"wrote {out}")
    if args.plot:
        plot(results, args, Path(args.plot))
    return 0


def plot(results: dict[str, dict[str, list[float]]], args: argparse.Namespace, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    for arm, colour in (("outcome", "tab:gray"), ("process", "tab:blue")):
        curves = [r[arm] for r in results.values()]
        steps = range(1, len(curves[0]) + 1)
        for curve in curves:
            ax.plot(steps, curve, color=colour, alpha=0.25, linewidth=1)
        ax.plot(steps, [statistics.median(c) for c in zip(*curves)], color=colour, linewidth=2, label=arm)
    ax.set(xlabel="step", ylabel="success", ylim=(0, 1), title=f"{args.env} {args.options}, {args.advantage}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    print(f"wrote {path}")


if __name__ == "__main__":
    sys.exit(main())
