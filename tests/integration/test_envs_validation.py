"""Validation on the held-out split (real Redis, scripted policy): run at multiples of
env.validation_every, once per version run-wide, success per environment on the metrics stream, which
the local launcher prints apart from the learner's steps. Also the parquet task datasets."""

import asyncio

import pyarrow.parquet as pq
import pytest

from services.common.config import load_config
from services.common.run_state import AsyncRunState, RunState
from services.common.trajectory import decode_batch
from services.envs.client import InProcessEnvClient
from services.envs.datasets import TaskSplit, dataset_dir, ensure
from services.envs.service import EnvService
from services.launcher.local import LocalRun
from services.launcher.report import validation_line
from services.rollout.action_parsers import PARSERS
from services.rollout.agent_loop import AgentLoop
from services.rollout.evaluation import Evaluator
from services.rollout.prompting import ChatFormatter
from tests.support.scripted_policy import ScriptedPolicy, tokenizer, toward_exit  # noqa: F401 - fixture


@pytest.fixture
def config(tmp_path, redis_url, run_name):
    cfg = load_config(
        None,
        [
            f"run={run_name}",
            f"stream.redis_url={redis_url}",
            f"env.data_dir={tmp_path}",
            "env.train_tasks=40",
            "env.validation_tasks=6",
            "env.validation_every=2",
            "learner.steps=4",
            f"output_dir={tmp_path}",
        ],
    )
    yield cfg
    RunState.connect(cfg).reset()


class Version:
    policy_version = 0


def scripted_loop(config, tokenizer, served_version=3):
    """An agent loop whose policy walks to the exit and says it serves `served_version`."""
    return AgentLoop(
        ScriptedPolicy(tokenizer, toward_exit, version=served_version),
        InProcessEnvClient(EnvService()),
        ChatFormatter(tokenizer),
        PARSERS.create("xml_action"),
        config.rollout,
        config.env,
        max_model_len=512,
    )


def test_validation_runs_the_split_once_per_version_and_publishes_success(config, tokenizer):
    state = RunState.connect(config)
    loop = scripted_loop(config, tokenizer)
    core = Version()
    servers = [AsyncRunState.connect(config) for _ in range(2)]  # two rollout servers
    evaluators = [Evaluator(config, loop, server, core, poll_s=0.01) for server in servers]
    assert [v for v in range(7) if evaluators[0].due(v)] == [0, 2, 4]
    assert evaluators[0].loop.rollout.temperature == 0.0 and loop.rollout.temperature == 1.0

    async def main():
        runs = [asyncio.create_task(v.run()) for v in evaluators]
        for version in range(1, 5):
            await asyncio.sleep(0.3)
            core.policy_version = version
        await asyncio.wait_for(asyncio.gather(*runs), 30)
        for server in servers:
            await server.aclose()

    asyncio.run(main())
    entries = [m for _, m in state.read_metrics()]
    assert [m["policy_version"] for m in entries] == [0, 2, 4], "each version validated once, run-wide"
    for m in entries:
        assert m["kind"] == "validation" and m["envs"] == ["corridor"]
        assert m["validation/corridor/success_rate"] == 1.0 and m["validation/episodes"] == 6
        assert m["validation/failed_episodes"] == 0
    assert validation_line(entries[0]).startswith("validation at policy v0: corridor success 100.0% (6 episodes")


def test_turns_sampled_by_a_later_policy_are_counted(config, tokenizer):
    def evaluate(served_version):
        loop = scripted_loop(config, tokenizer, served_version)
        evaluator = Evaluator(config, loop, AsyncRunState.connect(config), Version())
        return asyncio.run(evaluator.evaluate(2))

    same, later = evaluate(2), evaluate(3)
    assert same["validation/episodes"] == later["validation/episodes"] == 6
    assert same["validation/turns_of_later_versions"] == 0
    assert later["validation/turns_of_later_versions"] == round(6 * later["validation/corridor/turns"]) > 0
    assert ", 0 turns" not in validation_line(same)
    assert validation_line(later).endswith(
        f" {later['validation/turns_of_later_versions']} turns by later policies, {later['validation_seconds']:.1f}s)"
    )


def test_launcher_keeps_validation_apart_from_step_metrics(config):
    run, lines, history = LocalRun(config, say=[].append), [], []
    run.say = lines.append
    run._record(
        {
            "kind": "validation",
            "policy_version": 2,
            "envs": ["maze"],
            "validation/maze/success_rate": 0.25,
            "validation/episodes": 8,
            "validation/failed_episodes": 1,
            "validation_seconds": 1.5,
        },
        history,
    )
    run._record({"step": 1, "reward_mean": 0.5, "success_rate": 0.5, "step_seconds": 2.0, "policy_version": 1}, history)
    assert [m["step"] for m in history] == [1] and run.validations[0]["policy_version"] == 2
    assert lines[0] == "validation at policy v2: maze success 25.0% (8 episodes, 1 lost to infrastructure, 1.5s)"


