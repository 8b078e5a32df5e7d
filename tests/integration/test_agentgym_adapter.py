"""The rollout agent loop against AgentGym-protocol servers (fakes written from the spec, one per family
shape, each a real uvicorn process): every family's routes and fields, errors inside HTTP 200
replies, replies slower than the deadline, a server killed mid-episode, and WebShop recycling; and the
real servers' behaviour: maze's task range and error texts, actions it ignores, a BabyAI reset that
never answers, a server that slows down with concurrency, families without /close, idle episodes,
and a lone server restarted under the real producer."""

import asyncio
import random
import sys
import threading
import time

import httpx
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from prometheus_client import CollectorRegistry

from services.common.config import EnvConfig, RolloutConfig, TrainConfig, load_config
from services.common.errors import DeadlineExceeded, Internal, InvalidArgument
from services.common.run_state import RunState
from services.common.stream import TrajectoryStream
from services.envs.agentgym.env import _POOLS, AgentGymEnv
from services.envs.agentgym.profiles import PROFILES
from services.envs.agentgym.servers import REMOTE_OPEN
from services.envs.client import InProcessEnvClient
from services.envs.datasets import TaskSplit, split_range
from services.envs.deadlines import env_deadlines
from services.envs.demos import DemoStats, random_episodes
from services.envs.messages import EpisodeState
from services.envs.registry import ENVS
from services.envs.service import EnvService
from services.rollout.action_parsers import PARSERS
from services.rollout.agent_loop import AgentLoop, EpisodeFailed
from services.rollout.prompting import ChatFormatter
from tests.support.agentgym_process import FakeServer, follow_next, scripted_producer
from tests.support.producers import play
from tests.support.scripted_policy import ScriptedPolicy, tokenizer  # noqa: F401 - fixture


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("agentgym")
    started = {shape: FakeServer(shape, tmp) for shape in ("textcraft", "babyai", "lmrl", "webshop")}
    yield started
    for server in started.values():
        server.kill()


@pytest.fixture(autouse=True)
def fresh_pools():
    yield
    for pool in _POOLS.values():
        pool.close()
    _POOLS.clear()


URL = {"textcraft": "textcraft", "babyai": "babyai", "maze": "lmrl", "wordle": "lmrl", "webshop": "webshop"}


def make_loop(tokenizer, options, reply=follow_next, timeout_s=5.0, attempts=2, group_size=3, service=None):
    service = service or EnvService(step_timeout_s=timeout_s + 5)
    loop = AgentLoop(
        ScriptedPolicy(tokenizer, reply),
        InProcessEnvClient(service),
        ChatFormatter(tokenizer),
        PARSERS.create("xml_action"),
        RolloutConfig(group_size=group_size, max_new_tokens=32),
        EnvConfig(
            name="agentgym", options={"timeout_s": timeout_s, **options}, max_turns=8, max_episode_attempts=attempts
        ),
        max_model_len=4096,
    )
    return loop, service


@pytest.mark.parametrize("family", ["textcraft", "babyai", "maze", "wordle", "webshop"])
def test_scripted_policy_wins_every_family(servers, tokenizer, family):
    loop, service = make_loop(tokenizer, {"family": family, "base_url": servers[URL[family]].url})
    live = lambda: httpx.get(servers[URL[family]].url + "/__live").json()  # noqa: E731
    live_before = live() if family in ("textcraft", "babyai") else None  # envs other tests of the module left open
    for task in (2, 3):
        group = asyncio.run(loop.run_group(task_index=task, group_id=f"g{task}"))
        for traj in group:
            assert traj.success and traj.stop_reason == "done", (family, traj.turns[-1].text)
            assert len(traj.turns) == 2 + task % 2  # the task index reached the server's reset
    assert loop.stats["episodes_failed"] == 0
    assert service.active == 0
    if family in ("textcraft", "babyai"):  # families with /close: this test left nothing on the server
        assert live() == live_before


