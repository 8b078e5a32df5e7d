"""A step's recorded episodes as the inspector shows them: filtered, sorted, grouped; one episode's turns, reward
breakdown and tokens coloured by loss mask, advantage or the rollout-learner logprob difference."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

SORT_KEYS = ("reward", "advantage_mean")
TOKEN_MODES = {
    "loss_mask": "loss mask",
    "advantage": "advantage",
    "logprob_diff": "rollout - learner logprob",
}


@dataclass
class Filters:
    success: str = ""
    """"true", "false" or "" (any)."""
    env: str = ""
    stop_reason: str = ""
    errors: bool = False
    """Only episodes with an invalid or rejected action."""

    def keep(self, summary: dict[str, Any]) -> bool:
        return (
            (not self.success or str(summary["success"]).lower() == self.success)
            and (not self.env or summary["env"] == self.env)
            and (not self.stop_reason or summary["stop_reason"] == self.stop_reason)
            and (not self.errors or summary["invalid_actions"] > 0)
        )


def summaries(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each row's flat summary (services.learner.episodes.episode_summary) without its transcript."""
    from services.learner.episodes import episode_summary  # the record's module, kept out of the API's start

    out = []
    for row in rows:
        summary = episode_summary(row)
        del summary["transcript"]
        out.append(summary)
    return out


def select(rows: list[dict[str, Any]], filters: Filters, sort: str = "", ascending: bool = False) -> list[dict]:
    """Summaries (without transcripts) of the episodes that pass the filters: in batch order (groups together), or
    sorted by `sort`."""
    from services.learner.episodes import select_episodes  # the record's module, kept out of the API's start

    picked = select_episodes(rows, filters.keep, sort if sort in SORT_KEYS else None, ascending)
    return [{k: v for k, v in summary.items() if k != "transcript"} for summary, _ in picked]


def choices(rows: list[dict[str, Any]], key: str) -> list[str]:
    return sorted({str(row[key]) for row in rows})


def reward_components(row: dict[str, Any]) -> dict[str, Any]:
    try:
        components = json.loads(row.get("reward_components") or "{}")
    except ValueError:
        return {}
    return components if isinstance(components, dict) else {}


@dataclass
class Token:
    text: str
    colour: str
    title: str
    model: bool
    """Sampled by the model (inside a turn's model tokens), not prompt or observation."""


def model_positions(row: dict[str, Any]) -> set[int]:
    return {t for turn in row["turns"] for t in range(turn["start"], turn["start"] + turn["model_tokens"])}


def _diverging(value: float, scale: float) -> str:
    """Blue for positive, red for negative, stronger the larger |value| against `scale`."""
    if not scale or not value:
        return ""
    alpha = round(0.08 + 0.72 * min(1.0, abs(value) / scale), 2)
    return f"rgba(31,119,180,{alpha})" if value > 0 else f"rgba(214,39,40,{alpha})"


def tokens(row: dict[str, Any], mode: str) -> list[Token]:
    """Every token of the episode, coloured by `mode` (one of TOKEN_MODES), with all its values in its title."""
    model = model_positions(row)
    rollout, learner = row["rollout_logprobs"], row["learner_logprobs"]
    diffs = [r - lp if t in model else 0.0 for t, (r, lp) in enumerate(zip(rollout, learner))]
    scale = {
        "advantage": max((abs(a) for t, a in enumerate(row["advantages"]) if t in model), default=0.0),
        "logprob_diff": max((abs(d) for d in diffs), default=0.0),
    }.get(mode, 0.0)
    out = []
    for t, text in enumerate(row["token_text"]):
        mask, advantage = row["loss_mask"][t], row["advantages"][t]
        if mode == "advantage":
            colour = _diverging(advantage, scale) if t in model else ""
        elif mode == "logprob_diff":
            colour = _diverging(diffs[t], scale)
        else:  # a model token without loss was rejected by the rollout correction
            colour = "rgba(44,160,44,0.35)" if mask else "rgba(255,127,14,0.45)" if t in model else ""
        title = (
            f"#{t} id {row['token_ids'][t]} | loss_mask {mask} | advantage {advantage:+.4f} | "
            f"rollout {rollout[t]:.4f} | learner {learner[t]:.4f} | diff {rollout[t] - learner[t]:+.4f} | "
            f"reward {row['token_rewards'][t]:+.4f}"
        )
        out.append(Token(text, colour, title, t in model))
    return out