def test_launcher_starts_one_process_per_env_replica(config, tmp_path):
    config.env.replicas = 3
    run = LocalRun(config)
    ports = run._assign_addresses()
    procs = run._env_processes(ports, ["--config", "c.yaml"], tmp_path)
    assert [p.name for p in procs] == ["envs", "envs-1", "envs-2"]
    assert config.env.address == "ipv4:" + ",".join(p.health_address for p in procs)
    assert all("--registry" in p.args and "redis" in p.args for p in procs)
    assert procs[1].args[procs[1].args.index("--replica-id") + 1] == "envs-1"


def test_task_datasets_follow_the_parquet_layout(config):
    folder = ensure(config.env)
    assert folder == dataset_dir(config.env) and folder.name == "corridor"
    train = pq.read_table(folder / "train.parquet").to_pylist()
    validation = TaskSplit.load(config.env, "validation")
    assert [r["task_index"] for r in train] == list(range(40)) and validation.task_indices == list(range(40, 46))
    row = train[7]
    assert row["seed"] == 7 and row["data_source"] == "corridor" and row["split"] == "train"
    assert row["prompt"][0]["role"] == "user" and "<action>" in row["prompt"][0]["content"]
    assert row["reward_model"]["style"] == "rule" and '"exit"' in row["reward_model"]["ground_truth"]
    stamp = (folder / "train.parquet").stat().st_mtime_ns
    ensure(config.env)
    assert (folder / "train.parquet").stat().st_mtime_ns == stamp, "an up-to-date dataset is not rewritten"
    config.env.train_tasks = 30
    ensure(config.env)
    assert len(TaskSplit.load(config.env, "train").task_indices) == 30, "a stale one is"
    config.env.options = {"length": 10}
    assert dataset_dir(config.env).name.startswith("corridor-"), "other options, other folder"
    config.env.dataset = str(folder.parent / "mine")
    with pytest.raises(FileNotFoundError, match="mine"):
        ensure(config.env)
    assert TaskSplit("train", [5, 9]).draw("0:3") in (5, 9)


def learner_recording(config, tokenizer):
    """A learner service that only records (no trainer, no pusher): its validation-episode path."""
    from types import SimpleNamespace

    from services.learner.episodes import EpisodeRecorder
    from services.learner.service import LearnerService

    config.learner.checkpoint_dir = str(config.run_dir / "checkpoints")
    trainer = SimpleNamespace(model=None, step_tokens=None)
    return LearnerService(config, trainer, None, RunState.connect(config), recorder=EpisodeRecorder(config, tokenizer))


def test_the_learner_records_validation_episodes_apart_and_leaves_bad_ones_out(config, tokenizer):
    from services.common.trajectory import encode_batch
    from services.learner.episodes import read_validation, recorded_steps, recorded_validations

    evaluator = Evaluator(config, scripted_loop(config, tokenizer, 2), AsyncRunState.connect(config), Version())
    asyncio.run(evaluator.evaluate(2))
    state = RunState.connect(config)
    ((_, _, payload),) = state.validation_episodes()
    played = list(decode_batch(payload).trajectories)
    too_long = type(played[0])()
    too_long.CopyFrom(played[0])
    too_long.token_ids.extend([5] * 600)
    too_long.loss_mask.extend([0] * 600)
    too_long.logprobs.extend([0.0] * 600)
    too_long.turns[-1].env_tokens += 600  # a well-formed record, longer than the context
    state.client.xadd(state.k("validation_episodes"), {"version": 3, "batch": b"not a batch"})
    state.client.xadd(state.k("validation_episodes"), {"version": 4, "batch": encode_batch([too_long, played[1]])})

    service = learner_recording(config, tokenizer)
    service.version = 4  # the learner has pushed v4 by now
    service._record_validations()
    folder = config.run_dir
    assert recorded_validations(folder) == [2, 4] and recorded_steps(folder) == []
    rows = read_validation(folder, 2)
    assert [r["trajectory_id"] for r in rows] == [t.trajectory_id for t in played]
    assert all(r["policy_version"] == 2 and r["success"] for r in rows)
    assert rows[0]["token_ids"] == list(played[0].token_ids) and "You are in cell" in rows[0]["prompt"]
    assert "learner_logprobs" not in rows[0] and "advantages" not in rows[0]  # never trained on
    assert [r["trajectory_id"] for r in read_validation(folder, 4)] == [played[1].trajectory_id]
    service._record_validations()  # nothing new: nothing rewritten
    assert recorded_validations(folder) == [2, 4]


def test_the_learner_waits_for_the_final_policys_validation(config, tokenizer, monkeypatch):
    import threading

    from services.learner.episodes import recorded_validations

    service = learner_recording(config, tokenizer)
    service.step = service.version = 4  # the last step; validation_every=2
    monkeypatch.setattr(service.state, "rollout_servers", lambda: {"rollout-0": {}})
    evaluator = Evaluator(config, scripted_loop(config, tokenizer, 4), AsyncRunState.connect(config), Version())
    late = threading.Timer(1.0, lambda: asyncio.run(evaluator.evaluate(4)))
    late.start()
    service._record_final_validation(timeout_s=60, poll_s=0.1)
    late.join()
    assert recorded_validations(config.run_dir) == [4]