def test_actions_are_cleaned_as_the_family_expects(servers, tokenizer):
    for family in ("textcraft", "wordle"):
        loop, service = make_loop(tokenizer, {"family": family, "base_url": servers[URL[family]].url})
        traj = asyncio.run(loop.run_episode(task_index=0, group_id="g"))
        assert traj.success and traj.turns[0].action in ("get 1 plank!", "CRANE")


def test_error_inside_a_200_reply_is_a_typed_failure(servers, tokenizer):
    async def main():
        service = EnvService()
        client = InProcessEnvClient(service)
        state = await client.create("agentgym", 0, {"family": "babyai", "base_url": servers["babyai"].url})
        with pytest.raises(Internal, match="error reply: exploded on request"):
            await client.step(state.episode_id, "explode")
        await client.close(state.episode_id)

    asyncio.run(main())
    loop, _ = make_loop(
        tokenizer,
        {"family": "webshop", "base_url": servers["webshop"].url},
        reply=lambda obs: "<action>explode</action>",
        attempts=2,
    )
    with pytest.raises(EpisodeFailed, match="error reply") as err:
        asyncio.run(loop.run_group(task_index=1, group_id="g"))
    assert err.value.retryable and loop.stats["episode_retries"] >= 1


def test_reply_slower_than_the_deadline_is_deadline_exceeded(servers, tokenizer):
    async def main():
        client = InProcessEnvClient(EnvService(step_timeout_s=10))
        options = {"family": "textcraft", "base_url": servers["textcraft"].url, "timeout_s": 0.5}
        state = await client.create("agentgym", 0, options)
        start = time.monotonic()
        with pytest.raises(DeadlineExceeded, match="no reply within 0.5s"):
            await client.step(state.episode_id, "sleep")
        return time.monotonic() - start

    assert asyncio.run(main()) < 3.0
    loop, _ = make_loop(
        tokenizer,
        {"family": "textcraft", "base_url": servers["textcraft"].url},
        timeout_s=0.5,
        reply=lambda obs: "<action>sleep</action>",
        attempts=1,
        group_size=1,
    )
    with pytest.raises(EpisodeFailed, match="DeadlineExceeded"):
        asyncio.run(loop.run_group(task_index=0, group_id="g"))


def test_http_500_and_wrong_family_are_typed(servers):
    async def main():
        client = InProcessEnvClient(EnvService())
        state = await client.create("agentgym", 0, {"family": "textcraft", "base_url": servers["textcraft"].url})
        with pytest.raises(Internal, match="HTTP 500"):
            await client.step(state.episode_id, "crash")
        with pytest.raises(InvalidArgument, match="family"):
            await client.create("agentgym", 0, {"family": "webshop", "base_url": servers["lmrl"].url})
        with pytest.raises(InvalidArgument, match="unknown AgentGym family"):
            await client.create("agentgym", 0, {"family": "nethack", "base_url": servers["lmrl"].url})

    asyncio.run(main())


def test_server_killed_mid_episode_episodes_move_to_the_live_server(servers, tokenizer, tmp_path):
    doomed = FakeServer("textcraft", tmp_path)
    calls = []

    def reply(observation):
        calls.append(observation)
        if len(calls) == 4:  # every episode of the group has played a turn: kill one server mid-episode
            doomed.kill()
        return follow_next(observation)

    try:
        loop, service = make_loop(
            tokenizer,
            {"family": "textcraft", "base_url": [doomed.url, servers["textcraft"].url]},
            reply=reply,
            attempts=3,
            group_size=4,
        )
        group = asyncio.run(loop.run_group(task_index=1, group_id="g"))
    finally:
        doomed.kill()
    assert all(t.success for t in group) and len(group) == 4
    assert loop.stats["episode_retries"] >= 1, "the episodes pinned to the killed server were played again"
    assert service.active == 0


