"""The rollout agent loop against AgentGym-protocol servers (fakes written from the spec, one per family
shape, each a real uvicorn process): every family's routes and fields, errors inside HTTP 200
replies, replies slower than the deadline, a server killed mid-episode, and WebShop recycling."""

import asyncio
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from services.common.config import EnvConfig, RolloutConfig, load_config
from services.common.errors import DeadlineExceeded, Internal, InvalidArgument
from services.common.grpc_server import free_port
from services.envs.agentgym.env import _POOLS
from services.envs.client import InProcessEnvClient
from services.envs.datasets import TaskSplit
from services.envs.service import EnvService
from services.rollout.action_parsers import PARSERS
from services.rollout.agent_loop import AgentLoop, EpisodeFailed
from services.rollout.prompting import ChatFormatter
from tests.unit.test_agent_loop import ScriptedPolicy, tokenizer  # noqa: F401 - fixture

FAKE = Path(__file__).with_name("agentgym_fake.py")


class FakeServer:
    def __init__(self, shape: str, tmp: Path, **env: str):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tmp / f"{shape}-{self.port}.log"
        with self.log.open("w") as out:
            self.proc = subprocess.Popen(
                [sys.executable, str(FAKE), shape, str(self.port)],
                stdout=out,
                stderr=subprocess.STDOUT,
                env={**os.environ, **env},
            )
        deadline = time.monotonic() + 30
        while True:
            try:
                if httpx.get(self.url + "/", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.kill()
                pytest.fail(f"fake {shape} server did not start:\n{self.log.read_text()}")
            time.sleep(0.1)

    def kill(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


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
# what the scripted policy answers for `Next: X`; the adapter's cleaning must turn it back into X
SPELLING = {"get 1 plank": "get 1 plank!", "c r a n e": "CRANE"}


def follow_next(observation: str) -> str:
    wanted = re.findall(r"Next: (.+)", observation)[-1].strip()
    return f"<action>{SPELLING.get(wanted, wanted)}</action>"


def make_loop(tokenizer, options, reply=follow_next, timeout_s=5.0, attempts=2, group_size=3):
    service = EnvService(step_timeout_s=timeout_s + 5)
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
    for task in (2, 3):
        group = asyncio.run(loop.run_group(task_index=task, group_id=f"g{task}"))
        for traj in group:
            assert traj.success and traj.stop_reason == "done", (family, traj.turns[-1].text)
            assert len(traj.turns) == 2 + task % 2  # the task index reached the server's reset
    assert loop.stats["episodes_failed"] == 0
    assert service.active == 0
    if family in ("textcraft", "babyai"):  # families with /close: nothing is left on the server
        assert httpx.get(servers[family].url + "/__live").json() == 0


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

    loop, _ = make_loop(tokenizer, {"family": "babyai", "base_url": lone.url}, reply=reply, attempts=2)
    with pytest.raises(EpisodeFailed, match="Unavailable"):
        asyncio.run(loop.run_group(task_index=1, group_id="g"))
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
