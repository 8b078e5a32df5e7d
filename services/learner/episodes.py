"""Recorded episodes: a bounded sample of each step's trajectories with what the learner computed for them,
one parquet file per step under the run folder's `episodes/` (`logging.episodes_per_step`,
`logging.episodes_max_bytes`). Read back by `read_step` (the `omrl episodes` command and the trackers' tables)."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from services.common.config import TrainConfig
from services.common.trajectory import Trajectory

log = logging.getLogger(__name__)

FOLDER = "episodes"
TOKEN_FIELDS = ("rollout_logprobs", "learner_logprobs", "advantages", "token_rewards", "loss_mask")
"""Per-token columns, each as long as `token_ids`: position t is about token t."""


@dataclass
class StepTokens:
    """What one update computed for its rows, as [B, T] CPU tensors in the order of `trajectories` (a row is
    right-padded past its trajectory's used length)."""

    trajectories: Sequence[Trajectory]
    learner_logprobs: Any
    advantages: Any
    token_rewards: Any
    loss_mask: Any


def run_folder(config: TrainConfig) -> Path:
    """The folder a learner writes its run's files to: where its checkpoints folder is (the launchers put it
    in the run's folder)."""
    return Path(config.learner.checkpoint_dir).parent


def step_file(folder: Path, step: int) -> Path:
    return folder / FOLDER / f"step_{step:08d}.parquet"


def validation_file(folder: Path, version: int) -> Path:
    return folder / FOLDER / "validation" / f"version_{version:08d}.parquet"


def sample(trajectories: Sequence[Trajectory], limit: int) -> list[int]:
    """Rows to keep: whole groups in batch order until `limit` episodes (at least one group); -1: all."""
    if limit < 0:
        return list(range(len(trajectories)))
    kept: list[int] = []
    groups: dict[str, list[int]] = {}
    for i, traj in enumerate(trajectories):
        groups.setdefault(traj.group_id, []).append(i)
    for rows in groups.values():
        if kept and len(kept) + len(rows) > limit:
            break
        kept += rows
    return kept if limit else []


def _turn(traj: Trajectory, turn: Any, decode: Callable[[list[int]], str]) -> dict[str, Any]:
    after = turn.start + turn.model_tokens
    return {
        "start": turn.start,
        "model_tokens": turn.model_tokens,
        "env_tokens": turn.env_tokens,
        "policy_version": turn.policy_version,
        "text": turn.text,
        "action": turn.action,
        "action_valid": turn.action_valid,
        "action_rejected": turn.action_rejected,
        "env_reward": turn.env_reward,
        "process_reward": turn.process_reward,
        "tool_calls": turn.tool_calls,
        "invalid_tool_calls": turn.invalid_tool_calls,
        "finish_reason": turn.finish_reason,
        "observation": decode(list(traj.token_ids[after : after + turn.env_tokens])),
    }


def played_row(traj: Trajectory, decode: Callable[[list[int]], str], pieces: Callable) -> dict[str, Any]:
    """What an episode's record says of it, decoded: the columns of training and validation rows alike."""
    ids = list(traj.token_ids)
    return {
        "trajectory_id": traj.trajectory_id,
        "group_id": traj.group_id,
        "env": traj.env,
        "task_index": traj.task_index,
        "reward": traj.reward,
        "reward_components": json.dumps(dict(traj.reward_components), sort_keys=True),
        "success": traj.success,
        "env_return": traj.env_return,
        "stop_reason": traj.stop_reason,
        "rollout_server": traj.rollout_server,
        "created_at": traj.created_at,
        "num_turns": len(traj.turns),
        "invalid_actions": sum(not t.action_valid or t.action_rejected for t in traj.turns),
        "tool_calls": sum(t.tool_calls for t in traj.turns),
        "invalid_tool_calls": sum(t.invalid_tool_calls for t in traj.turns),
        "prompt": decode(ids[: traj.prompt_length]),
        "turns": [_turn(traj, t, decode) for t in traj.turns],
        "token_ids": ids,
        "token_text": pieces(ids),
        "rollout_logprobs": list(traj.logprobs),
        "loss_mask": list(traj.loss_mask),
    }


def episode_row(
    step: int, traj: Trajectory, tokens: StepTokens, row: int, decode: Callable[[list[int]], str], pieces: Callable
) -> dict[str, Any]:
    """A trained episode: what its record says, and what the update computed for each of its tokens."""
    n = len(traj.token_ids)

    def column(tensor: Any) -> list[float]:
        values = tensor[row, :n].tolist()
        return values + [0.0] * (n - len(values))  # past the row's used length nothing was computed

    return {
        "step": step,
        **played_row(traj, decode, pieces),
        "learner_logprobs": column(tokens.learner_logprobs),
        "advantages": column(tokens.advantages),
        "token_rewards": column(tokens.token_rewards),
        "loss_mask": [int(v) for v in column(tokens.loss_mask)],
    }


def transcript(row: dict[str, Any]) -> str:
    """A recorded episode as text: the prompt, then each turn's model text and the observation that followed."""
    parts = [row["prompt"]]
    for i, turn in enumerate(row["turns"], 1):
        verdict = "invalid" if not turn["action_valid"] else "rejected" if turn["action_rejected"] else "ok"
        parts.append(f"[turn {i}: {turn['action'] or '-'} ({verdict}), reward {turn['env_reward']:g}]")
        parts.append(turn["text"])
        if turn["observation"]:
            parts.append(turn["observation"])
    return "\n".join(parts)


def episode_summary(row: dict[str, Any]) -> dict[str, Any]:
    """One row of the trackers' episode table: flat values only."""
    mask = row["loss_mask"]
    trained = [a for a, m in zip(row["advantages"], mask) if m]
    return {
        "step": row["step"],
        "trajectory_id": row["trajectory_id"],
        "group_id": row["group_id"],
        "env": row["env"],
        "task_index": row["task_index"],
        "reward": row["reward"],
        "success": row["success"],
        "stop_reason": row["stop_reason"],
        "num_turns": row["num_turns"],
        "invalid_actions": row["invalid_actions"],
        "tool_calls": row.get("tool_calls", 0),
        "invalid_tool_calls": row.get("invalid_tool_calls", 0),
        "model_tokens": sum(mask),
        "advantage_mean": sum(trained) / len(trained) if trained else 0.0,
        "transcript": transcript(row),
    }


def select_episodes(
    rows: list[dict[str, Any]],
    keep: Callable[[dict[str, Any]], bool] = lambda summary: True,
    sort: str | None = None,
    ascending: bool = False,
    limit: int = 0,
) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """(summary, row) of the recorded episodes whose summary `keep` passes: in record order (a group's episodes
    together), or by the summary's `sort` key, highest first unless `ascending`; at most `limit` (0: all). What
    `omrl episodes` and the inspector's step page both show."""
    picked = [(summary, row) for row in rows if keep(summary := episode_summary(row))]
    if sort:
        picked.sort(key=lambda pair: pair[0][sort], reverse=not ascending)
    return picked[:limit] if limit > 0 else picked


class EpisodeRecorder:
    """Rank 0 of the learner: writes each step's sample; a failure is logged and never stops training."""

    def __init__(self, config: TrainConfig, tokenizer: Any = None):
        self.limit = config.logging.episodes_per_step
        self.max_bytes = config.logging.episodes_max_bytes
        self.folder = run_folder(config)
        self._model_path = config.model.path
        self._tokenizer = tokenizer
        self._warned: set[str] = set()

    @property
    def enabled(self) -> bool:
        return self.limit != 0

    def _tokens(self) -> Any:
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            self._tokenizer = AutoTokenizer.from_pretrained(self._model_path)
        return self._tokenizer

    def _decoders(self) -> tuple[Callable[[list[int]], str], Callable[[list[int]], list[str]]]:
        tok = self._tokens()

        def decode(ids: list[int]) -> str:
            return tok.decode(ids) if ids else ""

        def pieces(ids: list[int]) -> list[str]:
            return tok.batch_decode([[i] for i in ids])

        return decode, pieces

    def rows(self, step: int, tokens: StepTokens) -> list[dict[str, Any]]:
        decode, pieces = self._decoders()
        return [
            episode_row(step, tokens.trajectories[i], tokens, i, decode, pieces)
            for i in sample(tokens.trajectories, self.limit)
        ]

    def record(self, step: int, tokens: StepTokens | None) -> list[dict[str, Any]]:
        """Writes the step's sample and trims old steps to the byte limit; returns the rows written."""
        if not self.enabled or tokens is None:
            return []
        try:
            rows = self.rows(step, tokens)
            self._write(step_file(self.folder, step), rows)
            return rows
        except Exception as exc:  # a full disk or an odd record costs the record, not the run
            self._warn("record", f"episodes of step {step} not recorded: {exc!r}")
            return []

    def record_validation(self, version: int, trajectories: Sequence[Trajectory]) -> list[dict[str, Any]]:
        """Writes a validation's episodes (played by policy `version`, never trained on: no learner columns) to
        `episodes/validation/version_<version>.parquet`; returns the rows written."""
        if not self.enabled or not trajectories:
            return []
        try:
            decode, pieces = self._decoders()
            rows = [{"policy_version": version, **played_row(t, decode, pieces)} for t in trajectories]
            self._write(validation_file(self.folder, version), rows)
            return rows
        except Exception as exc:
            self._warn("record", f"validation episodes of v{version} not recorded: {exc!r}")
            return []

    def _write(self, path: Path, rows: list[dict[str, Any]]) -> None:
        import pyarrow as pa
        import pyarrow.parquet as pq

        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(".partial")
        pq.write_table(pa.Table.from_pylist(rows), partial, compression="zstd")
        os.replace(partial, path)  # a reader never sees half a file
        self._trim()

    def _trim(self) -> None:
        """Oldest first, training and validation files alike, until they fit the byte limit."""
        # by write time (a file written in the same clock tick as another: by name, which orders steps)
        files = sorted((self.folder / FOLDER).glob("**/*.parquet"), key=lambda f: (f.stat().st_mtime_ns, f.name))
        sizes = [f.stat().st_size for f in files]
        total = sum(sizes)
        for path, size in zip(files, sizes):
            if total <= self.max_bytes:
                break
            if path is files[-1]:
                self._warn("limit", f"one step's episodes ({size} bytes) exceed logging.episodes_max_bytes")
            path.unlink(missing_ok=True)
            total -= size

    def _warn(self, kind: str, message: str) -> None:
        if kind not in self._warned:
            self._warned.add(kind)
            log.warning("%s (said once)", message)


def recorded_steps(folder: Path) -> list[int]:
    return sorted(int(p.stem.removeprefix("step_")) for p in (folder / FOLDER).glob("step_*.parquet"))


def read_step(folder: Path, step: int) -> list[dict[str, Any]]:
    """The recorded episodes of one step (rows as `EpisodeRecorder` wrote them); FileNotFoundError when the
    step was not recorded or was trimmed."""
    path = step_file(folder, step)
    if not path.exists():
        have = recorded_steps(folder)
        span = f"steps {have[0]}..{have[-1]}" if have else "none"
        raise FileNotFoundError(f"step {step} has no recorded episodes in {folder / FOLDER} (recorded: {span})")
    import pyarrow.parquet as pq

    return pq.read_table(path).to_pylist()


def recorded_validations(folder: Path) -> list[int]:
    """The policy versions whose validation episodes are recorded."""
    found = (folder / FOLDER / "validation").glob("version_*.parquet")
    return sorted(int(p.stem.removeprefix("version_")) for p in found)


def read_validation(folder: Path, version: int) -> list[dict[str, Any]]:
    """The recorded validation episodes of policy `version`; FileNotFoundError when there are none."""
    import pyarrow.parquet as pq

    path = validation_file(folder, version)
    if not path.exists():
        raise FileNotFoundError(f"no recorded validation of policy v{version} in {path.parent}")
    return pq.read_table(path).to_pylist()