def test_killed_server_with_no_other_drops_the_group(tokenizer, tmp_path):
    lone = FakeServer("babyai", tmp_path)
    calls = []

    def reply(observation):
        calls.append(observation)
        if len(calls) == 2:
            lone.kill()
        return follow_next(observation)

    try:
        loop, _ = make_loop(tokenizer, {"family": "babyai", "base_url": lone.url}, reply=reply, attempts=2)
        with pytest.raises(EpisodeFailed, match="Unavailable"):
            asyncio.run(loop.run_group(task_index=1, group_id="g"))
    finally:
        lone.kill()
    assert loop.stats["episodes_failed"] >= 2


def test_webshop_server_is_recycled_after_its_quota(tokenizer, tmp_path):
    server = FakeServer("webshop", tmp_path, FAKE_MAX_ENVS="4")
    marker = tmp_path / "recycled"
    command = (
        f"{sys.executable} -c \"import pathlib, urllib.request; urllib.request.urlopen('{{url}}/__restart', "
        f"data=b''); pathlib.Path('{marker}').write_text('{{port}}')\""
    )
    try:
        loop, _ = make_loop(
            tokenizer,
            {
                "family": "webshop",
                "base_url": server.url,
                "recycle_after": 3,
                "recycle_command": command,
                "recycle_wait_s": 20,
            },
            group_size=1,
        )
        pool = None
        for task in range(3):
            assert asyncio.run(loop.run_group(task_index=task, group_id=f"g{task}"))[0].success
            pool = pool or next(iter(_POOLS.values()))
        deadline = time.monotonic() + 20
        while pool.recycles < 1 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert pool.recycles == 1 and marker.read_text() == str(server.port)
        assert httpx.post(server.url + "/create").json() == 0, "the recycled server starts from id 0 again"
        for task in range(3, 6):  # without recycling, ids past FAKE_MAX_ENVS would collide
            assert asyncio.run(loop.run_group(task_index=task, group_id=f"g{task}"))[0].success
    finally:
        server.kill()


def test_one_config_entry_trains_against_a_server(servers, tokenizer, tmp_path):
    config = load_config(
        None,
        [
            "env.name=agentgym",
            f"env.data_dir={tmp_path}",
            "env.train_tasks=20",
            f"env.options={{family: textcraft, base_url: '{servers['textcraft'].url}'}}",
        ],
    )
    split = TaskSplit.load(config.env, "train")  # generated without contacting the server: no prompts
    assert split.task_indices == list(range(20))
    loop = AgentLoop(
        ScriptedPolicy(tokenizer, follow_next),
        InProcessEnvClient(EnvService()),
        ChatFormatter(tokenizer),
        PARSERS.create("xml_action"),
        config.rollout,
        config.env,
        max_model_len=4096,
    )
    traj = asyncio.run(loop.run_episode(split.draw("0:0"), group_id="g"))
    assert traj.success and traj.env == "agentgym"


# --- the real servers' behaviour (shared/agentgym-protocol.md, "Behaviour seen on the real servers") ---


def stats(server):
    return httpx.get(server.url + "/__stats").json()


def sample(registry, name, **labels):
    return registry.get_sample_value(name, labels) or 0.0


