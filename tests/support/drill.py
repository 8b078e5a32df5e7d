"""A whole local run (every service a real process, real vLLM and Redis) with faults injected between
steps, for the drills in this folder and scripts/drills.sh."""

from __future__ import annotations

import json
import os
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from services.common.config import load_config
from services.common.run_state import RunState
from services.common.trajectory import decode_batch
from services.launcher.local import LocalRun
from services.launcher.processes import kill_group


@dataclass
class DrillResult:
    history: list[dict]
    lines: list[str]
    counters: dict[str, int]
    trajectory_ids: Counter = field(default_factory=Counter)
    restarts: dict[str, int] = field(default_factory=dict)
    run_dir: Path | None = None

    def log(self, service: str) -> str:
        return (self.run_dir / "logs" / f"{service}.log").read_text(errors="replace")


def report(name: str, **figures) -> None:
    """Appends a drill's figures to the JSON-lines file named by OMRL_DRILL_REPORT (scripts/drills.sh)."""
    path = os.environ.get("OMRL_DRILL_REPORT")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps({"drill": name, **figures}) + "\n")


def kill_service(run: LocalRun, name: str) -> None:
    """SIGKILL to the service and everything it started (its own session), as a node loss would."""
    kill_group(next(p for p in run.processes if p.name == name).pid)


def run_drill(
    name: str,
    tmp,
    redis_url: str,
    faults: dict[int, Callable[[LocalRun], None]],
    steps: int,
    groups: int = 4,
    group_size: int = 4,
    restart_delay_s: float = 5.0,
    overrides: tuple[str, ...] = (),
    timeout_s: float = 1200.0,
) -> DrillResult:
    """Runs `steps` GRPO steps on corridor; `faults[n]` is called once the launcher has printed step n."""
    config = load_config(
        None,
        [
            "env.name=corridor",
            f"env.data_dir={tmp / 'data'}",
            "env.train_tasks=500",
            f"learner.steps={steps}",
            f"rollout.group_size={group_size}",
            f"rollout.groups_per_step={groups}",
            "model.warmstart_steps=20",
            f"stream.redis_url={redis_url}",
            f"output_dir={tmp}",
            f"run=drill-{uuid.uuid4().hex[:6]}",
            *overrides,
        ],
    )
    lines: list[str] = []
    run = LocalRun(config, say=lines.append, restart_delay_s=restart_delay_s)
    result: dict = {}
    thread = threading.Thread(target=lambda: result.update(run=run.run()), daemon=True)
    thread.start()
    pending = dict(sorted(faults.items()))
    try:
        deadline = time.monotonic() + timeout_s
        while pending:
            step = next(iter(pending))
            if any(line.startswith(f"step {step:>3}/") for line in lines):
                pending.pop(step)(run)
                continue
            assert thread.is_alive() and time.monotonic() < deadline, "\n".join(lines[-40:])
            time.sleep(0.2)
        thread.join(max(deadline - time.monotonic(), 1.0))
        assert not thread.is_alive() and "run" in result, "\n".join(lines[-40:])
        state = RunState.connect(config)
        ids = Counter(
            t.trajectory_id
            for _, fields in state.client.xrange(state.trajectories_key)
            for t in decode_batch(fields[b"batch"]).trajectories
        )
        history = result["run"].history
        report(
            name,
            steps=f"{len(history)}/{steps}",
            full_batches=sum(m["trajectories"] == groups * group_size for m in history),
            groups_dead_lettered=state.rollout_counters().get("groups_dead_lettered", 0),
            applied_twice=sum(n > 1 for n in ids.values()),
            lost_to_redis=history[-1].get("groups_lost_to_redis", 0) if history else None,
            entries_dead_lettered=state.client.xlen(state.trajectories_key + ":dead"),
            restarts=dict(run.restarts),
            counters=state.rollout_counters(),
        )
        return DrillResult(result["run"].history, lines, state.rollout_counters(), ids, dict(run.restarts), run.run_dir)
    finally:
        if thread.is_alive():
            run.stop()
        try:
            RunState.connect(config).reset()
        except Exception:  # noqa: BLE001 - a drill's own Redis may be gone already
            pass
