"""`omrl episodes`: a step's recorded episodes as transcripts in the terminal, filtered and sorted."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from services.common.config_cli import UsageError

SORT_KEYS = ("reward", "advantage_mean", "num_turns", "model_tokens", "invalid_actions")


FILTER_KEYS = ("success", "stop_reason", "env", "task_index", "group_id", "trajectory_id", "num_turns")
FILTER_KEYS += ("invalid_actions",)


def parse_filters(filters: list[str]) -> dict[str, str]:
    """`key=value` pairs over an episode's summary (success=false, stop_reason=max_turns, env=maze)."""
    out = {}
    for item in filters:
        key, sep, value = item.partition("=")
        if not sep or key not in FILTER_KEYS:
            raise UsageError(f"--filter {item!r}: want KEY=VALUE with KEY one of {', '.join(FILTER_KEYS)}")
        out[key] = value.lower()
    return out


def _matches(summary: dict[str, Any], filters: dict[str, str]) -> bool:
    return all(str(summary[key]).lower() == value for key, value in filters.items())


def select(
    rows: list[dict[str, Any]], filters: dict[str, str], sort: str | None, limit: int, ascending: bool = False
) -> list[tuple[dict, dict]]:
    """(summary, row) of the episodes that pass every filter, sorted (highest first), at most `limit`."""
    from services.learner.episodes import select_episodes

    if sort and sort not in SORT_KEYS:
        raise UsageError(f"--sort {sort!r}: want one of {', '.join(SORT_KEYS)}")
    return select_episodes(rows, lambda summary: _matches(summary, filters), sort, ascending, limit)


def read_folder(folder: Path, step: int | None) -> tuple[int, list[dict[str, Any]]]:
    """(the step, its recorded episodes) of a run folder here; default: the last recorded step."""
    from services.learner.episodes import read_step, recorded_steps

    steps = recorded_steps(folder)
    if not steps:
        raise UsageError(f"{folder}: no recorded episodes (logging.episodes_per_step was 0, or no step ended)")
    step = steps[-1] if step is None else step
    try:
        return step, read_step(folder, step)
    except FileNotFoundError as exc:
        raise UsageError(str(exc)) from None


def show(
    step: int,
    rows: list[dict[str, Any]],
    filters: list[str],
    sort: str | None = None,
    limit: int = 0,
    as_json: bool = False,
    ascending: bool = False,
) -> str:
    """A step's episodes as transcripts (or as JSON lines), filtered, sorted and cut to `limit`."""
    picked = select(rows, parse_filters(filters), sort, limit, ascending)
    if as_json:
        return "\n".join(json.dumps(row, default=str) for _, row in picked)
    lines = [f"step {step}: {len(picked)} of {len(rows)} recorded episodes"]
    for summary, _ in picked:
        lines.append("")
        lines.append(
            f"== {summary['trajectory_id']} group {summary['group_id']} {summary['env']}#{summary['task_index']}: "
            f"reward {summary['reward']:.3f} success {summary['success']} ({summary['stop_reason']}), "
            f"{summary['num_turns']} turns, advantage {summary['advantage_mean']:+.3f}"
        )
        lines.append(summary["transcript"])
    return "\n".join(lines)