def test_maze_task_range_real_error_texts_and_datasets_inside_it(servers, tokenizer, tmp_path):
    url = servers["lmrl"].url
    registry = CollectorRegistry()
    service = EnvService(metrics_registry=registry)
    client = InProcessEnvClient(service)

    async def main():
        wide = {"family": "maze", "base_url": url, "task_range": [0, 100]}  # let 25 and 26 reach the server
        with pytest.raises(InvalidArgument, match=r"abandoned \(invalid\).*rejects task 25: \(an empty error"):
            await client.create("agentgym", 25, wide)
        with pytest.raises(InvalidArgument, match=r"rejects task 26: The game 26 is not valid\."):
            await client.create("agentgym", 26, wide)
        before = stats(servers["lmrl"])["steps"], httpx.get(url + "/__live").json()
        with pytest.raises(InvalidArgument, match=r"task 30 is outside the tasks its server serves \(0\.\.24\)"):
            await client.create("agentgym", 30, {"family": "maze", "base_url": url})
        assert (stats(servers["lmrl"])["steps"], httpx.get(url + "/__live").json()) == before  # never sent
        state = await client.create("agentgym", 24, {"family": "maze", "base_url": url})
        await client.close(state.episode_id)

    asyncio.run(main())
    assert service.abandoned_tasks == 3
    assert sample(registry, "omrl_envs_tasks_abandoned_total", env="agentgym", reason="invalid") == 3

    # the documented one-entry config: generated splits stay inside games 0..24
    config = load_config(
        None, ["env.name=agentgym", f"env.data_dir={tmp_path}", f"env.options={{family: maze, base_url: '{url}'}}"]
    )
    assert TaskSplit.load(config.env, "train").task_indices == list(range(20))
    assert TaskSplit.load(config.env, "validation").task_indices == list(range(20, 25))
    own = tmp_path / "own"
    own.mkdir()
    for split in ("train", "validation"):
        pq.write_table(pa.table({"task_index": [3, 576]}), own / f"{split}.parquet")
    with pytest.raises(ValueError, match=r"task indices \[576\] are outside the tasks agentgym serves"):
        TaskSplit.load(config.env.model_copy(update={"dataset": str(own)}), "train")

    # an invalid task is not retried on a fresh environment: the group fails at once, not retryable
    loop, _ = make_loop(tokenizer, {"family": "maze", "base_url": url, "task_range": [0, 100]}, attempts=3)
    with pytest.raises(EpisodeFailed, match="The game 40 is not valid") as err:
        asyncio.run(loop.run_group(task_index=40, group_id="g"))
    assert not err.value.retryable and loop.stats["episode_retries"] == 0


def test_maze_actions_the_server_would_ignore_are_answered_here(servers):
    server = servers["lmrl"]

    async def main():
        client = InProcessEnvClient(EnvService())
        state = await client.create("agentgym", 2, {"family": "maze", "base_url": server.url, "max_turns": 3})
        steps = stats(server)["steps"]
        ignored = await client.step(state.episode_id, "up")
        assert "Action not understood: 'up'" in ignored.observation and "move up" in ignored.observation
        assert ignored.info["action_valid"] is False and not ignored.done
        assert stats(server)["steps"] == steps  # not sent: the server would have said nothing
        moved = await client.step(state.episode_id, "Move  Up")  # case and spacing are ours to fix
        assert moved.info["action_valid"] is True and "1 to go" in moved.observation
        last = await client.step(state.episode_id, "north")
        assert last.done and not last.success and "Out of turns" in last.observation
        await client.close(state.episode_id)

    asyncio.run(main())


def test_a_reset_that_never_answers_abandons_the_task_and_the_run_goes_on(tokenizer, tmp_path):
    server = FakeServer("babyai", tmp_path, FAKE_HANG_TASKS="7")
    registry = CollectorRegistry()
    service = EnvService(step_timeout_s=5, metrics_registry=registry)
    options = {"family": "babyai", "base_url": server.url, "timeout_s": 1.0}
    try:

        async def main():
            client = InProcessEnvClient(service)
            start = time.monotonic()
            with pytest.raises(InvalidArgument, match=r"abandoned \(hung\).*reset of task 7 never answered"):
                await client.create("agentgym", 7, options)
            assert time.monotonic() - start < 4.0  # the adapter's deadline, not the service's
            state = await client.create("agentgym", 8, options)
            assert not (await client.step(state.episode_id, "move forward")).done
            await client.close(state.episode_id)

        asyncio.run(main())
        assert service.abandoned_tasks == 1
        assert sample(registry, "omrl_envs_tasks_abandoned_total", env="agentgym", reason="hung") == 1

        loop, _ = make_loop(tokenizer, options, attempts=3, group_size=2, service=service)
        with pytest.raises(EpisodeFailed, match="never answered") as err:
            asyncio.run(loop.run_group(task_index=7, group_id="g"))
        assert not err.value.retryable and loop.stats["episode_retries"] == 0

        # the tiny model's corpus and warm-start meet it too: skipped, the others played and closed
        demo_stats = DemoStats()
        env_cfg = EnvConfig(name="agentgym", options=options, max_turns=2)
        demos = list(random_episodes(env_cfg, 4, seed=0, first_task=5, stats=demo_stats))
        assert [d.task_index for d in demos] == [5, 6, 8, 9] and demo_stats.skipped == {"hung": 1}
        # the environment created for the hung reset refuses to close until reset (as BabyAI's does): the health
        # watch resets it on a task that answered, then closes it
        live = lambda: httpx.get(server.url + "/__live", timeout=5).json()  # noqa: E731
        assert eventually(live, 0) == 0
        assert REMOTE_OPEN.labels("babyai", server.url)._value.get() == 0
    finally:
        server.kill()


