"""A real Prometheus (Debian's `prometheus`) scrapes a running local training and the job API; every
PromQL expression of every Grafana dashboard in deploy/grafana/dashboards must return data. The run trains with
`algorithm.advantage=remax` (no other e2e run does): the last tests check, on the trajectory records it left in
Redis, that each trained group carried exactly one greedy baseline episode that no step metric counts."""

from __future__ import annotations

import functools
import json
import math
import re
import shutil
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
from pathlib import Path

import pytest
import yaml

from services.common.config import load_config
from services.common.grpc_server import free_port
from services.common.run_state import RunState
from services.common.trajectory import decode_batch
from services.launcher.local import LocalRun
from services.launcher.processes import ServiceProcess, python_module

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[2]
DASHBOARDS = sorted((ROOT / "deploy/grafana/dashboards").glob("*.json"))
MIN_STEPS = 3
# Grafana sets $__rate_interval from the scrape interval; here a window spanning the whole (short) run, so
# a rate is 0 only if the event never happened, whatever the load on the machine does to step times
RATE_WINDOW = "3m"
TOKEN = "prometheus-e2e-token"


ABSENT_HERE = (
    "DCGM_",
    "omrl_envs_agentgym_",
    "omrl_reward_model_",
    "omrl_reward_reference_missing",
    "omrl_reward_judge_",
    "omrl_reward_component_failures",
    "omrl_envs_tool_",
    "omrl_rollout_tool_calls",
)
"""Series of backends this run does not have: NVIDIA's DCGM exporter (no GPU), AgentGym servers (a built-in env), a
reward model, rule scorers and an LLM judge (the default reward components), a reward component that fails, and
tools (the text agent loop)."""


def dashboard_queries(absent: bool = False) -> list[tuple[str, str, str]]:
    """(dashboard file, panel title / refId, expr) of every target of every panel: those on the metrics this run
    exports, or (`absent`) those on a backend it does not have (ABSENT_HERE)."""
    out = []
    for path in DASHBOARDS:
        board = json.loads(path.read_text())
        for panel in board["panels"]:
            for target in panel.get("targets", []):
                if any(prefix in target["expr"] for prefix in ABSENT_HERE) == absent:
                    out.append((path.name, f"{panel['title']} / {target['refId']}", target["expr"]))
    return out


def substitute(expr: str, run: str) -> str:
    """Grafana's variables, as Grafana would fill them in for this run."""
    out = expr.replace("$__rate_interval", RATE_WINDOW).replace("$run", run)
    assert "$" not in out, f"unhandled Grafana variable in {expr!r}"
    return out


def http_json(url: str, timeout_s: float = 10.0) -> dict:
    with urllib.request.urlopen(url, timeout=timeout_s) as reply:
        return json.loads(reply.read())


def wait_for(check, timeout_s: float, what: str, poll_s: float = 0.5):
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            result = check()
            if result:
                return result
        except (urllib.error.URLError, OSError, ValueError):
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} after {timeout_s:.0f}s")
        time.sleep(poll_s)


def start_prometheus(config: Path, tmp: Path, attempts: int = 5) -> tuple[ServiceProcess, str]:
    """Prometheus on a free port, and its URL once ready. A port free when picked may be bound by another
    process before Prometheus binds it (the pipeline's services and vLLM's sockets start meanwhile; a second
    test run beside this one): Prometheus then exits ("address already in use") and another port is tried."""
    for attempt in range(attempts):
        port = free_port()
        proc = ServiceProcess(
            "prometheus",
            [
                "prometheus",
                f"--config.file={config}",
                f"--storage.tsdb.path={tmp / 'tsdb'}",
                f"--web.listen-address=127.0.0.1:{port}",
                "--storage.tsdb.retention.time=1h",
                "--log.level=warn",
            ],
            tmp / f"prometheus-{attempt}.log",
        ).start()
        url = f"http://127.0.0.1:{port}"
        check = functools.partial(_ready_or_exited, proc, url, tmp / "tsdb")
        ready = wait_for(check, 60, "Prometheus neither ready nor exited")
        if ready == "ready":
            return proc, url
        proc.stop()
    pytest.fail(f"Prometheus could not bind a port in {attempts} attempts:\n{proc.log_tail()}")


def _ready_or_exited(proc: ServiceProcess, url: str, tsdb: Path) -> str | None:
    if not proc.running():
        return "exited"
    if urllib.request.urlopen(f"{url}/-/ready", timeout=2).status != 200:
        return None
    # the one answering must be this Prometheus, not another test run's that holds the port
    flags = http_json(f"{url}/api/v1/status/flags")["data"]
    return "ready" if flags.get("storage.tsdb.path") == str(tsdb) and proc.running() else None


