"""What a run shows a person: start-up stages, one line per step, a closing summary, and the reward curve.

A view receives the stages and steps of a LocalRun: `PlainView` says them as lines (tests, a pipe),
`SupervisorView` writes stages as `@stage {json}` lines that the job API turns into structured events,
and the launcher's terminal view (`services.cli.live`) draws them live."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from statistics import mean
from typing import Any

STAGE_MARK = "@stage "
DETAIL_MARK = "@detail "
"""Log lines behind a failure (a service's log tail): kept in the log (`omrl logs`), not sent as events."""
_EXCEPTION_LINE = re.compile(r"^\s*(?:[A-Za-z_][\w.]*\.)?[A-Z]\w*(?:Error|Exception|Exit|Interrupt)\b.*")


def failure_summary(exc: BaseException, limit: int = 400) -> str:
    """One line for a failed run: the failure's first line and, from the log tail it carries, the last
    exception line (`learner exited with 1: ValueError: ...`)."""
    lines = [line for line in str(exc).splitlines() if line.strip()] or [type(exc).__name__]
    first = lines[0].rstrip(":")
    cause = next((line.strip() for line in reversed(lines[1:]) if _EXCEPTION_LINE.match(line)), None)
    return (f"{first}: {cause}" if cause else first)[:limit]


def stage_record(service: str, stage: str, message: str, **extra: Any) -> dict[str, Any]:
    """A start-up or restart event: which service, which stage (building, started, loading, healthy, ready;
    restarting, restarted), and a line a person reads."""
    return {"message": message, "service": service, "stage": stage, **extra}


def encode_stage(record: dict[str, Any]) -> str:
    return STAGE_MARK + json.dumps(record)


def decode_stage(line: str) -> dict[str, Any] | None:
    if not line.startswith(STAGE_MARK):
        return None
    try:
        record = json.loads(line[len(STAGE_MARK) :])
    except ValueError:
        return None
    return record if isinstance(record, dict) and isinstance(record.get("message"), str) else None


class PlainView:
    def __init__(self, say: Callable[[str], None] = print):
        self.say = say

    def stage(self, record: dict[str, Any]) -> None:
        self.say(record["message"])

    def step(self, metrics: dict[str, Any], total_steps: int) -> None:
        self.say(step_line(metrics, total_steps))

    def close(self) -> None:
        pass


class SupervisorView(PlainView):
    def stage(self, record: dict[str, Any]) -> None:
        self.say(encode_stage(record))


def step_line(m: dict[str, Any], total_steps: int) -> str:
    return (
        f"step {m['step']:>3}/{total_steps} | reward {m.get('reward_mean', float('nan')):+.3f} | "
        f"success {100 * m.get('success_rate', float('nan')):5.1f}% | kl {m.get('approx_kl', float('nan')):.4f} | "
        f"mismatch {m.get('mismatch_kl', float('nan')):.1e} | {m['step_seconds']:5.1f}s | policy v{m['policy_version']}"
        + (f" | uniform {m['groups_uniform']}" if m.get("groups_uniform") else "")
        + (f" | filtered {m['groups_filtered']}" if m.get("groups_filtered") else "")
    )


ALERT_MARK = "alert: "


def alert_line(m: dict[str, Any]) -> str:
    """A `kind: alert` entry of the metrics stream as the line the live view shows (the job API keeps the
    entry itself as an `alert` event, so a local job's launcher does not repeat the line as a message)."""
    return ALERT_MARK + str(m.get("message", m))


def validation_line(m: dict[str, Any]) -> str:
    rates = ", ".join(
        f"{env} success {100 * m[f'validation/{env}/success_rate']:.1f}%"
        for env in m.get("envs", [])
        if f"validation/{env}/success_rate" in m
    )
    failed = (
        f", {m['validation/failed_episodes']} lost to infrastructure" if m.get("validation/failed_episodes") else ""
    )
    later = m.get("validation/turns_of_later_versions")
    later = f", {later} turns by later policies" if later else ""
    return (
        f"validation at policy v{m['policy_version']}: {rates or 'no episode finished'} "
        f"({m.get('validation/episodes', 0)} episodes{failed}{later}, {m.get('validation_seconds', 0):.1f}s)"
    )


def learning_summary(history: list[dict[str, Any]], window: int = 5) -> dict[str, float]:
    rewards = [m["reward_mean"] for m in history]
    success = [m["success_rate"] for m in history]
    w = max(1, min(window, len(history) // 2))
    return {
        "first_reward": mean(rewards[:w]),
        "last_reward": mean(rewards[-w:]),
        "first_success": mean(success[:w]),
        "last_success": mean(success[-w:]),
        "window": w,
    }


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
