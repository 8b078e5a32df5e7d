"""Infrastructure failures in the agent loop: an episode lost to the env service is played again on a
fresh environment up to env.max_episode_attempts; past that its whole group fails, and nothing of it
is scored."""

import asyncio

import pytest

from services.common.config import EnvConfig, RolloutConfig
from services.common.errors import Unavailable
from services.envs.client import InProcessEnvClient
from services.envs.service import EnvService
from services.rollout.action_parsers import PARSERS
from services.rollout.agent_loop import AgentLoop, EpisodeFailed
from services.rollout.prompting import ChatFormatter
from tests.support.scripted_policy import ScriptedPolicy, tokenizer, toward_exit  # noqa: F401 - fixture


class FlakyEnvClient(InProcessEnvClient):
    """Loses the first `failures` episodes that take a step (as a dead replica would)."""

    def __init__(self, service, failures):
        super().__init__(service)
        self.failures, self.lost, self.created = failures, set(), 0

    async def create(self, env, task_index=0, options=None):
        self.created += 1
        return await super().create(env, task_index, options)

    async def create_batch(self, env, task_index=0, options=None, count=1):
        self.created += count
        return await super().create_batch(env, task_index, options, count)

    async def step(self, episode_id, action):
        if episode_id in self.lost or len(self.lost) < self.failures:
            self.lost.add(episode_id)
            await asyncio.sleep(0)
            raise Unavailable(f"replica holding {episode_id} is gone")
        return await super().step(episode_id, action)


def make_loop(tokenizer, client, attempts=3, group_size=4, options=None):
    return AgentLoop(
        ScriptedPolicy(tokenizer, toward_exit),
        client,
        ChatFormatter(tokenizer),
        PARSERS.create("xml_action"),
        RolloutConfig(group_size=group_size, max_new_tokens=16),
        # unchecked: the env service must handle options the config did not check (another version)
        EnvConfig.model_construct(name="corridor", max_turns=6, max_episode_attempts=attempts, options=options or {}),
        max_model_len=512,
    )


def test_lost_episodes_are_replayed_on_fresh_environments(tokenizer):
    service = EnvService()
    client = FlakyEnvClient(service, failures=3)
    loop = make_loop(tokenizer, client)
    group = asyncio.run(loop.run_group(task_index=5, group_id="g"))
    assert len(group) == 4 and all(t.success and t.stop_reason == "done" for t in group)
    assert all(t.group_id == "g" and len(t.turns) == 3 for t in group)
    assert loop.stats == {"episodes_failed": 3, "episode_retries": 3}
    assert client.created == 4 + 3  # every retry started on a new environment
    assert service.active == 0  # lost episodes were closed too


def test_group_is_dropped_once_an_episode_runs_out_of_attempts(tokenizer):
    service = EnvService()
    loop = make_loop(tokenizer, FlakyEnvClient(service, failures=10**6), attempts=2)
    with pytest.raises(EpisodeFailed, match="group g dropped: episode of task 2 failed 2 time") as err:
        asyncio.run(loop.run_group(task_index=2, group_id="g"))
    assert err.value.retryable
    assert loop.stats["episode_retries"] >= 1 and loop.stats["episodes_failed"] >= 2
    assert service.active == 0, "cancelled siblings closed their episodes"


def test_configuration_errors_are_not_retried(tokenizer):
    service = EnvService()
    client = FlakyEnvClient(service, failures=0)
    loop = make_loop(tokenizer, client, options={"length": "long"})
    with pytest.raises(EpisodeFailed, match="InvalidArgument") as err:
        asyncio.run(loop.run_episode_with_retries(task_index=1, group_id="g"))
    assert not err.value.retryable and client.created == 1 and loop.stats["episode_retries"] == 0


class BatchFailingClient(InProcessEnvClient):
    """create_batch loses one episode (`lose_one`) or fails as a whole; single creates work."""

    def __init__(self, service, lose_one):
        super().__init__(service)
        self.lose_one, self.singles = lose_one, 0

    async def create_batch(self, env, task_index=0, options=None, count=1):
        if not self.lose_one:
            raise Unavailable("env service restarting")
        states = await super().create_batch(env, task_index, options, count)
        await super().close(states[1].episode_id)
        return [states[0], Unavailable("replica gone while creating"), *states[2:]]

    async def create(self, env, task_index=0, options=None):
        self.singles += 1
        return await super().create(env, task_index, options)


@pytest.mark.parametrize("lose_one", [True, False])
def test_episodes_whose_group_create_failed_are_retried_on_single_creates(tokenizer, lose_one):
    service = EnvService()
    client = BatchFailingClient(service, lose_one)
    loop = make_loop(tokenizer, client)
    group = asyncio.run(loop.run_group(task_index=5, group_id="g"))
    assert len(group) == 4 and all(t.success for t in group)
    lost = 1 if lose_one else 4
    assert client.singles == lost and loop.stats == {"episodes_failed": lost, "episode_retries": lost}
    assert service.active == 0


def test_a_cancelled_group_closes_every_environment_it_created(tokenizer):
    service = EnvService()
    loop = make_loop(tokenizer, InProcessEnvClient(service))
    started = asyncio.Event()

    async def never_answers(request_id, prompt_ids, sampling):
        started.set()
        await asyncio.Event().wait()

    loop.generator.generate = never_answers

    async def main():
        group = asyncio.ensure_future(loop.run_group(task_index=5, group_id="g"))
        await started.wait()
        assert service.active == 4
        group.cancel()
        with pytest.raises(asyncio.CancelledError):
            await group
        assert service.active == 0

    asyncio.run(asyncio.wait_for(main(), 30))