def test_a_reset_cut_short_by_queueing_is_retried_once_then_counted_as_hung(tokenizer, tmp_path):
    server = FakeServer("babyai", tmp_path, FAKE_HANG_TASKS="7,47")
    registry = CollectorRegistry()
    # 1.4 s for the whole env call leaves the server less than timeout_s: slow and hung look alike
    service = EnvService(step_timeout_s=1.4, metrics_registry=registry)
    options = {"family": "babyai", "base_url": server.url, "timeout_s": 1.0}
    try:

        async def main():
            client = InProcessEnvClient(service)
            with pytest.raises(DeadlineExceeded, match="reset env .*, task 7"):
                await client.create("agentgym", 7, options)
            with pytest.raises(InvalidArgument, match=r"abandoned \(hung\).*reset of task 7 never answered"):
                await client.create("agentgym", 7, options)
            state = await client.create("agentgym", 8, options)
            await client.close(state.episode_id)

        asyncio.run(main())
        assert service.abandoned_tasks == 1
        assert sample(registry, "omrl_envs_tasks_abandoned_total", env="agentgym", reason="hung") == 1

        loop, _ = make_loop(tokenizer, options, timeout_s=1.0, attempts=3, group_size=1, service=service)
        with pytest.raises(EpisodeFailed, match="never answered") as err:
            asyncio.run(loop.run_group(task_index=47, group_id="g"))
        assert not err.value.retryable and loop.stats["episode_retries"] == 1
        assert service.abandoned_tasks == 2
    finally:
        server.kill()


def test_a_server_slowed_by_concurrency_gets_at_most_max_concurrent_calls(tokenizer, tmp_path):
    """Each request takes 0.01 s x (requests in flight)^2: 4 at once answer in 0.16 s, 8 or more
    miss a 0.5 s deadline."""
    fast_enough = FakeServer("babyai", tmp_path, FAKE_SLOW_S="0.01")
    overloaded = FakeServer("babyai", tmp_path, FAKE_SLOW_S="0.01")
    try:
        loop, service = make_loop(
            tokenizer,
            {"family": "babyai", "base_url": fast_enough.url, "timeout_s": 0.5, "max_concurrent": 4},
            attempts=1,
            group_size=32,
        )
        group = asyncio.run(loop.run_group(task_index=1, group_id="g"))
        assert len(group) == 32 and all(t.success for t in group)
        assert loop.stats["episodes_failed"] == 0 and service.active == 0
        assert stats(fast_enough)["peak_in_flight"] <= 4

        loop, _ = make_loop(
            tokenizer,
            {"family": "babyai", "base_url": overloaded.url, "timeout_s": 0.5, "max_concurrent": 64},
            attempts=1,
            group_size=32,
        )
        # a group's resets start together (one create_batch), so the first call to miss its deadline may be a
        # reset (the task then counts as hung) as well as a step
        with pytest.raises(EpisodeFailed, match="DeadlineExceeded|reset of task 1 never answered"):
            asyncio.run(loop.run_group(task_index=1, group_id="g"))
        assert stats(overloaded)["peak_in_flight"] >= 8
    finally:
        fast_enough.kill()
        overloaded.kill()


