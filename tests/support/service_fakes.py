"""Stand-ins that learner, producer and reward tests share: a trainer that records which groups each step saw, a
pusher that accepts every push, a stream of given entries, a rollout loop that plays instant groups, and a
trajectory of given turns."""

import asyncio
import json
from pathlib import Path
from types import SimpleNamespace

from services.common.stream import StreamEntry
from services.common.trajectory import TrajectoryBatch, TrajectoryBuilder
from services.weightsync import PushResult, WeightPusher
from services.weightsync.buckets import TensorWeights
from tests.support.trajectories import traj


class RecordingTrainer:
    """Applies nothing; records which groups each step saw and checkpoints that record."""

    def __init__(self):
        self.applied: list[list[str]] = []
        self.background: list[bool] = []

    @staticmethod
    def latest_checkpoint(directory):
        found = sorted(Path(directory).glob("step_*/meta.json"))
        return found[-1].parent if found else None

    def load_checkpoint(self, path):
        meta = json.loads((Path(path) / "meta.json").read_text())
        self.applied = meta["applied"]
        return meta["extra"]

    def start_checkpoint(self, directory, extra, background=False):
        """Writes at commit time, as a background checkpoint lands only when committed."""
        path = Path(directory) / f"step_{len(self.applied):08d}"
        meta = json.dumps({"applied": self.applied, "extra": extra})
        self.background.append(background)

        def commit():
            path.mkdir(parents=True, exist_ok=True)
            (path / "meta.json").write_text(meta)
            return path

        return SimpleNamespace(commit=commit)

    def export_hf(self, out_dir):
        return None

    def train_step(self, trajectories):
        self.applied.append(sorted({t.group_id for t in trajectories}))
        return {"reward_mean": 0.0, "success_rate": 0.0}

    def weight_set_for_push(self):
        return TensorWeights.of([])


class OkPusher(WeightPusher):
    def push(self, version, weights, addresses, **_):
        return [PushResult(a, True, version, weights.checksum) for a in addresses]


def entry(entry_id, *trajs):
    batch = TrajectoryBatch(schema_version=1, batch_id=entry_id)
    batch.trajectories.extend(trajs)
    return StreamEntry(entry_id, batch)


class FakeStream:
    def __init__(self, entries):
        self.entries, self.reads = list(entries), []

    def read(self, consumer, count, block_ms, pending=False):
        self.reads.append(count)
        out, self.entries = self.entries[:count], self.entries[count:]
        return out


class FakeCore:
    policy_version = 0


class FakeLoop:
    def __init__(self, core, state):
        self.core, self.state, self.stats, self.started = core, state, {}, {}

    async def run_group(self, task_index, group_id, seed):
        self.started[int(group_id[1:])] = (self.core.policy_version, self.state.lost_groups())
        await asyncio.sleep(0.001)
        return [traj(group_id, [self.core.policy_version]) for _ in range(2)]


def trajectory(*turns: tuple[int, bool], success: bool = False, trajectory_id: str = "t", env: str = "corridor"):
    """`turns`: (model tokens, action_valid) per turn; `env` names the env (a reward service's dispatch key)."""
    builder = TrajectoryBuilder(env=env, task_index=0, group_id="g", prompt_ids=[1, 2, 3], trajectory_id=trajectory_id)
    for n, valid in turns:
        builder.add_model_turn(
            [5] * n,
            [-0.5] * n,
            policy_version=0,
            text="<action>left</action>",
            action="left" if valid else "",
            action_valid=valid,
            finish_reason="stop",
        )
        builder.add_observation([7, 7], env_reward=0.0)
    return builder.finish(env_return=float(success), success=success, stop_reason="done")
