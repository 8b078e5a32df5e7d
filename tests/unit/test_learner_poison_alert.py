"""The poison-input alert (deploy/prometheus/alerts.yml) fires on the learner's dead-letter counter:
promtool evaluates it on synthetic series."""

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from prometheus_client import REGISTRY

import services.learner.prometheus_metrics  # noqa: F401 - registers the learner's metrics

ROOT = Path(__file__).resolve().parents[2]
SUMMARY = (
    "the learner of run r dead-lettered groups (token_id) in the last 15 minutes; the entries and their "
    "errors are in the stream `<prefix>:<run>:trajectories:dead`"
)


def test_the_alert_reads_a_series_the_learner_exports():
    rules = yaml.safe_load((ROOT / "deploy/prometheus/alerts.yml").read_text())["groups"][0]["rules"]
    [rule] = [r for r in rules if r.get("alert") == "OmrlPoisonTrajectories"]
    assert "omrl_learner_dead_letters_total" in rule["expr"]
    assert REGISTRY.get_sample_value("omrl_learner_dead_letters_total", {"reason": "token_id"}) is not None


def test_the_alert_fires_after_a_dead_letter_and_clears_later(tmp_path):
    if not shutil.which("promtool"):
        pytest.fail("needs promtool from Debian's prometheus package (scripts/setup.sh installs it)")
    tests = {
        "rule_files": [str(ROOT / "deploy/prometheus/alerts.yml")],
        "evaluation_interval": "1m",
        "tests": [
            {
                "interval": "1m",
                "input_series": [
                    {
                        "series": 'omrl_learner_dead_letters_total{run="r",reason="token_id"}',
                        "values": "0 0 1 1 1 1 1 1 1 1 1 1 1 1 1 1 1 1 1 1 1 1 1 1",
                    }
                ],
                "alert_rule_test": [
                    {"eval_time": "1m", "alertname": "OmrlPoisonTrajectories", "exp_alerts": []},
                    {
                        "eval_time": "5m",
                        "alertname": "OmrlPoisonTrajectories",
                        "exp_alerts": [
                            {
                                "exp_labels": {"severity": "warning", "run": "r", "reason": "token_id"},
                                "exp_annotations": {"summary": SUMMARY},
                            }
                        ],
                    },
                    {"eval_time": "23m", "alertname": "OmrlPoisonTrajectories", "exp_alerts": []},
                ],
            }
        ],
    }
    path = tmp_path / "poison_test.yml"
    path.write_text(yaml.safe_dump(tests))
    proc = subprocess.run(["promtool", "test", "rules", str(path)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
