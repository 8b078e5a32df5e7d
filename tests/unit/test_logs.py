"""One logging setup for every entry point: plain or JSON lines (OMRL_LOG_FORMAT), no progress bars."""

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from services.common.logs import HTTP_CLIENT_LOGGERS, setup_logging

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = """
import logging, os, sys
from services.common.logs import setup_logging
setup_logging("envs")
import tqdm
for _ in tqdm.tqdm(range(3)):
    pass
logging.getLogger("services.envs").info("replica %s serving", "r1")
logging.getLogger("services.envs").debug("not shown at INFO")
print("TQDM_DISABLE=" + os.environ.get("TQDM_DISABLE", ""), file=sys.stderr)
"""


def run(fmt: str | None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("OMRL_LOG_FORMAT", "TQDM_DISABLE", "OMRL_LOG_LEVEL")}
    if fmt is not None:
        env["OMRL_LOG_FORMAT"] = fmt
    return subprocess.run(
        [sys.executable, "-c", SCRIPT],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
        env={**env, "PYTHONPATH": str(ROOT)},
    )


def test_json_lines_name_the_service_and_carry_no_progress_bar():
    out = run("json")
    assert out.returncode == 0, out.stderr
    lines = out.stderr.splitlines()
    records = [json.loads(line) for line in lines if line.startswith("{")]
    assert len(records) == 1
    record = records[0]
    assert {k: record[k] for k in ("level", "logger", "message", "service")} == {
        "level": "INFO",
        "logger": "services.envs",
        "message": "replica r1 serving",
        "service": "envs",
    }
    assert record["time"]
    assert "TQDM_DISABLE=1" in lines and not any("it/s" in line or "%|" in line for line in lines)


def test_text_is_the_default():
    out = run(None)
    assert out.returncode == 0, out.stderr
    line = next(line for line in out.stderr.splitlines() if "replica r1 serving" in line)
    assert " envs INFO services.envs: replica r1 serving" in line and not line.startswith("{")


def test_an_unknown_format_stops_the_service_with_one_line():
    out = run("yaml")
    assert out.returncode == 1
    assert out.stderr.strip() == "envs: OMRL_LOG_FORMAT='yaml' is not one of: text, json"


@pytest.mark.parametrize(
    "module",
    [
        "services.envs",
        "services.reward",
        "services.rollout",
        "services.learner",
        "services.jobs",
        "services.launcher",
        "services.launcher.supervisor",
    ],
)
def test_every_entry_point_uses_the_shared_setup(module):
    path = ROOT / (module.replace(".", "/") + ("/__main__.py" if module.count(".") == 1 else ".py"))
    text = path.read_text()
    assert "setup_logging(" in text and "logging.basicConfig" not in text


@pytest.fixture
def restored_logging():
    """setup_logging configures this process's root logger: put it back for the other tests."""
    root, names = logging.getLogger(), ("", *HTTP_CLIENT_LOGGERS)
    levels, handlers = {name: logging.getLogger(name).level for name in names}, root.handlers[:]
    yield
    root.handlers[:] = handlers
    logging.captureWarnings(False)
    for name, level in levels.items():
        logging.getLogger(name).setLevel(level)


def test_http_clients_log_a_line_per_request_only_at_debug(restored_logging, monkeypatch):
    monkeypatch.delenv("OMRL_LOG_LEVEL", raising=False)
    setup_logging("launcher")
    assert all(logging.getLogger(name).getEffectiveLevel() == logging.WARNING for name in HTTP_CLIENT_LOGGERS)
    assert logging.getLogger("services.envs").isEnabledFor(logging.INFO)
    setup_logging("launcher", "debug")
    assert all(logging.getLogger(name).isEnabledFor(logging.DEBUG) for name in HTTP_CLIENT_LOGGERS)


def test_uvicorn_s_coloured_copy_of_a_message_is_left_out():
    script = (
        "import logging\nfrom services.common.logs import setup_logging\nsetup_logging('jobs-api')\n"
        "logging.getLogger('uvicorn.error').info('Started %s', 1, extra={'color_message': 'x', 'job': 'j'})\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
        env={**os.environ, "OMRL_LOG_FORMAT": "json", "PYTHONPATH": str(ROOT)},
    )
    record = json.loads(out.stderr.strip())
    assert record["message"] == "Started 1" and record["job"] == "j" and "color_message" not in record
