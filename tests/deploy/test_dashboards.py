"""The Grafana dashboards in deploy/grafana/dashboards: well-formed, valid PromQL (promtool), and every
metric they query is one the services define. tests/e2e/test_prometheus_dashboards.py shows each
query returns data from a real training run."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from prometheus_client import REGISTRY, CollectorRegistry

ROOT = Path(__file__).resolve().parents[2]
DASHBOARDS = sorted((ROOT / "deploy/grafana/dashboards").glob("*.json"))
# series Prometheus itself attaches to every target, and the client library's process metrics
SCRAPE_SERIES = {"up"}
CLIENT_PREFIXES = ("process_", "python_")
DCGM_LIST = ROOT / "deploy/grafana/dcgm-exporter-metrics.txt"


def dcgm_documented() -> tuple[set[str], set[str]]:
    """(metric names, label names) of NVIDIA's dcgm-exporter, as the committed list records them."""
    lines = [line.split() for line in DCGM_LIST.read_text().splitlines() if line.strip()]
    labels = next(set(words[2:]) for words in lines if words[:2] == ["#", "labels:"])
    return {words[0] for words in lines if not words[0].startswith("#")}, labels


def boards() -> list[tuple[Path, dict]]:
    return [(path, json.loads(path.read_text())) for path in DASHBOARDS]


def targets(board: dict) -> list[tuple[dict, dict]]:
    return [(panel, target) for panel in board["panels"] for target in panel.get("targets", [])]


def test_two_dashboards_training_progress_and_system_health():
    assert {board["uid"] for _, board in boards()} == {"omrl-training", "omrl-system-health"}


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.name)
def test_panels_are_well_formed(path):
    board = json.loads(path.read_text())
    ids = [panel["id"] for panel in board["panels"]]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    for panel in board["panels"]:
        pos = panel["gridPos"]
        assert pos["x"] + pos["w"] <= 24, panel["title"]
        if panel["type"] == "row":
            continue
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
        assert panel["targets"] and panel.get("description") is not None, panel["title"]
        ref_ids = [t["refId"] for t in panel["targets"]]
        assert len(ref_ids) == len(set(ref_ids)), panel["title"]
        for target in panel["targets"]:
            assert target["expr"].strip(), panel["title"]


def grafana_free(expr: str) -> str:
    return expr.replace("$__rate_interval", "1m").replace("$run", "some-run")


