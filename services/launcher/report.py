"""What a run shows a person: one line per step, a closing summary, and the reward curve."""
from __future__ import annotations

from pathlib import Path
from statistics import mean
from typing import Any


def step_line(m: dict[str, Any], total_steps: int) -> str:
    return (f"step {m['step']:>3}/{total_steps} | reward {m.get('reward_mean', float('nan')):+.3f} | "
            f"success {100 * m.get('success_rate', float('nan')):5.1f}% | kl {m.get('approx_kl', float('nan')):.4f} | "
            f"mismatch {m.get('mismatch_kl', float('nan')):.1e} | {m['step_seconds']:5.1f}s | policy v{m['policy_version']}")


def validation_line(m: dict[str, Any]) -> str:
    rates = ", ".join(f"{env} success {100 * m[f'validation/{env}/success_rate']:.1f}%"
                      for env in m.get("envs", []) if f"validation/{env}/success_rate" in m)
    failed = f", {m['validation/failed_episodes']} lost to infrastructure" if m.get("validation/failed_episodes") else ""
    return (f"validation at policy v{m['policy_version']}: {rates or 'no episode finished'} "
            f"({m.get('validation/episodes', 0)} episodes{failed}, {m.get('validation_seconds', 0):.1f}s)")


def learning_summary(history: list[dict[str, Any]], window: int = 5) -> dict[str, float]:
    rewards = [m["reward_mean"] for m in history]
    success = [m["success_rate"] for m in history]
    w = max(1, min(window, len(history) // 2))
    return {"first_reward": mean(rewards[:w]), "last_reward": mean(rewards[-w:]),
            "first_success": mean(success[:w]), "last_success": mean(success[-w:]), "window": w}


def write_reward_curve(history: list[dict[str, Any]], path: Path, title: str) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [m["step"] for m in history]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(steps, [m["reward_mean"] for m in history], marker="o", label="mean reward")
    ax.plot(steps, [m["success_rate"] for m in history], marker=".", linestyle="--", label="success rate")
    ax.set_xlabel("learner step (policy version)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