@pytest.fixture(scope="module")
def stack(tmp_path_factory, warm_tiny_model):
    if not (shutil.which("prometheus") and shutil.which("promtool")):
        pytest.fail("needs Debian's prometheus package (scripts/setup.sh installs it)")
    tmp = tmp_path_factory.mktemp("prom")
    # more steps than the test waits for: the services are scraped while they train, then stopped
    config = load_config(
        None,
        [
            f"run=prom-{uuid.uuid4().hex[:8]}",
            f"output_dir={tmp / 'runs'}",
            "learner.steps=1000",
            "rollout.group_size=4",
            "rollout.groups_per_step=2",
            "algorithm.advantage=remax",  # one greedy baseline episode more per group
            # at the default 1e-3, ReMax pushes every sampled episode below the greedy one and the tiny policy stops
            # emitting a parseable action within two steps: no env step after that, and the env panels run dry
            "algorithm.lr=1e-5",
            f"model.path={warm_tiny_model}",
            "env.validation_every=2",
            "env.validation_tasks=4",
        ],
    )  # validation at v0, v2, ...: its panel has data
    lines: list[str] = []
    run = LocalRun(config, say=lines.append)
    api_port = free_port()
    api = ServiceProcess(
        "jobs-api",
        python_module("services.jobs", "--host", "127.0.0.1", "--port", str(api_port)),
        tmp / "jobs-api.log",
        env={
            "OMRL_API_TOKEN": TOKEN,
            "OMRL_API_DB": str(tmp / "jobs.sqlite"),
            "OMRL_API_LAUNCHER": "local",
            "OMRL_API_OUTPUT_DIR": str(tmp / "jobs"),
        },
    )
    prometheus = None
    try:
        api.start()
        run.start()
        targets = {
            **{name: f"127.0.0.1:{port}" for name, port in run.metrics_ports.items()},
            "jobs-api": f"127.0.0.1:{api_port}",
        }
        scrape = [
            {"job_name": name, "static_configs": [{"targets": [address], "labels": {"run": config.run}}]}
            for name, address in targets.items()
        ]
        scrape[-1]["authorization"] = {"credentials": TOKEN}
        prom_config = tmp / "prometheus.yml"
        prom_config.write_text(
            yaml.safe_dump({"global": {"scrape_interval": "1s", "evaluation_interval": "1s"}, "scrape_configs": scrape})
        )
        prometheus, url = start_prometheus(prom_config, tmp)
        state, history, cursor = RunState.connect(config), [], "0"
        deadline = time.monotonic() + 240
        while len(history) < MIN_STEPS:
            for cursor, entry in state.read_metrics(cursor, block_ms=1000):
                if entry.get("kind") != "validation":  # the rollout's validation runs share the stream
                    history.append(entry)
            for proc in run.processes:
                assert proc.running(), f"{proc.name} exited:\n{proc.log_tail()}"
            assert time.monotonic() < deadline, f"only {len(history)} learner steps in time:\n" + "\n".join(lines[-20:])

        def all_scraped() -> bool:  # target discovery runs every 5 s: a fast run can beat the first scrape
            active = http_json(f"{url}/api/v1/targets")["data"]["activeTargets"]
            return len(active) == len(targets) and all(t["health"] == "up" for t in active)

        wait_for(all_scraped, 60, "Prometheus has not scraped every target")
        # the records of the steps read so far (the run trains on meanwhile; teardown deletes the stream)
        wanted = {entry_id for m in history for entry_id in m["entry_ids"]}
        entries = {
            entry_id.decode(): decode_batch(fields[b"batch"])
            for entry_id, fields in state.client.xrange(state.trajectories_key)
            if entry_id.decode() in wanted
        }
        yield {"url": url, "config": config, "targets": targets, "api": api, "history": history, "entries": entries}
    finally:
        if prometheus is not None:
            prometheus.stop()
        api.stop()
        run.stop()
        RunState.connect(config).reset()


def query(url: str, expr: str) -> list[dict]:
    reply = http_json(f"{url}/api/v1/query?{urllib.parse.urlencode({'query': expr})}")
    assert reply["status"] == "success", reply
    return reply["data"]["result"]


def test_prometheus_scrapes_every_service(stack):
    active = http_json(f"{stack['url']}/api/v1/targets")["data"]["activeTargets"]
    health = {t["labels"]["job"]: (t["health"], t["lastError"]) for t in active}
    assert set(health) == set(stack["targets"])
    assert all(h == "up" for h, _ in health.values()), health


def test_dashboard_run_variable_lists_the_run(stack):
    for path in DASHBOARDS:
        variable = next(v for v in json.loads(path.read_text())["templating"]["list"] if v["name"] == "run")
        metric, label = re.fullmatch(r"label_values\((\w+), (\w+)\)", variable["definition"]).groups()
        values = http_json(f"{stack['url']}/api/v1/label/{label}/values?{urllib.parse.urlencode({'match[]': metric})}")[
            "data"
        ]
        assert stack["config"].run in values, (path.name, values)


