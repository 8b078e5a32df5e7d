"""Which tasks the random-policy demonstrations play (services.envs.demos): the format warm-start plays tasks
no split reaches where the env makes each task from its index, else the run's own train split (never an index
a server may not serve, never a validation task); the tokenizer corpus reads the run's first train tasks."""

from itertools import islice

from services.common.config import EnvConfig
from services.envs.base import UNSEEN_TASKS_FROM
from services.envs.datasets import TaskSplit, split_range
from services.envs.demos import corpus_tasks, warmstart_tasks


def maze(tmp_path) -> EnvConfig:
    """AgentGym maze: its server serves games 0..24; the run trains on 0..19 and validates on 20..24."""
    options = {"family": "maze", "base_url": "http://127.0.0.1:1"}
    return EnvConfig(name="agentgym", options=options, data_dir=str(tmp_path))


def test_warmstart_plays_the_run_s_train_tasks_where_the_env_has_a_task_range(tmp_path):
    env = maze(tmp_path)
    train, validation = (TaskSplit.load(env, split).task_indices for split in ("train", "validation"))
    played = list(islice(warmstart_tasks(env, seed=3), 50))
    assert set(played) == set(train) and not set(played) & set(validation)
    assert list(islice(corpus_tasks(env), len(train))) == train


def test_the_warmstart_draws_its_episodes_from_those_tasks(tmp_path, monkeypatch):
    from services.envs import demos
    from services.learner.warmstart import demo_episodes

    env, asked = maze(tmp_path), {}

    def record(env_cfg, count, seed, **kwargs):
        asked["tasks"] = list(islice(kwargs["tasks"], count))
        return iter(())

    monkeypatch.setattr(demos, "random_episodes", record)
    demo_episodes(env, formatter=None, tokenizer=type("T", (), {"eos_token_id": 0})(), count=40, seed=0)
    assert set(asked["tasks"]) <= set(TaskSplit.load(env, "train").task_indices)


def test_a_built_in_env_warms_up_on_tasks_no_split_reaches():
    corridor = EnvConfig(name="corridor", train_tasks=100_000_000, validation_tasks=100_000)
    played = list(islice(warmstart_tasks(corridor, seed=2), 3))
    assert played == [UNSEEN_TASKS_FROM + 200_000 + i for i in range(3)]
    assert min(played) >= split_range(corridor, "validation").stop
    assert list(islice(corpus_tasks(corridor), 3)) == [0, 1, 2]  # no dataset read: none is written


def test_a_rejected_task_of_the_cycle_is_said_once_and_passed_over(monkeypatch):
    from itertools import cycle

    from services.envs import demos
    from services.envs.base import TaskRejected

    class Env:
        def reset(self, task_index, options):
            if task_index == 1:
                raise TaskRejected(f"reset of task {task_index} never answered", "hung")
            return "start"

        def random_action(self, rng):
            return "go"

        def step(self, action):
            return demos.StepResult("end", done=True)

        def close(self):
            pass

    monkeypatch.setattr("services.envs.registry.ENVS.create", lambda name: Env())
    said, stats = [], demos.DemoStats()
    env_cfg = EnvConfig(name="corridor", max_turns=2)
    played = list(demos.random_episodes(env_cfg, 6, seed=0, tasks=cycle([0, 1, 2]), stats=stats, say=said.append))
    assert [d.task_index for d in played] == [0, 2, 0, 2, 0, 2]
    assert len(said) == 1 and "task 1 skipped (hung)" in said[0] and stats.skipped == {"hung": 1}
