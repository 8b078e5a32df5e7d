"""Reward curves of bench/vs_trl.py results against wall-clock (seconds since each side's process started):
mean reward per step, a 5-step rolling mean, one colour per side, one line per round.

    python bench/plot_vs_trl.py bench/results/vs_trl_tiny_*.json --out docs/vs_trl_tiny.png
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

COLOURS = {"project": "tab:blue", "trl-hf": "tab:orange", "trl-vllm": "tab:green"}


def rolling(values: list[float], width: int = 5) -> list[float]:
    return [
        sum(values[max(0, i - width + 1) : i + 1]) / len(values[max(0, i - width + 1) : i + 1])
        for i in range(len(values))
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("results", nargs="+")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    seen = set()
    title = ""
    for path in args.results:
        data = json.loads(Path(path).read_text())
        title = f"{data['model']} model, batch {data['batch']}, {data['steps']} steps"
        for run in data["runs"]:
            side = run["side"]
            label = None if side in seen else side
            seen.add(side)
            ax.plot(run["step_wall_s"], rolling(run["reward_mean"]), color=COLOURS.get(side), label=label, lw=1.2)
    ax.set_xlabel("wall-clock seconds since the side started (start-up included)")
    ax.set_ylabel("mean reward per step (5-step rolling)")
    ax.set_title(title)
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