@pytest.mark.parametrize(
    "dashboard, panel, expr", dashboard_queries(), ids=[f"{d}: {p}" for d, p, _ in dashboard_queries()]
)
def test_dashboard_query_returns_data(stack, dashboard, panel, expr):
    promql = substitute(expr, stack["config"].run)
    # counters and histograms need two scrapes inside the rate window after their first change
    result = wait_for(
        lambda: [s for s in query(stack["url"], promql) if math.isfinite(float(s["value"][1]))],
        20,
        f"{dashboard} / {panel}: no finite sample for {promql}",
        poll_s=1.0,
    )
    assert result


@pytest.mark.parametrize(
    "dashboard, panel, expr",
    dashboard_queries(absent=True),
    ids=[f"{d}: {p}" for d, p, _ in dashboard_queries(absent=True)],
)
def test_query_of_a_backend_not_here_is_accepted_by_prometheus(stack, dashboard, panel, expr):
    """No DCGM exporter and no AgentGym server run here: Prometheus parses and evaluates the query
    (tests/deploy/test_dashboards.py checks GPU results on DCGM-shaped series; the AgentGym series are
    exercised in tests/integration/test_agentgym_failures.py), and finds no such series."""
    assert query(stack["url"], substitute(expr, stack["config"].run)) == []


def trained_groups(stack) -> list[tuple[dict, dict[str, list]]]:
    """(step summary, the records of its trained groups by group id) for each step the fixture read: the groups
    of the stream entries the step consumed, less trajectories it dropped as stale (older than
    `algorithm.max_staleness` allows)."""
    out = []
    for summary in stack["history"]:
        oldest_ok = summary["step"] - 1 - stack["config"].algorithm.max_staleness
        groups: dict[str, list] = {}
        for entry_id in summary["entry_ids"]:
            for traj in stack["entries"][entry_id].trajectories:
                if min((t.policy_version for t in traj.turns), default=oldest_ok) >= oldest_ok:
                    groups.setdefault(traj.group_id, []).append(traj)
        out.append((summary, groups))
    return out


def test_remax_groups_carry_one_baseline_episode_that_no_step_metric_counts(stack):
    rollout = stack["config"].rollout
    steps = trained_groups(stack)
    assert len(steps) >= MIN_STEPS
    for summary, groups in steps:
        assert len(groups) == summary["groups"] == rollout.groups_per_step, summary["step"]
        for group_id, members in groups.items():
            assert sum(t.baseline for t in members) == 1, group_id
            assert len(members) == rollout.group_size + 1, group_id
        sampled = [t for members in groups.values() for t in members if not t.baseline]
        # the learner service's count and the trainer's, and the Prometheus counter fed from the first
        assert summary["trajectories"] == summary["num_trajectories"] == rollout.group_size * rollout.groups_per_step
        assert summary["success_rate"] == pytest.approx(sum(t.success for t in sampled) / len(sampled))
        assert summary["reward_mean"] == pytest.approx(sum(t.reward for t in sampled) / len(sampled), abs=1e-6)
        goal = sum(t.reward_components["goal"] for t in sampled) / len(sampled)
        assert summary["reward/goal"] == pytest.approx(goal)


def test_remax_baseline_episodes_are_greedy(stack, warm_tiny_model):
    """The baseline episodes the initial weights played (policy version 0: the warm model on disk) took the most
    likely token at every model token under that model, recomputed here with transformers (which gives each token
    the logprob the rollout recorded); the sampled episodes of the same groups did not (seen: 282 of 442 tokens)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(warm_tiny_model, dtype=torch.float32).eval()

    def gaps(traj) -> list[float]:
        """Per model token: how far its logprob lies below the most likely token's (0: the argmax)."""
        ids = torch.tensor([list(traj.token_ids)])
        with torch.no_grad():
            logprobs = torch.log_softmax(model(ids).logits[0].float(), dim=-1)
        out = []
        for pos, (token, mask, recorded) in enumerate(zip(traj.token_ids, traj.loss_mask, traj.logprobs)):
            if mask:
                row = logprobs[pos - 1]
                assert abs(row[token].item() - recorded) < 1e-2, (traj.trajectory_id, pos)
                out.append((row.max() - row[token]).item())
        return out

    first = [
        t
        for _, groups in trained_groups(stack)
        for members in groups.values()
        for t in members
        if {turn.policy_version for turn in t.turns} == {0}
    ]
    baselines, sampled = [t for t in first if t.baseline], [t for t in first if not t.baseline]
    assert len(baselines) == stack["config"].rollout.groups_per_step  # step 1's groups
    for traj in baselines:
        assert max(gaps(traj)) < 1e-3, traj.trajectory_id
    assert max(g for traj in sampled for g in gaps(traj)) > 0.1  # the check tells sampling from greedy