def test_deadlines_scaled_by_queue_waves_let_every_queued_episode_finish(tokenizer, tmp_path):
    """24 episodes at once on a server with 2 slots: a call waits up to 12 waves of 0.1 s (two in
    flight take 0.025 s x 2^2 each). An env call that does not queue (create + reset: 0.2 s) fits in
    step_timeout_s 1 s; queued (up to 2.4 s), it fits only in the scaled deadline (12 waves: 12 s)."""
    from services.envs.agentgym.servers import QUEUE_WAIT

    server = FakeServer("babyai", tmp_path, FAKE_SLOW_S="0.025")
    options = {"family": "babyai", "base_url": server.url, "max_concurrent": 2}
    config = TrainConfig.model_validate(
        {
            "rollout": {"group_size": 24, "groups_per_step": 1},
            "env": {"name": "agentgym", "options": {**options, "timeout_s": 0.5}, "step_timeout_s": 1.0},
        }
    )
    deadlines = env_deadlines(config)
    assert (deadlines.waves, deadlines.service_s) == (12, 12.0)
    try:
        registry = CollectorRegistry()
        service = EnvService(step_timeout_s=deadlines.service_s, metrics_registry=registry)
        loop, _ = make_loop(tokenizer, options, timeout_s=0.5, attempts=1, group_size=24, service=service)
        group = asyncio.run(loop.run_group(task_index=1, group_id="g"))
        assert len(group) == 24 and all(t.success for t in group)
        assert loop.stats["episodes_failed"] == 0
        assert sample(registry, "omrl_envs_errors_total", env="agentgym", kind="DeadlineExceeded") == 0
        assert stats(server)["peak_in_flight"] <= 2
        waited = QUEUE_WAIT.labels("babyai", server.url)
        assert waited._sum.get() > 1.0, "the calls did queue"

        unscaled = EnvService(step_timeout_s=config.env.step_timeout_s)
        loop, _ = make_loop(tokenizer, options, timeout_s=0.5, attempts=1, group_size=24, service=unscaled)
        # the queue outlasts the fixed deadline: a step ends in DeadlineExceeded, or a reset that never got a
        # slot within the deadline is given up (which of the two comes first depends on the call order)
        with pytest.raises(EpisodeFailed, match=r"DeadlineExceeded|no free slot within"):
            asyncio.run(loop.run_group(task_index=1, group_id="g2"))
    finally:
        server.kill()


def test_idle_episodes_are_reaped_on_a_timer(servers):
    registry = CollectorRegistry()
    service = EnvService(idle_ttl_s=0.3, metrics_registry=registry)
    server = servers["textcraft"]

    before = httpx.get(server.url + "/__live").json()  # what earlier tests left on the shared server

    async def main():
        client = InProcessEnvClient(service)
        for task in range(3):
            await client.create("agentgym", task, {"family": "textcraft", "base_url": server.url})
        assert httpx.get(server.url + "/__live").json() == before + 3
        reaper = asyncio.create_task(service.reap_forever(period_s=0.1))
        deadline = time.monotonic() + 10
        while (service.active or httpx.get(server.url + "/__live").json() > before) and time.monotonic() < deadline:
            await asyncio.sleep(0.1)  # no Create arrives meanwhile
        reaper.cancel()

    asyncio.run(main())
    assert service.active == 0 and service.reaped_episodes == 3
    assert sample(registry, "omrl_envs_episodes_reaped_total", env="agentgym") == 3
    assert httpx.get(server.url + "/__live").json() == before, "reaped episodes are closed on the server too"


def eventually(read, want, timeout_s=10.0):
    """Closes run in the service's worker threads after the episode ends: wait for them."""
    deadline = time.monotonic() + timeout_s
    while read() != want and time.monotonic() < deadline:
        time.sleep(0.05)
    return read()


