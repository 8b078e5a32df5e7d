"""What a person sees: `python -m services.launcher train` in a real pseudo-terminal (pexpect) on a real tiny
job (vLLM on CPU, every service a process) shows each start-up stage as it happens, then live step lines
with reward, success, KL, step time and ETA; the services' logs are JSON lines (OMRL_LOG_FORMAT=json)
without progress bars. Every process the run started is gone at the end, or is stopped here by PID."""

import io
import json
import os
import re
import signal
import sys
import time
import uuid
from pathlib import Path

import pexpect
import pytest
import redis

from services.common.config import StreamConfig
from tests.support.processes import alive

pytestmark = [pytest.mark.e2e]
ROOT = Path(__file__).resolve().parents[2]
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|\r")
STEPS = 2


def plain(text: str) -> str:
    return ANSI.sub("", text)


@pytest.fixture(scope="module")
def terminal_run(tmp_path_factory):
    out, run = tmp_path_factory.mktemp("runs"), f"tty-{uuid.uuid4().hex[:8]}"
    env = {**os.environ, "OMRL_LOG_FORMAT": "json", "TERM": "xterm-256color", "PYTHONPATH": str(ROOT)}
    env.pop("TQDM_DISABLE", None)  # the launcher must set it for its services itself
    args = [
        "-n",
        "5",
        sys.executable,
        "-m",
        "services.launcher",
        "train",
        "--run",
        run,
        "--output_dir",
        str(out),
        "--steps",
        str(STEPS),
        "--model.warmstart_steps",
        "0",
        "--rollout.group_size",
        "2",
        "--rollout.groups_per_step",
        "2",
        "--env.max_turns",
        "2",
    ]
    child = pexpect.spawn("nice", args, env=env, cwd=str(ROOT), dimensions=(50, 200), encoding="utf-8", timeout=420)
    child.logfile_read = screen = io.StringIO()
    seen, stamps = [], {}
    try:
        for name, pattern in [
            ("building", r"model: building the tiny model"),
            ("model", r"model: tiny model ready"),
            ("envs", r"envs: healthy after"),
            ("reward", r"reward: healthy after"),
            ("loading", r"rollout: loading the vLLM engine \(\d+s\)"),
            ("rollout", r"rollout: healthy after \d+s"),
            ("all", r"all services healthy"),
            (
                "step1",
                r"step 1/2 +reward [-+]\d\.\d{3} +success +\d+% +kl +-?\d\.\d{4} +"
                r"\d+\.\d+s/step +eta \d+s",
            ),
            ("step2", r"step 2/2 +reward [-+]\d\.\d{3} +success +\d+% +kl"),
        ]:
            child.expect(pattern)
            seen.append(name)
            stamps[name] = time.monotonic()
        child.expect(pexpect.EOF)
        child.close()
        transcript = plain(screen.getvalue())
        (out / "terminal.txt").write_text(transcript)
        yield {"seen": seen, "stamps": stamps, "exit": child.exitstatus, "run_dir": out / run, "transcript": transcript}
    finally:
        if child.isalive():
            child.kill(signal.SIGINT)  # the launcher stops every service it started
            child.close(force=True)
        pids = json.loads((out / run / "pids.json").read_text()) if (out / run / "pids.json").exists() else {}
        for pid in pids.values():
            if alive(pid):
                os.killpg(pid, signal.SIGKILL)
        client = redis.Redis.from_url(StreamConfig().redis_url)
        keys = list(client.scan_iter(f"omrl:{run}:*"))
        if keys:
            client.delete(*keys)
        client.close()


def test_start_up_stages_then_live_step_lines_in_a_terminal(terminal_run):
    assert terminal_run["seen"] == [
        "building",
        "model",
        "envs",
        "reward",
        "loading",
        "rollout",
        "all",
        "step1",
        "step2",
    ]
    assert terminal_run["exit"] == 0
    assert "Traceback" not in terminal_run["transcript"]


def test_every_service_process_is_gone(terminal_run):
    pids = json.loads((terminal_run["run_dir"] / "pids.json").read_text())
    assert set(pids) == {"envs", "reward", "rollout", "learner"}
    assert not [name for name, pid in pids.items() if alive(pid)]


def test_service_logs_are_json_lines_without_progress_bars(terminal_run):
    logs = terminal_run["run_dir"] / "logs"
    for service in ("envs", "reward", "rollout", "learner"):
        text = (logs / f"{service}.log").read_text(errors="replace")
        assert not re.search(r"\d+%\|", text) and "it/s]" not in text, f"a progress bar in {service}.log"
        records = [json.loads(line) for line in text.splitlines() if line.startswith("{")]
        assert records and all(r["service"] == service and r["level"] and r["time"] for r in records), service
    learner = [json.loads(line) for line in (logs / "learner.log").read_text().splitlines() if line.startswith("{")]
    assert any(r["message"].startswith("step 2:") for r in learner)
