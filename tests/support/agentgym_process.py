"""A fake AgentGym server (tests/support/agentgym_fake.py) as a real process on a free port, started by a test
and killed by its PID; environment variables switch on the fake's behaviours (FAKE_HANG_TASKS, ...)."""

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from services.common.grpc_server import free_port

# what the scripted policy answers for `Next: X`; the adapter's cleaning must turn it back into X
SPELLING = {"get 1 plank": "get 1 plank!", "c r a n e": "CRANE"}


def follow_next(observation: str) -> str:
    """The fakes' winning move, as a scripted policy's reply."""
    wanted = re.findall(r"Next: (.+)", observation)[-1].strip()
    return f"<action>{SPELLING.get(wanted, wanted)}</action>"


FAKE = Path(__file__).resolve().parent / "agentgym_fake.py"


class FakeServer:
    def __init__(self, shape: str, tmp: Path, port: int | None = None, **env: str):
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tmp / f"{shape}-{self.port}-{time.monotonic_ns()}.log"
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


def scripted_producer(config, tokenizer, reply, env_service, stream):
    """The real producer (leases in the run's Redis) over the agent loop, a scripted policy answering `reply` for
    each observation, `env_service` in process, flaky-free rewards, and a learner stand-in reading `stream`."""
    from services.common.run_state import AsyncRunState
    from services.envs.client import InProcessEnvClient
    from services.rollout.action_parsers import PARSERS
    from services.rollout.agent_loop import AgentLoop
    from services.rollout.producer import Producer
    from services.rollout.prompting import ChatFormatter
    from tests.support.producers import FlakyRewards, LearnerPace
    from tests.support.scripted_policy import ScriptedPolicy

    loop = AgentLoop(
        ScriptedPolicy(tokenizer, reply),
        InProcessEnvClient(env_service),
        ChatFormatter(tokenizer),
        PARSERS.create("xml_action"),
        config.rollout,
        config.env,
        max_model_len=4096,
    )
    return Producer(
        config, loop, FlakyRewards(), AsyncRunState.connect(config), LearnerPace(stream, 2), poll_s=0.05, holder="a"
    )