def test_open_environments_are_counted_and_a_missing_close_is_called_once(servers, tokenizer, tmp_path):
    def open_envs(family, url):
        return REMOTE_OPEN.labels(family, url)._value.get()

    lmrl = FakeServer("lmrl", tmp_path)
    textcraft = FakeServer("textcraft", tmp_path)
    no_close = FakeServer("textcraft", tmp_path, FAKE_NO_CLOSE="1")
    try:
        loop, _ = make_loop(tokenizer, {"family": "maze", "base_url": lmrl.url}, group_size=2)
        asyncio.run(loop.run_group(task_index=2, group_id="g"))
        assert httpx.get(lmrl.url + "/__live").json() == 2 == open_envs("maze", lmrl.url)  # no /close: they stay
        assert stats(lmrl)["closes"] == 0

        loop, _ = make_loop(tokenizer, {"family": "textcraft", "base_url": textcraft.url}, group_size=2)
        asyncio.run(loop.run_group(task_index=2, group_id="g"))
        assert eventually(lambda: open_envs("textcraft", textcraft.url), 0) == 0
        assert httpx.get(textcraft.url + "/__live").json() == 0

        loop, _ = make_loop(tokenizer, {"family": "textcraft", "base_url": no_close.url}, group_size=3)
        for task in (2, 3):
            assert all(t.success for t in asyncio.run(loop.run_group(task_index=task, group_id=f"g{task}")))
        assert eventually(lambda: open_envs("textcraft", no_close.url), 6) == 6
        assert httpx.get(no_close.url + "/__live").json() == 6
        assert stats(no_close)["closes"] == 1, "a 404 on /close is learnt, not repeated"
    finally:
        for server in (lmrl, textcraft, no_close):
            server.kill()


def test_create_info_names_the_remote_environment(servers):
    async def main():
        client = InProcessEnvClient(EnvService())
        state = await client.create("agentgym", 3, {"family": "textcraft", "base_url": servers["textcraft"].url})
        await client.close(state.episode_id)
        return state

    state = asyncio.run(main())
    for info in (state.info, EpisodeState.from_proto(state.to_proto()).info):  # in process and on the wire
        assert info["family"] == "textcraft" and info["server"] == servers["textcraft"].url
        assert info["task_index"] == 3 and type(info["remote_id"]) is int


def test_textcraft_random_policy_plays_every_action_form():
    observation = (
        "Crafting commands:\ncraft 1 blue dye using 1 lapis lazuli\n"
        "craft 4 oak planks using 1 oak log\ncraft 1 stick bundle using 2 oak planks, 1 string\n"
        "Goal: craft blue dye."
    )
    rng = random.Random(0)
    actions = [PROFILES["textcraft"].random_action(observation, rng) for _ in range(300)]
    kinds = {a.split()[0] for a in actions}
    assert kinds == {"get", "craft", "inventory"}
    fetched = {" ".join(a.split()[2:]) for a in actions if a.startswith("get ")}
    assert fetched == {"lapis lazuli", "oak log", "string"}  # raw materials only, never a crafted item


