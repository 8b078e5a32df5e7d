"""Preference pairs for a reward model: a successful episode (chosen) beside a failed one of the same task
(rejected), as the token ids the policy saw and wrote, the input `reward_model` reads with `input: tokens`.

A JSONL file holds one pair a line: `{"chosen": [ids], "rejected": [ids], "group": "corridor/17"}`; `group` names
the task, so that a held-out split can keep whole tasks out of training (the episodes of one task look alike)."""

from __future__ import annotations

import json
import random
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path


@dataclass(frozen=True)
class Pair:
    chosen: list[int]
    rejected: list[int]
    group: str = ""


def pair_episodes(trajs: Iterable, seed: int, max_per_task: int = 8) -> list[Pair]:
    """Every (success, failure) combination of each task's episodes (`env`, `task_index`), at most `max_per_task`
    of them drawn with `seed`; a task whose episodes all succeeded or all failed gives none. Tasks in index order."""
    if max_per_task < 1:
        raise ValueError(f"max_per_task must be >= 1, got {max_per_task}")
    by_task: dict[tuple[str, int], tuple[list, list]] = {}
    for traj in trajs:
        won, lost = by_task.setdefault((traj.env, traj.task_index), ([], []))
        (won if traj.success else lost).append(list(traj.token_ids))
    rng, pairs = random.Random(seed), []
    for (env, task), (won, lost) in sorted(by_task.items()):
        combos = [(w, lo) for w in won for lo in lost]
        rng.shuffle(combos)
        pairs += [Pair(w, lo, f"{env}/{task}") for w, lo in combos[:max_per_task]]
    return pairs


def write_pairs(pairs: Sequence[Pair], path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(asdict(p)) + "\n" for p in pairs))
    return path


def read_pairs(path: str | Path) -> list[Pair]:
    """The pairs of a JSONL file; ValueError naming the line of one that is not a pair of non-empty id lists."""
    pairs = []
    for number, line in enumerate(Path(path).read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            pair = Pair(row["chosen"], row["rejected"], str(row.get("group", "")))
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise ValueError(f"{path}:{number}: not a pair of chosen and rejected token ids: {exc}") from None
        for side in (pair.chosen, pair.rejected):
            if not side or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in side):
                raise ValueError(f"{path}:{number}: chosen and rejected must be non-empty lists of token ids")
        pairs.append(pair)
    if not pairs:
        raise ValueError(f"{path}: no preference pairs")
    return pairs
