"""`omrl follow` in a real pseudo-terminal (pexpect) against an API that streams a job's events over real
HTTP (server-sent events): start-up stages show as they arrive, each step keeps a line with reward,
success, KL, step time and ETA, and the follow ends with the job's outcome. The same command into a pipe
prints the plain lines."""

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import pexpect
import pytest
from fastapi import FastAPI
from sse_starlette.sse import EventSourceResponse

from tests.support.live_api import LiveApi

ROOT = Path(__file__).resolve().parents[2]
STAGES = [
    ("model", "building", "model: building the tiny model (tokenizer, random init)"),
    ("rollout", "loading", "rollout: loading the vLLM engine (5s)"),
    ("rollout", "healthy", "rollout: healthy after 7s"),
    ("run", "healthy", "all services healthy; the learner waits for the first step's episodes"),
]


def events() -> list[tuple[str, dict]]:
    out = [("state", {"state": "starting"})]
    out += [("message", {"message": m, "service": s, "stage": st}) for s, st, m in STAGES]
    out += [("state", {"state": "running"})]
    out += [
        (
            "step",
            {
                "step": i,
                "reward_mean": 0.1 * i,
                "success_rate": 0.25 * i,
                "approx_kl": 0.001 * i,
                "step_seconds": 2.0,
                "policy_version": i,
            },
        )
        for i in (1, 2, 3)
    ]
    return out + [("state", {"state": "succeeded"})]


def fake_api() -> FastAPI:
    app = FastAPI()

    @app.get("/v1/jobs/{job_id}")
    async def job(job_id: str):
        return {"id": job_id, "total_steps": 3, "state": "starting"}

    @app.get("/v1/jobs/{job_id}/events")
    async def stream(job_id: str, after: int = 0, follow: bool = False):
        async def gen():
            for seq, (kind, data) in enumerate(events(), start=1):
                if seq <= after:
                    continue
                await asyncio.sleep(0.15)  # arrive one by one, as a job's do
                yield {
                    "id": str(seq),
                    "event": kind,
                    "data": json.dumps({"seq": seq, "time": "2026-01-01T00:00:00Z", "type": kind, "data": data}),
                }
            yield {"event": "end", "data": json.dumps({"job_state": "succeeded"})}

        return EventSourceResponse(gen(), ping=1)

    return app


@pytest.fixture(scope="module")
def api():
    with LiveApi(fake_api()) as live:
        yield live


def omrl_args(api: LiveApi) -> list[str]:
    return ["-m", "services.cli", "--api", api.url, "--token", "t", "follow", "job-1"]


def test_follow_in_a_terminal_shows_stages_and_live_step_lines(api):
    child = pexpect.spawn(
        sys.executable,
        omrl_args(api),
        env={**os.environ, "TERM": "xterm-256color", "PYTHONPATH": str(ROOT)},
        cwd=str(ROOT),
        dimensions=(40, 160),
        encoding="utf-8",
        timeout=60,
    )
    try:
        for _, _, message in STAGES:
            child.expect_exact(message)
        child.expect(r"step 1/3 +reward \+0\.100 +success +25% +kl 0\.0010 +2\.0s/step +eta 4s +policy v1")
        child.expect(r"step 2/3 +reward \+0\.200 +success +50% +kl 0\.0020 +2\.0s/step +eta 2s")
        child.expect(r"step 3/3 +reward \+0\.300 +success +75% +kl 0\.0030 +2\.0s/step +eta 0s")
        child.expect_exact("job job-1 succeeded")
        child.expect(pexpect.EOF)
    finally:
        child.close(force=True)
    assert child.exitstatus == 0


def test_follow_into_a_pipe_prints_plain_lines(api):
    out = subprocess.run(
        [sys.executable, *omrl_args(api)],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert "\x1b" not in out.stdout
    assert lines[:2] == ["state: starting", "  model: building the tiny model (tokenizer, random init)"]
    assert "step 3/3 [####################] reward +0.300 success 75% kl 0.0030 2.0s/step v3 eta 0s" in lines
    assert lines[-1] == "job job-1 succeeded"