def test_every_expression_is_valid_promql(tmp_path):
    """promtool parses each expression as a recording rule: a syntax error fails here, offline."""
    if not shutil.which("promtool"):
        pytest.fail("needs promtool from Debian's prometheus package (scripts/setup.sh installs it)")
    rules = [
        {"record": f"omrl:dashboard_check:{i}", "expr": grafana_free(t["expr"])}
        for i, (_, board) in enumerate(boards())
        for _, t in targets(board)
    ]
    for i, rule in enumerate(rules):
        rule["record"] = f"omrl:dashboard_check:{i}"
    path = tmp_path / "rules.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboards", "rules": rules}]}))
    proc = subprocess.run(["promtool", "check", "rules", str(path)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"SUCCESS: {len(rules)} rules found" in proc.stdout


def test_the_promql_check_catches_a_broken_expression(tmp_path):
    path = tmp_path / "rules.yml"
    path.write_text(
        yaml.safe_dump(
            {
                "groups": [
                    {
                        "name": "x",
                        "rules": [
                            {
                                "record": "omrl:broken",
                                "expr": "sum by (job (rate(omrl_rollout_generated_tokens_total[1m]))",
                            }
                        ],
                    }
                ]
            }
        )
    )
    proc = subprocess.run(["promtool", "check", "rules", str(path)], capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0


def sample_names(registry: CollectorRegistry) -> set[str]:
    """Every series name a registry exposes; for a labelled metric without children yet, the names it
    surely will (a histogram's _sum only once seen: the client omits it when buckets go below zero)."""
    names = set()
    for family in registry.collect():
        names |= {sample.name for sample in family.samples if not sample.name.endswith("_created")}
        if not family.samples:
            suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_count"), "summary": ("_count",)}
            names |= {family.name + s for s in suffixes.get(family.type, ("",))}
    return names


@pytest.fixture(scope="module")
def exported_series() -> set[str]:
    """What the services define: module-level metrics (rollout, learner) register on import; the env
    and reward services, the gRPC layer and the job API build theirs; the stream collector reads Redis."""
    import services.engines.engine_metrics  # noqa: F401
    import services.envs.agentgym.servers  # noqa: F401
    import services.learner.prometheus_metrics as learner_metrics
    import services.reward.judge  # noqa: F401
    import services.reward.reward_model  # noqa: F401
    import services.rollout.agent_loop  # noqa: F401
    import services.rollout.core  # noqa: F401
    import services.rollout.evaluation  # noqa: F401
    import services.rollout.producer  # noqa: F401
    import services.rollout.tool_loop  # noqa: F401
    from services.common.config import EnvConfig, RewardConfig
    from services.common.grpc_server import ErrorInterceptor
    from services.envs.service import EnvService
    from services.jobs.app import ApiMetrics
    from services.reward.composer import RewardComposer
    from services.reward.service import RewardService

    for service in ("rollout", "envs", "reward"):
        ErrorInterceptor(service)
    own = CollectorRegistry()
    EnvService(metrics_registry=own)
    composer = RewardComposer.from_config(RewardConfig(), EnvConfig(), metrics_registry=own)  # + the references' count
    reward = RewardService(composer, metrics_registry=own)
    for observed in (reward._m_component.labels("goal"), reward._m_latency, reward._m_total):
        observed.observe(0.5)  # labelled children exist once used; their samples show what is exported

    import redis

    from services.common.stream import TrajectoryStream

    class FakeStream(TrajectoryStream):
        def length(self):
            return 3

        def pending_count(self):
            return 2

        def lag(self):
            return 1

    collector = learner_metrics.StreamCollector(TrajectoryStream(redis.Redis(), "omrl:x:trajectories"))
    collector.stream = FakeStream(redis.Redis(), "omrl:x:trajectories")
    stream = CollectorRegistry()
    stream.register(collector)
    return (
        sample_names(REGISTRY) | sample_names(own) | sample_names(stream) | sample_names(ApiMetrics.create().registry)
    )


def metric_names(expr: str) -> set[str]:
    """Identifiers in metric position: words not followed by `(` (functions), not after `by`/`without`
    lists, not label names inside braces, and not keywords."""
    expr = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # string literals
    expr = re.sub(r"\{[^}]*\}", "{}", expr)  # label matchers
    expr = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", expr)
    expr = re.sub(r"\[[^\]]*\]", "[]", expr)  # range durations
    words = [
        m.group()
        for m in re.finditer(r"[A-Za-z_:][A-Za-z0-9_:]*", expr)
        if not expr[m.end() :].lstrip().startswith("(")
    ]
    keywords = {"sum", "avg", "min", "max", "count", "and", "or", "unless", "bool", "offset"}
    return {w for w in words if w not in keywords and not re.fullmatch(r"\d+[smhdwy]?", w)}


def test_metric_name_extraction():
    assert metric_names(
        "histogram_quantile(0.95, sum by (le, env) (rate(omrl_envs_call_seconds_bucket"
        '{run=~"$run", op="step"}[$__rate_interval])))'
    ) == {"omrl_envs_call_seconds_bucket"}
    assert metric_names('max by (run) (a_b{x="1"}) - min by (run) (c_d)') == {"a_b", "c_d"}


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.name)
def test_every_queried_metric_is_defined_by_a_service(path, exported_series):
    unknown = {}
    for panel, target in targets(json.loads(path.read_text())):
        for name in metric_names(target["expr"]):
            if name in SCRAPE_SERIES or name.startswith(CLIENT_PREFIXES) or name in exported_series:
                continue
            if name.startswith("DCGM_") and name in dcgm_documented()[0]:  # NVIDIA's exporter, not ours
                continue
            unknown.setdefault(name, []).append(panel["title"])
    assert not unknown, f"metrics no service defines: {unknown}"


def test_the_run_variable_reads_a_scraped_label():
    for path, board in boards():
        run = next(v for v in board["templating"]["list"] if v["name"] == "run")
        assert re.fullmatch(r"label_values\(up, run\)", run["definition"]), path.name
        assert run["includeAll"] and run["allValue"] == ".*"


def test_the_catalogue_holds_each_services_metrics_and_nothing_invented(exported_series):
    for name in (
        "omrl_rollout_generated_tokens_total",
        "omrl_rollout_queue_depth",
        "omrl_envs_errors_total",
        "omrl_reward_component_score_bucket",
        "omrl_learner_loss",
        "omrl_learner_kl",
        "omrl_stream_lag",
        "omrl_stream_pending",
        "omrl_api_jobs",
        "omrl_api_request_seconds_count",
    ):
        assert name in exported_series, name
    assert "omrl_rollout_invented_total" not in exported_series
    # scores can be negative: the client exports no _sum for such histograms, so no panel may use one
    assert "omrl_reward_component_score_sum" not in exported_series
    assert "omrl_rollout_weight_update_seconds_sum" in exported_series


def test_dashboard_json_is_what_the_generator_writes():
    proc = subprocess.run(
        [sys.executable, "scripts/gen_dashboards.py", "--check"], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr


def queried_names() -> set[str]:
    return {name for _, board in boards() for _, target in targets(board) for name in metric_names(target["expr"])}


def test_the_dashboards_show_validation_importance_sampling_vllm_and_gpus():
    assert {
        "omrl_rollout_validation_success_rate",
        "omrl_learner_importance_weight_mean",
        "omrl_learner_importance_weight_capped_fraction",
        "omrl_learner_clip_fraction",
        "omrl_rollout_engine_kv_cache_usage",
        "omrl_rollout_engine_requests",
        "omrl_rollout_engine_prefix_cache_hits_total",
        "omrl_rollout_engine_prefix_cache_queries_total",
        "DCGM_FI_DEV_GPU_UTIL",
        "DCGM_FI_DEV_FB_USED",
    } <= queried_names()


def test_every_learner_metric_is_on_a_panel():
    """Each series the learner exports (services/learner/prometheus_metrics.py) is queried by some panel: a new
    learner gauge or counter fails here until a panel in scripts/gen_dashboards.py shows it."""
    import services.learner.prometheus_metrics  # noqa: F401  (registers the learner's metrics)

    learner = set()
    for family in REGISTRY.collect():
        if family.name.startswith("omrl_learner_"):
            learner.add(family.name + "_total" if family.type == "counter" else family.name)
    assert {"omrl_learner_filtered_groups_total", "omrl_learner_rollout_vetoed_sequence_fraction"} <= learner
    assert not learner - queried_names(), "learner metrics on no panel"


def gpu_targets() -> list[tuple[dict, dict]]:
    return [(panel, target) for _, board in boards() for panel, target in targets(board) if "DCGM_" in target["expr"]]


def test_gpu_panels_use_dcgm_exporters_documented_names_and_labels():
    names, labels = dcgm_documented()
    assert {"DCGM_FI_DEV_GPU_UTIL", "DCGM_FI_DEV_FB_USED", "DCGM_FI_DEV_FB_FREE"} <= names
    assert len(gpu_targets()) >= 3
    for panel, target in gpu_targets():
        used = {n for n in metric_names(target["expr"]) if n.startswith("DCGM_")}
        assert used and used <= names, (panel["title"], used - names)
        grouping = {
            label.strip()
            for group in re.findall(r"\b(?:by|on)\s*\(([^)]*)\)", target["expr"])
            for label in group.split(",")
            if label.strip()
        }
        assert grouping <= labels, (panel["title"], grouping - labels)
        assert set(re.findall(r"\{\{(\w+)\}\}", target["legendFormat"])) <= labels, panel["title"]


def test_gpu_panels_select_the_gpus_of_the_runs_pods(tmp_path):
    """promtool evaluates each GPU expression on synthetic series shaped like dcgm-exporter's (Kubernetes pod
    mapping) beside the run's own scrapes: only the GPUs of the selected run's pods come out, one series each."""
    gpu_labels = 'Hostname="node-1", UUID="GPU-{i}", device="nvidia{i}", modelName="NVIDIA H100", namespace="rl"'
    series = []
    for i, (pod, util, used, free, watts) in enumerate(
        [
            ("rl-rollout-0", 80, 60000, 20000, 500),
            ("rl-learner-0", 40, 30000, 50000, 300),
            ("other-job-0", 99, 1000, 79000, 100),
            ("", 0, 0, 80000, 60),
        ]
    ):
        labels = gpu_labels.format(i=i) + f', gpu="{i}", pod="{pod}", instance="dcgm:9400", job="dcgm-exporter"'
        for metric, value in (
            ("DCGM_FI_DEV_GPU_UTIL", util),
            ("DCGM_FI_DEV_FB_USED", used),
            ("DCGM_FI_DEV_FB_FREE", free),
            ("DCGM_FI_DEV_POWER_USAGE", watts),
        ):
            series.append({"series": f"{metric}{{{labels}}}", "values": f"{value}x5"})
    for job, pod, run in (
        ("rollout", "rl-rollout-0", "some-run"),
        ("rollout-metrics", "rl-rollout-0", "some-run"),
        ("learner", "rl-learner-0", "some-run"),
        ("learner", "other-job-0", "other-run"),
    ):
        series.append({"series": f'up{{job="{job}", namespace="rl", pod="{pod}", run="{run}"}}', "values": "1x5"})
    expected = {
        "DCGM_FI_DEV_GPU_UTIL": (80, 40),
        "DCGM_FI_DEV_FB_USED": (60000, 30000),
        "DCGM_FI_DEV_FB_USED / (DCGM_FI_DEV_FB_USED + DCGM_FI_DEV_FB_FREE)": (0.75, 0.375),
        "DCGM_FI_DEV_POWER_USAGE": (500, 300),
    }
    tests = []
    for panel, target in gpu_targets():
        inner = next(k for k in sorted(expected, key=len, reverse=True) if f"(({k})" in target["expr"])
        rollout, learner = expected[inner]
        tests.append(
            {
                "expr": grafana_free(target["expr"]),
                "eval_time": "4m",
                "exp_samples": [
                    {"labels": '{Hostname="node-1", gpu="0", pod="rl-rollout-0"}', "value": rollout},
                    {"labels": '{Hostname="node-1", gpu="1", pod="rl-learner-0"}', "value": learner},
                ],
            }
        )
    path = tmp_path / "gpu_test.yml"
    path.write_text(
        yaml.safe_dump(
            {
                "rule_files": [],
                "evaluation_interval": "1m",
                "tests": [{"interval": "1m", "input_series": series, "promql_expr_test": tests}],
            }
        )
    )
    proc = subprocess.run(["promtool", "test", "rules", str(path)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert len(tests) == len(gpu_targets()) == 4