@pytest.mark.parametrize("family, games, probe_resets", [("alfworld", 13, 9), ("sciworld", 5, 0)])
def test_a_loaded_task_list_is_probed_once_and_an_index_past_it_is_not_retried(
    tokenizer, tmp_path, family, games, probe_resets
):
    server = FakeServer(family, tmp_path, FAKE_GAMES=str(games))
    try:
        options = {"family": family, "base_url": server.url}
        known = range(games) if probe_resets else None  # SciWorld's list grows on every create: never probed
        assert AgentGymEnv.task_range(options) == known
        assert stats(server)["resets"] == probe_resets  # 0, 1, 2, 4, 8, 16, then 12, 14, 13
        assert AgentGymEnv.task_range(options) == known  # once per process
        assert stats(server)["resets"] == probe_resets
        assert httpx.get(server.url + "/__live").json() == (1 if probe_resets else 0)  # ALFWorld has no /close
        env_cfg = EnvConfig(name="agentgym", options=options, train_tasks=100, validation_tasks=4)
        if known is not None:
            assert set(split_range(env_cfg, "train")) | set(split_range(env_cfg, "validation")) == set(known)

        registry = CollectorRegistry()
        service = EnvService(metrics_registry=registry)
        client = InProcessEnvClient(service)

        async def main():
            state = await client.create("agentgym", games - 1, options)  # ALFWorld's reset needs world_type
            await client.close(state.episode_id)
            resets = stats(server)["resets"]
            with pytest.raises(InvalidArgument, match=rf"abandoned \(invalid\).*task {games}"):
                await client.create("agentgym", games, options)
            assert stats(server)["resets"] == resets + (0 if known else 1)  # a probed range answers here
            wide = {**options, "task_range": [0, 1000]}
            with pytest.raises(InvalidArgument, match=r"abandoned \(invalid\).*task 40: list index out of range"):
                await client.create("agentgym", 40, wide)

        asyncio.run(main())
        assert service.abandoned_tasks == 2
        assert sample(registry, "omrl_envs_tasks_abandoned_total", env="agentgym", reason="invalid") == 2

        resets = stats(server)["resets"]
        loop, _ = make_loop(tokenizer, {**options, "task_range": [0, 1000]}, attempts=3, group_size=1)
        with pytest.raises(EpisodeFailed, match="list index out of range") as err:
            asyncio.run(loop.run_group(task_index=games + 7, group_id="g"))
        assert not err.value.retryable and loop.stats["episode_retries"] == 0
        assert stats(server)["resets"] == resets + 1
    finally:
        server.kill()


def test_wordle_random_policy_guesses_words_the_server_still_accepts(servers):
    env = ENVS.create("agentgym")
    env.reset(3, {"family": "wordle", "base_url": servers["lmrl"].url})
    try:
        rng = random.Random(0)
        guesses = {env.random_action(rng) for _ in range(30)}
    finally:
        env.close()
    assert guesses == {"c r a n e", "f r o w n", "l i g h t"}  # the fake's filtered vocabulary, spaced


def test_a_restart_of_the_only_server_does_not_end_the_run(tokenizer, tmp_path, redis_url, run_name):
    """The real producer (group leases in Redis) over the agent loop: the lone BabyAI server is killed
    mid-run and started again on its port; the groups it broke are replayed and every slot publishes."""
    server = FakeServer("babyai", tmp_path)
    calls, restarted, restarters = [], [], []

    def restart():
        time.sleep(1.0)
        restarted.append(FakeServer("babyai", tmp_path, port=server.port))

    def reply(observation):
        calls.append(observation)
        if len(calls) == 6:
            server.kill()
            restarters.append(threading.Thread(target=restart, daemon=True))
            restarters[-1].start()
        return follow_next(observation)

    config = load_config(
        None,
        [
            f"run={run_name}",
            f"stream.redis_url={redis_url}",
            "learner.steps=2",
            "rollout.groups_per_step=2",
            "rollout.group_size=2",
            "rollout.group_retry_backoff_s=0.5",
            "env.name=agentgym",
            "env.max_turns=8",
            f"env.data_dir={tmp_path}",
            "env.train_tasks=20",
            f"env.options={{family: babyai, base_url: '{server.url}', timeout_s: 2}}",
        ],
    )
    state = RunState.connect(config)
    try:
        stream = TrajectoryStream(state.client, state.trajectories_key)
        producer = scripted_producer(config, tokenizer, reply, EnvService(), stream)
        asyncio.run(asyncio.wait_for(play(producer), 90))
        counters = state.rollout_counters()
        assert restarted, "the server was restarted"
        assert counters["groups_published"] == 4 and counters["groups_dropped"] >= 1
        assert counters.get("groups_dead_lettered", 0) == 0 and state.leases.held() == {}
        assert stream.length() == 4
    finally:
        state.reset()
        server.kill()
        for thread in restarters:  # a server it is starting must not outlive the test
            thread.join(60)
        for again in restarted:
            again.kill()
