"""What the Helm chart (deploy/helm/openmanus-rl) renders: a run config the services accept, probes,
hardened pods, NetworkPolicies that allow exactly the calls the system makes, Redis bundled or external,
ServiceMonitor behind its flag, the dashboards as ConfigMaps, values checked by values.schema.json.
Rendered with the real helm binary (scripts/get_helm.sh); scripts/ci_deploy_checks.sh validates the
same renders against the Kubernetes schemas."""

from __future__ import annotations

import base64
import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from services.common.config import load_config
from services.common.cpu_budget import OPENMP_IDLE
from services.common.grpc_server import LIVENESS
from tests.support import redis_start_script
from tests.support.helm_chart import (
    CHART,
    GPU,
    ROOT,
    component_of,
    learner_job,
    main_container,
    objects,
    render,
    run_helm,
    workloads,
)

SERVICE_MODULES = {
    "envs": "services.envs",
    "reward": "services.reward",
    "rollout": "services.rollout",
    "learner": "services.learner",
    "jobs-api": "services.jobs",
}


def run_config_of(docs, component: str, tmp_path: Path):
    """The config the component's process would load: the ConfigMap file plus its --set arguments."""
    container = main_container(workloads(docs)[component])
    args = [a for a in [*container["command"], *container["args"]]]
    assert "--config=/etc/openmanus-rl/config.yaml" in args
    configmap = next(d for d in objects(docs, "ConfigMap").values() if component_of(d) == "config")
    path = tmp_path / f"{component}.yaml"
    path.write_text(configmap["data"]["config.yaml"])
    overrides = [a.split("=", 1)[1] for a in args if a.startswith("--set=")]
    return load_config(str(path), overrides)


@pytest.mark.parametrize("values", [(), GPU], ids=["default", "gpu"])
def test_every_service_loads_the_rendered_run_config(values, tmp_path):
    docs = render(*values)
    for component in ("envs", "reward", "rollout", "learner"):
        config = run_config_of(docs, component, tmp_path)
        assert config.env.address == "omrl-openmanus-rl-envs:50052"
        assert config.reward.address == "omrl-openmanus-rl-reward:50053"
        assert config.learner.checkpoint_dir.startswith("/data/checkpoints/")
        if component in ("rollout", "learner"):
            assert config.stream.redis_url == "redis://omrl-openmanus-rl-redis:6379/0"  # password: $REDIS_PASSWORD


def test_gpu_values_give_a_bf16_run_with_one_gpu_per_learner_process(tmp_path):
    docs = render(*GPU)
    config = run_config_of(docs, "learner", tmp_path)
    assert config.model.dtype == "bfloat16" and config.learner.device == "cuda"
    pods = workloads(docs)
    learner, rollout = main_container(pods["learner"]), main_container(pods["rollout"])
    assert learner["resources"]["limits"]["nvidia.com/gpu"] == config.learner.nproc == 8
    assert f"--nproc_per_node={config.learner.nproc}" in learner["command"]
    assert rollout["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert learner["image"].endswith("-cuda") and rollout["image"].endswith("-cuda")
    gpu_taint = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
    for component, pod in pods.items():  # GPU tolerations on the GPU pods only
        assert (gpu_taint in pod["spec"].get("tolerations", [])) == (component in ("rollout", "learner")), component


def test_learner_gpus_must_match_its_processes():
    proc = run_helm("template", "omrl", str(CHART), "--set", "learner.gpus=4")
    assert proc.returncode != 0
    assert "learner.gpus (4) must equal config.learner.nproc (1)" in proc.stderr


def test_multinode_learner_is_an_indexed_job_with_torchrun_rendezvous_on_pod_0():
    docs = render(*GPU, "--set", "learner.nodes=2")
    job = learner_job(docs)
    assert job["spec"]["completionMode"] == "Indexed" and job["spec"]["completions"] == 2
    pod = job["spec"]["template"]["spec"]
    headless = objects(docs, "Service")[pod["subdomain"]]
    assert headless["spec"]["clusterIP"] == "None"
    command = main_container(job["spec"]["template"])["command"]
    assert command[0] == "torchrun" and "--nnodes=2" in command
    assert "--node_rank=$(JOB_COMPLETION_INDEX)" in command
    assert f"--master_addr={job['metadata']['name']}-0.{pod['subdomain']}" in command  # pod 0's DNS name
    # pod 0 holds rank 0, the only metrics server: several pods get no probes
    assert "livenessProbe" not in main_container(job["spec"]["template"])


@pytest.mark.parametrize("values", [(), GPU], ids=["default", "gpu"])
def test_grpc_services_have_native_grpc_probes_and_rollout_a_long_startup(values):
    pods = workloads(render(*values))
    for component in ("envs", "reward", "rollout"):
        container = main_container(pods[component])
        port = next(p["containerPort"] for p in container["ports"] if p["name"] == "grpc")
        # ready: the whole server; alive (startup, liveness): LIVENESS, so a server waiting for weights is not killed
        assert container["readinessProbe"]["grpc"] == {"port": port}, component
        for probe in ("startupProbe", "livenessProbe"):
            assert container[probe]["grpc"] == {"port": port, "service": LIVENESS}, (component, probe)
    startup = main_container(pods["rollout"])["startupProbe"]
    budget_s = startup["periodSeconds"] * startup["failureThreshold"]
    assert budget_s >= (1200 if values else 900)  # model loading, and CUDA graph capture on GPU


@pytest.mark.parametrize("values", [(), GPU], ids=["default", "gpu"])
def test_pods_run_as_non_root_with_read_only_root_and_writable_scratch(values):
    docs = render(*values)
    pods = {**workloads(docs), **{component_of(d): d for d in docs if d["kind"] == "Pod"}}
    assert set(pods) == {"envs", "reward", "rollout", "learner", "redis", "jobs-api", "health-test"}
    for component, pod in pods.items():
        spec = pod["spec"]
        assert spec["securityContext"]["runAsNonRoot"] is True and spec["securityContext"]["runAsUser"] > 0
        for container in spec["containers"]:
            ctx = container["securityContext"]
            assert ctx["readOnlyRootFilesystem"] is True, component
            assert ctx["allowPrivilegeEscalation"] is False and ctx["capabilities"]["drop"] == ["ALL"]
            mounts = {m["mountPath"] for m in container.get("volumeMounts", [])}
            if component != "health-test":
                assert "/tmp" in mounts, component
        if component in ("rollout", "learner"):
            volumes = {v["name"]: v for v in spec["volumes"]}
            assert volumes["shm"]["emptyDir"]["medium"] == "Memory"
            assert {"/cache", "/dev/shm"} <= {m["mountPath"] for m in main_container(pod)["volumeMounts"]}


def test_services_start_their_own_module_with_their_ports():
    docs = render()
    for component, pod in workloads(docs).items():
        if component == "redis":
            continue
        container = main_container(pod)
        assert SERVICE_MODULES[component] in container["command"], component
        ports = {p["name"] for p in container["ports"]}
        assert ("metrics" in ports) or component == "jobs-api", component


def test_secrets_stay_out_of_pod_specs():
    docs = render("--set", "redis.auth.password=pa55word", "--set", "jobsApi.auth.token=t0ken")
    secrets = objects(docs, "Secret")
    assert secrets["omrl-openmanus-rl-redis"]["data"]["redis-password"] == "cGE1NXdvcmQ="
    assert secrets["omrl-openmanus-rl-jobs-api"]["data"]["api-token"] == "dDBrZW4="
    for doc in docs:
        if doc["kind"] != "Secret":
            text = json.dumps(doc)
            assert "pa55word" not in text and "t0ken" not in text, doc["metadata"]["name"]


def test_generated_redis_password_when_none_is_given():
    password = objects(render(), "Secret")["omrl-openmanus-rl-redis"]["data"]["redis-password"]
    import base64

    assert len(base64.b64decode(password)) == 32


def test_external_redis_replaces_the_bundled_one(tmp_path):
    docs = render(
        "--set",
        "redis.enabled=false",
        "--set",
        "externalRedis.host=cache.internal",
        "--set",
        "externalRedis.port=6380",
        "--set",
        "externalRedis.db=2",
        "--set",
        "externalRedis.existingSecret=shared-redis",
        "--set",
        "externalRedis.tls=true",
    )
    assert "redis" not in workloads(docs)
    assert not any(component_of(d) == "redis" for d in docs)
    config = run_config_of(docs, "rollout", tmp_path)
    assert config.stream.redis_url == "rediss://cache.internal:6380/2"
    env = {e["name"]: e for e in main_container(workloads(docs)["learner"])["env"]}
    assert env["REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"]["name"] == "shared-redis"


def test_external_redis_needs_a_host():
    proc = run_helm("template", "omrl", str(CHART), "--set", "redis.enabled=false")
    assert proc.returncode != 0 and "externalRedis.host is required" in proc.stderr


def test_service_monitor_only_behind_its_flag():
    assert not objects(render(), "ServiceMonitor")
    docs = render("--set", "metrics.serviceMonitor.enabled=true", "--set", "metrics.serviceMonitor.labels.release=kps")
    monitor = objects(docs, "ServiceMonitor")["omrl-openmanus-rl"]
    assert monitor["metadata"]["labels"]["release"] == "kps"
    assert monitor["spec"]["jobLabel"] == "app.kubernetes.io/component"
    endpoints = {e["port"]: e for e in monitor["spec"]["endpoints"]}
    assert endpoints["http"]["authorization"]["credentials"]["name"] == "omrl-openmanus-rl-jobs-api"
    assert all(e["relabelings"] == [{"targetLabel": "run", "replacement": "default"}] for e in endpoints.values())
    selected = set(monitor["spec"]["selector"]["matchExpressions"][0]["values"])
    assert monitor["spec"]["selector"]["matchExpressions"][1] == {
        "key": "openmanus-rl/peers",
        "operator": "DoesNotExist",
    }
    scraped = [
        s
        for s in objects(docs, "Service").values()
        if component_of(s) in selected and "openmanus-rl/peers" not in s["metadata"]["labels"]
    ]
    assert {component_of(s) for s in scraped} == selected
    for service in scraped:  # one scraped Service per component, each with a port an endpoint names
        assert {p["name"] for p in service["spec"]["ports"]} & set(endpoints), service["metadata"]["name"]


def test_dashboards_ship_as_configmaps_identical_to_the_json_files():
    docs = render()
    shipped = {}
    for cm in objects(docs, "ConfigMap").values():
        if component_of(cm) == "dashboards":
            assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
            shipped.update(cm["data"])
    files = {p.name: p.read_text() for p in (ROOT / "deploy/grafana/dashboards").glob("*.json")}
    assert set(shipped) == set(files)
    for name, text in files.items():
        assert json.loads(shipped[name]) == json.loads(text)
    assert not any(component_of(d) == "dashboards" for d in render("--set", "grafana.dashboards.enabled=false"))


# -- NetworkPolicies ---------------------------------------------------------------------------------
def _selects(selector: dict, labels: dict) -> bool:
    return all(labels.get(k) == v for k, v in (selector.get("matchLabels") or {}).items())


def _peer_matches(peer: dict, labels: dict, namespace: str) -> bool:
    if "namespaceSelector" in peer:
        namespace_ok = _selects(peer["namespaceSelector"], {"kubernetes.io/metadata.name": namespace})
    else:
        namespace_ok = namespace == "ml"  # the policy's own namespace
    return namespace_ok and _selects(peer.get("podSelector", {}), labels)


def _rule_allows(rules: list, peer_key: str, labels: dict, port: int | None, namespace: str = "ml") -> bool:
    for rule in rules:
        peers = rule.get(peer_key)
        if peers is not None and not any(_peer_matches(p, labels, namespace) for p in peers):
            continue
        ports = rule.get("ports")
        if ports and port is not None and not any(p.get("port") == port for p in ports):
            continue
        return True
    return False


def allowed(docs, src: str, dst: str, port: int, src_namespace: str = "ml") -> bool:
    """Whether the NetworkPolicies let a pod of component `src` (in `src_namespace`, with the labels of the
    release's pods) open `port` on a pod of `dst`."""
    pods = {c: p["metadata"]["labels"] for c, p in workloads(docs).items()}
    policies = list(objects(docs, "NetworkPolicy").values())
    ingress = [p for p in policies if _selects(p["spec"]["podSelector"], pods[dst])]
    egress = [p for p in policies if _selects(p["spec"]["podSelector"], pods[src])]
    ok_in = not ingress or any(
        _rule_allows(p["spec"].get("ingress", []), "from", pods[src], port, src_namespace) for p in ingress
    )
    ok_out = not egress or any(_rule_allows(p["spec"].get("egress", []), "to", pods[dst], port) for p in egress)
    return ok_in and ok_out


CALLS = {  # (caller, callee, port): what the system does
    ("rollout", "envs", 50052),
    ("rollout", "reward", 50053),
    ("rollout", "redis", 6379),
    ("learner", "rollout", 50051),
    ("learner", "redis", 6379),
    ("learner", "learner", 29500),
    ("jobs-api", "redis", 6379),
    ("envs", "envs", 50052),
}


def test_network_policies_allow_exactly_the_calls_the_system_makes():
    docs = render()
    components = ["envs", "reward", "rollout", "learner", "redis", "jobs-api"]
    ports = {"envs": 50052, "reward": 50053, "rollout": 50051, "learner": 29500, "redis": 6379, "jobs-api": 8080}
    every_pod_isolated = {
        component_of(p)
        for p in objects(docs, "NetworkPolicy").values()
        if set(p["spec"]["policyTypes"]) == {"Ingress", "Egress"}
    }
    assert every_pod_isolated == set(components)
    for src in components:
        for dst in components:
            port = ports[dst]
            if dst == "jobs-api":
                continue  # users call the API from anywhere (jobsApi.ingressFrom), components never do
            assert allowed(docs, src, dst, port) == ((src, dst, port) in CALLS), (src, dst, port)
            # a pod elsewhere that copies the labels gets nowhere: every peer names the release's namespace
            assert not allowed(docs, src, dst, port, src_namespace="elsewhere"), (src, dst, port)


def test_every_pod_peer_is_pinned_to_the_release_namespace():
    for policy in objects(render(), "NetworkPolicy").values():
        for rule in policy["spec"].get("ingress", []):
            for peer in rule.get("from", []):
                if "podSelector" in peer:
                    assert peer["namespaceSelector"] == {"matchLabels": {"kubernetes.io/metadata.name": "ml"}}


METRICS_PORTS = {"envs": 9102, "reward": 9103, "rollout": 9101, "learner": 9104}
MONITORING = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}


def metrics_rules(docs) -> dict[str, list]:
    policies = {component_of(p): p for p in objects(docs, "NetworkPolicy").values()}
    return {
        component: [r for r in policies[component]["spec"]["ingress"] if r.get("ports") == [{"port": port}]]
        for component, port in METRICS_PORTS.items()
    }


def test_metrics_ports_are_open_to_the_monitoring_namespace_only():
    docs = render()
    assert all(
        rules == [{"from": [MONITORING], "ports": [{"port": METRICS_PORTS[c]}]}]
        for c, rules in metrics_rules(docs).items()
    )
    assert objects(docs, "NetworkPolicy")["omrl-openmanus-rl-redis"]["spec"]["egress"] == []
    api = objects(docs, "NetworkPolicy")["omrl-openmanus-rl-jobs-api"]["spec"]["ingress"]
    assert api == [{"from": [{"namespaceSelector": {}}, MONITORING], "ports": [{"port": 8080}]}]
    extra = {"podSelector": {"matchLabels": {"app": "vmagent"}}}
    docs = render(
        "--set",
        "networkPolicy.monitoringNamespace=obs",
        "--set-json",
        f"networkPolicy.metricsFrom=[{json.dumps(extra)}]",
    )
    obs = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "obs"}}}
    assert all(rules[0]["from"] == [obs, extra] for rules in metrics_rules(docs).values())


def test_no_scrapers_means_no_metrics_rule_rather_than_an_open_one():
    docs = render("--set", "networkPolicy.monitoringNamespace=", "--set", "jobsApi.ingressFrom=null")
    assert all(rules == [] for rules in metrics_rules(docs).values())
    for policy in objects(docs, "NetworkPolicy").values():
        assert all(rule.get("from") for rule in policy["spec"].get("ingress", [])), policy["metadata"]["name"]


# -- values and their schema -------------------------------------------------------------------------
@pytest.mark.parametrize(
    "setting, field",
    [
        ("config.model.pth=x", "pth"),  # not a TrainConfig field
        ("config.rollout.group_size=0", "group_size"),  # TrainConfig range
        ("config.algorithm.loss_agg_mode=mean", "loss_agg_mode"),
        ("rollout.replica=2", "replica"),  # not a chart value
        ("rollout.flavor=rocm", "flavor"),
    ],
)
def test_schema_rejects_bad_values_naming_the_field(setting, field):
    proc = run_helm("lint", "--strict", str(CHART), "--set", setting)
    assert proc.returncode != 0, setting
    assert field in proc.stdout + proc.stderr, proc.stdout + proc.stderr


@pytest.mark.parametrize(
    "settings, path, detail",
    [
        (("config.algorithm.advantage=grpoo",), "/config/algorithm/advantage", "'grpo', 'opo', 'reinforce_plus_plus'"),
        (("config.env.name=corridorr",), "/config/env/name", "'corridor', 'crafting'"),
        (("config.env.options.lenght=5",), "/config/env/options", "'lenght' not allowed"),
        (("config.env.options.length=2",), "/config/env/options/length", "want 3"),  # corridor's range
        (("config.env.name=maze", "config.env.options.length=5"), "/config/env/options", "'length' not allowed"),
        (("config.rollout.action_parser=xml",), "/config/rollout/action_parser", "'xml_action'"),
        (("config.learner.weight_push=mpi",), "/config/learner/weight_push", "'grpc', 'nccl', 'none'"),
        (("config.reward.components.goal.params.wieght=2",), "/config/reward/components/goal/params", "'wieght'"),
        (("config.reward.components.goall.weight=2",), "/config/reward/components/goall", "missing property 'type'"),
    ],
    ids=lambda v: v[-1] if isinstance(v, tuple) else None,
)
def test_schema_rejects_unknown_plugins_and_their_options_at_render_time(settings, path, detail):
    args = [arg for setting in settings for arg in ("--set", setting)]
    proc = run_helm("template", "omrl", str(CHART), *args)
    assert proc.returncode != 0, settings
    errors = [line for line in proc.stderr.splitlines() if f"at '{path}'" in line]
    assert any(detail in error for error in errors), proc.stderr


def test_another_envs_options_and_reward_params_render_and_load(tmp_path):
    docs = render(
        "--set",
        "config.env.name=maze",
        "--set-json",
        'config.env.options={"size": 7, "wall_density": 0.3, "hint": false}',
        "--set",
        "config.reward.components.length_penalty.params.max_tokens=32",
    )
    config = run_config_of(docs, "envs", tmp_path)
    assert (config.env.name, config.env.options) == ("maze", {"size": 7, "wall_density": 0.3, "hint": False})
    assert config.reward.components["length_penalty"].params == {"max_tokens": 32}


def test_schema_generator_takes_plugins_of_an_image_of_your_own(tmp_path):
    (tmp_path / "omrl_schema_plugin.py").write_text(
        "from services.envs.base import EnvOptions, TextEnv\n"
        "from services.envs.registry import register_env\n"
        "from services.reward.base import RewardFunction\n"
        "from services.reward.registry import REWARDS\n"
        "class CoinOptions(EnvOptions):\n"
        "    flips: int = 3\n"
        "@register_env('coin')\n"
        "class Coin(TextEnv):\n"
        "    Options = CoinOptions\n"
        "@REWARDS.register('coin_bonus')\n"
        "class Bonus(RewardFunction):\n"
        "    def __init__(self, scale: float = 1.0):\n"
        "        self.scale = scale\n"
        "    def __call__(self, traj):\n"
        "        return self.scale\n"
    )
    out = tmp_path / "values.schema.json"
    proc = subprocess.run(
        [sys.executable, "scripts/gen_helm_schema.py", "--import", "omrl_schema_plugin", "--output", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)])},
    )
    assert proc.returncode == 0, proc.stderr
    defs = json.loads(out.read_text())["$defs"]
    assert "coin" in defs["EnvConfig"]["properties"]["name"]["enum"]
    (coin,) = [c for c in defs["EnvConfig"]["allOf"] if c["if"]["properties"]["name"]["const"] == "coin"]
    assert defs[coin["then"]["properties"]["options"]["$ref"].removeprefix("#/$defs/")]["properties"]["flips"]
    components = defs["RewardConfig"]["properties"]["components"]
    params = components["properties"]["coin_bonus"]["properties"]["params"]["$ref"].removeprefix("#/$defs/")
    assert set(defs[params]["properties"]) == {"scale"}
    (typed,) = [
        c for c in components["additionalProperties"]["anyOf"] if c["properties"]["type"] == {"const": "coin_bonus"}
    ]
    assert typed["properties"]["params"]["$ref"] == f"#/$defs/{params}"


def test_schema_is_generated_from_the_run_config_schema():
    proc = subprocess.run(
        [sys.executable, "scripts/gen_helm_schema.py", "--check"], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr


def undocumented_keys(path: Path) -> list[str]:
    """Mapping keys of a values file without a comment line right above them (list items are data)."""
    missing, list_indent = [], None
    lines = path.read_text().splitlines()
    for i, line in enumerate(lines):
        stripped = line.lstrip()
        if not stripped or stripped.startswith("#"):
            continue
        indent = len(line) - len(stripped)
        if list_indent is not None and indent > list_indent:
            continue
        list_indent = None
        if stripped.startswith("- "):
            list_indent = indent
            continue
        if re.match(r"[A-Za-z_][\w.-]*:", stripped):
            above = next((lines[j].strip() for j in range(i - 1, -1, -1) if lines[j].strip()), "")
            if not above.startswith("#"):
                missing.append(f"{path.name}:{i + 1}: {stripped}")
    return missing


@pytest.mark.parametrize("name", ["values.yaml", "values-gpu.yaml"])
def test_every_values_key_has_a_comment_above_it(name):
    assert undocumented_keys(CHART / name) == []


def test_the_comment_check_finds_an_undocumented_key(tmp_path):
    path = tmp_path / "values.yaml"
    path.write_text("# documented\na: 1\nb:\n  # fine\n  c: 2\n  d: 3\nlist:\n  - name: x\n    value: y\n")
    assert undocumented_keys(path) == ["values.yaml:3: b:", "values.yaml:6: d: 3", "values.yaml:7: list:"]


def test_env_replicas_know_each_others_direct_addresses():
    docs = render("--set", "envs.replicas=3")
    envs = objects(docs, "StatefulSet")["omrl-openmanus-rl-envs"]
    assert envs["spec"]["serviceName"] == "omrl-openmanus-rl-envs-peers"
    assert objects(docs, "Service")["omrl-openmanus-rl-envs-peers"]["spec"]["clusterIP"] == "None"
    args = main_container(envs["spec"]["template"])["args"]
    assert "--replica-id=$(POD_NAME)" in args
    assert "--advertise=$(POD_NAME).omrl-openmanus-rl-envs-peers:50052" in args
    assert [a for a in args if a.startswith("--peer=")] == [
        f"--peer=omrl-openmanus-rl-envs-{i}=omrl-openmanus-rl-envs-{i}.omrl-openmanus-rl-envs-peers:50052"
        for i in range(3)
    ]
    single = main_container(workloads(render())["envs"])["args"]
    assert not any(a.startswith(("--peer=", "--replica-id")) for a in single)


# -- the job API's rights, Redis, the weight-push token, bind addresses ---------------------------------
def launcher_calls(workload: str) -> set[tuple[str, str, str]]:
    """(api group, resource, verb) of every call the kubernetes launcher makes through a job's life."""
    from services.jobs.spec import JobSpec
    from services.launcher.k8s_objects import K8sOptions
    from services.launcher.kubernetes import KubernetesLauncher
    from tests.support.fake_kubernetes import FakeCluster

    cluster = FakeCluster()
    spec = JobSpec.model_validate({"model": {"path": "Qwen/Qwen2.5-0.5B"}})
    before_switch = None
    if workload == "JobSet":  # a job launched as a plain Job before the API was switched to JobSet
        options = K8sOptions(redis_password_secret="omrl-redis", workload="Job")
        before_switch = KubernetesLauncher(cluster.api_client(), options).start("job-old", spec)
        cluster.calls.clear()
    options = K8sOptions(redis_password_secret="omrl-redis", workload=workload)
    launcher = KubernetesLauncher(cluster.api_client(), options)
    if before_switch is not None:
        launcher.poll("job-old", before_switch)
        launcher.cancel("job-old", before_switch)
    handle = launcher.start("job-a", spec)
    launcher.start("job-a", spec)  # adopts its own objects (a restart between creating and recording)
    for name in handle["deployments"]:
        cluster.set_status("Deployment", name, {"availableReplicas": 1})
    ready = {"replicatedJobsStatus": [{"name": "learner", "ready": 1}, {"name": "rollout", "ready": 1}]}
    cluster.set_status(workload, handle["job"], ready if workload == "JobSet" else {"active": 1, "ready": 1})
    launcher.poll("job-a", handle)
    cluster.add_pod(
        "job-a-learner-0",
        {"app.kubernetes.io/instance": "job-a", "app.kubernetes.io/component": "learner"},
        {"phase": "Running"},
    )
    launcher.logs("job-a", handle, "learner", 10)
    done = "Completed" if workload == "JobSet" else "Complete"
    cluster.set_status(workload, handle["job"], {"conditions": [{"type": done, "status": "True"}]})
    assert launcher.poll("job-a", handle).state == "succeeded"  # releases the servers
    launcher.cancel("job-b", launcher.start("job-b", spec))
    verbs = {"POST": "create", "DELETE": "delete"}
    calls = set()
    for method, path in cluster.calls:
        parts = path.strip("/").split("/")
        group = "" if parts[0] == "api" else parts[1]
        rest = parts[parts.index("namespaces") + 2 :]
        resource = rest[0] + ("/log" if rest[-1] == "log" else "")
        verb = verbs.get(method) or ("get" if len(rest) > 1 else "list")
        calls.add((group, resource, verb))
    return calls


@pytest.mark.parametrize(
    "workload, values",
    [
        ("Job", ()),
        ("JobSet", ("--set", "jobsApi.jobWorkload=JobSet")),
        ("JobSet", ("--set", "learner.workload=JobSet")),
    ],
    ids=["job", "jobset", "jobset-like-the-learner"],
)
def test_the_job_apis_role_grants_exactly_the_calls_its_launcher_makes(workload, values):
    docs = render(*values)
    env = {e["name"]: e.get("value") for e in main_container(workloads(docs)["jobs-api"])["env"]}
    assert env["OMRL_API_K8S_WORKLOAD"] == workload
    role = objects(docs, "Role")["omrl-openmanus-rl-jobs-api"]
    granted = {
        (group, resource, verb)
        for rule in role["rules"]
        for group in rule["apiGroups"]
        for resource in rule["resources"]
        for verb in rule["verbs"]
    }
    assert granted == launcher_calls(workload)
    assert not {verb for _, _, verb in granted} & {"update", "patch", "watch", "deletecollection", "*"}


def redis_container(docs) -> dict:
    return main_container(objects(docs, "StatefulSet")["omrl-openmanus-rl-redis"]["spec"]["template"])


@pytest.mark.parametrize("values", [(), GPU], ids=["default", "gpu"])
def test_no_container_has_the_redis_password_on_its_command_line(values):
    docs = render("--set", "redis.auth.password=pa55word", *values)
    for pod in workloads(docs).values():
        for container in pod["spec"]["containers"] + pod["spec"].get("initContainers", []):
            line = " ".join([*container.get("command", []), *container.get("args", [])])
            assert "pa55word" not in line and "--requirepass" not in line
            assert "$(REDIS_PASSWORD)" not in line and "redis_url" not in line, line
    for component in ("rollout", "learner", "jobs-api"):  # the ones that use Redis get it from the Secret
        env = {e["name"]: e for e in main_container(workloads(docs)[component])["env"]}
        assert env["REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"] == {
            "name": "omrl-openmanus-rl-redis",
            "key": "redis-password",
        }, component
        assert all("REDIS_PASSWORD" not in str(e.get("value", "")) for e in env.values()), component
    assert "exec redis-server - <<EOF" in redis_container(docs)["args"][0]  # config from stdin, not argv


def test_redis_keeps_an_append_only_file_on_a_claim_by_default():
    docs = render()
    script = redis_container(docs)["args"][0]
    assert "appendonly yes" in script and "appendfsync everysec" in script and "dir /data" in script
    claim = objects(docs, "StatefulSet")["omrl-openmanus-rl-redis"]["spec"]["volumeClaimTemplates"][0]
    assert claim["metadata"]["name"] == "data" and claim["spec"]["resources"]["requests"]["storage"] == "8Gi"
    off = render("--set", "redis.persistence.enabled=false")
    assert "appendonly no" in redis_container(off)["args"][0]
    assert "volumeClaimTemplates" not in objects(off, "StatefulSet")["omrl-openmanus-rl-redis"]["spec"]


@pytest.mark.skipif(not redis_start_script.AVAILABLE, reason="needs redis-server and redis-cli")
def test_the_redis_start_script_takes_any_password_and_keeps_it_off_argv(tmp_path):
    started = redis_start_script.start(redis_container(render())["args"][0], tmp_path)
    assert started.authed_ping == "PONG" and "NOAUTH" in started.unauthed_ping
    assert redis_start_script.PASSWORD not in started.argv and started.appendonly == "yes"


def test_rollout_and_learner_get_the_weight_push_token_from_a_generated_secret():
    docs = render()
    secret = objects(docs, "Secret")["omrl-openmanus-rl-weight-token"]
    assert len(base64.b64decode(secret["data"]["weight-token"])) == 48
    pods = workloads(docs)
    for component in ("rollout", "learner"):
        env = {e["name"]: e for e in main_container(pods[component])["env"]}
        assert env["OMRL_WEIGHT_TOKEN"]["valueFrom"]["secretKeyRef"] == {
            "name": "omrl-openmanus-rl-weight-token",
            "key": "weight-token",
        }
    for component in ("envs", "reward", "jobs-api", "redis"):
        assert "OMRL_WEIGHT_TOKEN" not in {e["name"] for e in main_container(pods[component]).get("env", [])}
    own = render("--set", "weightPush.existingSecret=mine", "--set", "weightPush.existingSecretKey=t")
    assert "omrl-openmanus-rl-weight-token" not in objects(own, "Secret")
    env = {e["name"]: e for e in main_container(workloads(own)["rollout"])["env"]}
    assert env["OMRL_WEIGHT_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": "mine", "key": "t"}


@pytest.mark.parametrize("values", [(), GPU], ids=["default", "gpu"])
def test_every_service_container_binds_all_addresses(values):
    for component, pod in workloads(render(*values)).items():
        if component != "redis":
            env = {e["name"]: e.get("value") for e in main_container(pod)["env"]}
            assert env["OMRL_BIND_HOST"] == "0.0.0.0", component
            assert env["GOMP_SPINCOUNT"] == OPENMP_IDLE["GOMP_SPINCOUNT"], component


def test_the_job_api_gives_its_jobs_policies_like_the_charts_and_confines_their_paths():
    env = {e["name"]: e.get("value") for e in main_container(workloads(render())["jobs-api"])["env"]}
    assert env["OMRL_API_K8S_NETWORK_POLICIES"] == "true"
    assert env["OMRL_API_K8S_MONITORING_NAMESPACE"] == "monitoring"
    assert json.loads(env["OMRL_API_ALLOWED_DATA_ROOTS"]) == ["/data"]


def test_the_job_apis_spec_policy_values_reach_its_settings(monkeypatch, tmp_path):
    from services.jobs.settings import JobsSettings
    from services.jobs.spec_policy import SpecPolicy

    recycle = "kubectl rollout restart statefulset/webshop"
    for values, expected in [
        ((), {"allowed_env_hosts": [], "env_options": {}, "extra_engine_args": [], "allowed_images": []}),
        (
            (
                "--set",
                "jobsApi.specPolicy.allowedEnvHosts={webshop:3000}",
                "--set-json",
                f'jobsApi.specPolicy.envOptions={{"agentgym": {{"recycle_command": "{recycle}"}}}}',
                "--set",
                "jobsApi.specPolicy.extraEngineArgs={enable_expert_parallel}",
                "--set",
                "jobsApi.specPolicy.allowedImages={reg.io/omrl/custom:1}",
                "--set",
                "jobsApi.specPolicy.allowedVolumeClaims={omrl-data}",
            ),
            {
                "allowed_env_hosts": ["webshop:3000"],
                "env_options": {"agentgym": {"recycle_command": recycle}},
                "extra_engine_args": ["enable_expert_parallel"],
                "allowed_volume_claims": ["omrl-data"],
            },
        ),
    ]:
        env = {
            e["name"]: e["value"] for e in main_container(workloads(render(*values))["jobs-api"])["env"] if "value" in e
        }
        for name, value in env.items():
            if name.startswith("OMRL_API_") and not name.startswith(("OMRL_API_K8S_", "OMRL_API_TOKEN", "OMRL_API_DB")):
                monkeypatch.setenv(name, value)
        settings = JobsSettings(token="t", output_dir=tmp_path)
        assert {k: getattr(settings, k) for k in expected} == expected
        assert SpecPolicy.from_settings(settings)  # the deployment's values pass the policy's own checks


def test_nccl_weight_push_opens_the_learner_and_rollout_pods_to_each_other(tmp_path):
    """`weight_push: nccl`: the rollout servers reach rank 0's rendezvous store through a Service of the
    learner's pod 0 (the run config names it), and NCCL/gloo connect both ways on ephemeral ports; the
    socket interface reaches both pods. Without it the policies stay as narrow as before."""
    docs = render("--set", "config.learner.weight_push=nccl", "--set", "weightPush.socketIfname=eth0")
    config = run_config_of(docs, "learner", tmp_path)
    service = objects(docs, "Service")[config.learner.weight_nccl_host]
    assert service["spec"]["selector"]["batch.kubernetes.io/job-completion-index"] == "0"
    assert service["spec"]["ports"] == [{"name": "weight-sync", "port": 29600, "targetPort": "weight-sync"}]
    learner = main_container(workloads(docs)["learner"])
    assert {"name": "weight-sync", "containerPort": 29600} in learner["ports"]
    for component in ("learner", "rollout"):
        env = {e["name"]: e.get("value") for e in main_container(workloads(docs)[component])["env"]}
        assert env["NCCL_SOCKET_IFNAME"] == env["GLOO_SOCKET_IFNAME"] == "eth0"
    for port in (29600, 41234):  # the store, then an ephemeral NCCL/gloo port
        assert allowed(docs, "rollout", "learner", port) and allowed(docs, "learner", "rollout", port)
    plain = render()
    assert not allowed(plain, "rollout", "learner", 29600) and not allowed(plain, "learner", "rollout", 41234)


def test_nccl_weight_push_values_under_their_old_names_still_work(tmp_path):
    """`weight_dist_port`/`weight_dist_host`, the old names of `weight_nccl_port`/`weight_nccl_host`: the chart
    reads them (the Service's port; a host given is kept), the services load them; both names are refused."""
    nccl = ("--set", "config.learner.weight_push=nccl")
    docs = render(*nccl, "--set", "config.learner.weight_dist_port=29700")
    config = run_config_of(docs, "learner", tmp_path)
    assert config.learner.weight_nccl_port == 29700
    service = objects(docs, "Service")[config.learner.weight_nccl_host]
    assert service["spec"]["ports"] == [{"name": "weight-sync", "port": 29700, "targetPort": "weight-sync"}]
    config = run_config_of(
        render(*nccl, "--set", "config.learner.weight_dist_host=learner.example"), "learner", tmp_path
    )
    assert config.learner.weight_nccl_host == "learner.example"
    both = ("--set", "config.learner.weight_dist_port=29700", "--set", "config.learner.weight_nccl_port=29700")
    proc = run_helm("template", "omrl", str(CHART), *nccl, *both)
    assert proc.returncode != 0 and re.search(r"config[./]learner", proc.stderr), proc.stderr


# -- reward servers (reward.servers): a reward model or a judge on pods of their own ----------------------
JUDGE = {"model": "/models/judge", "policy_tokenizer": "/models/policy", "prompt": "Solved? {conversation}"}
SERVERS = (
    "--set-json",
    "reward.servers="
    + json.dumps(
        {
            "rm": {"components": {"reward_model": {"params": {"path": "/models/rm"}}}, "gpus": 1, "replicas": 2},
            "prm": {"components": {"reward_model": {"params": {"path": "/models/prm"}}}},
            "judge": {
                "components": {"llm_judge": {"params": {**JUDGE, "timeout_s": 10}}},
                "image": {"component": "rollout"},
            },
        }
    ),
    "--set-json",
    'config.reward.components={"goal": {"weight": 1.0}}',
    "--set",
    "reward.serversWeight=2",
    "--set",
    "reward.serversTimeoutSeconds=15",
    "--set",
    "modelVolume.persistentVolumeClaim.claimName=models",
)
SERVER_ADDRESSES = {name: f"omrl-openmanus-rl-reward-{name}:50053" for name in ("rm", "prm", "judge")}
SERVER_MODELS = {"rm": ("reward_model", "path"), "prm": ("reward_model", "path"), "judge": ("llm_judge", "model")}


def server_config_of(docs, component: str, tmp_path: Path):
    """The config a reward server loads: the ConfigMap file its --config names."""
    args = main_container(workloads(docs)[component])["args"]
    (name,) = [a.removeprefix("--config=/etc/openmanus-rl/") for a in args if a.startswith("--config=")]
    configmap = next(d for d in objects(docs, "ConfigMap").values() if component_of(d) == "config")
    path = tmp_path / name
    path.write_text(configmap["data"][name])
    return load_config(str(path))


def test_each_reward_server_is_a_deployment_and_service_the_reward_service_reaches_through_remote(tmp_path):
    docs = render(*SERVERS)
    main = run_config_of(docs, "reward", tmp_path).reward.components
    assert set(main) == {"goal", "remote"}
    assert main["remote"].weight == 2 and main["remote"].params == {"servers": SERVER_ADDRESSES, "timeout_s": 15}
    services = objects(docs, "Service")
    for name, address in SERVER_ADDRESSES.items():
        component = f"reward-{name}"
        service = services[address.split(":")[0]]
        assert service["spec"]["selector"]["app.kubernetes.io/component"] == component
        assert {p["name"]: p["port"] for p in service["spec"]["ports"]} == {"grpc": 50053, "metrics": 9103}
        config = server_config_of(docs, component, tmp_path)
        assert config.reward.address == address and config.reward.timeout_s == 15
        function, model_param = SERVER_MODELS[name]
        assert list(config.reward.components) == [function]
        assert config.reward.components[function].params[model_param] == f"/models/{name}"
        container = main_container(workloads(docs)[component])
        assert container["command"] == ["python", "-m", "services.reward"]
        assert container["readinessProbe"]["grpc"] == {"port": 50053}
        for probe in ("startupProbe", "livenessProbe"):
            assert container[probe]["grpc"] == {"port": 50053, "service": LIVENESS}
        assert container["startupProbe"]["periodSeconds"] * container["startupProbe"]["failureThreshold"] >= 900
        mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
        assert mounts["/models"]["readOnly"] and {"/cache", "/dev/shm"} <= set(mounts)
        assert container["securityContext"]["readOnlyRootFilesystem"]
        volumes = {v["name"]: v for v in workloads(docs)[component]["spec"]["volumes"]}
        assert volumes["models"]["persistentVolumeClaim"] == {"claimName": "models"}


def test_gpu_servers_request_gpus_on_the_cuda_rollout_image_cpu_ones_the_reward_image_a_judge_the_rollout_one():
    deployments = objects(render(*SERVERS), "Deployment")
    pods = {name: deployments[f"omrl-openmanus-rl-reward-{name}"] for name in SERVER_ADDRESSES}
    assert {name: d["spec"]["replicas"] for name, d in pods.items()} == {"rm": 2, "prm": 1, "judge": 1}
    containers = {name: main_container(d["spec"]["template"]) for name, d in pods.items()}
    images = {name: c["image"].rsplit("/", 1)[1] for name, c in containers.items()}
    assert images == {"rm": "rollout:0.1.0-cuda", "prm": "reward:0.1.0-cpu", "judge": "rollout:0.1.0-cpu"}
    gpus = {name: c["resources"].get("limits", {}).get("nvidia.com/gpu", 0) for name, c in containers.items()}
    assert gpus == {"rm": 1, "prm": 0, "judge": 0}
    assert pods["rm"]["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 0, "maxUnavailable": 1}  # no spare GPU
    assert "strategy" not in pods["prm"]["spec"]
    tolerations = {c: p["spec"].get("tolerations", []) for c, p in workloads(render(*SERVERS, *GPU)).items()}
    assert tolerations["reward-rm"] and not tolerations["reward-prm"] and not tolerations["reward"]


def test_only_the_reward_service_reaches_the_reward_servers_and_they_are_scraped_and_health_checked():
    docs = render(*SERVERS, "--set", "metrics.serviceMonitor.enabled=true")
    for server in (f"reward-{name}" for name in SERVER_ADDRESSES):
        for caller in ("envs", "reward", "rollout", "learner", "redis", "jobs-api"):
            assert allowed(docs, caller, server, 50053) == (caller == "reward"), (caller, server)
            assert not allowed(docs, server, caller, 50053), (server, caller)
        assert not allowed(docs, "reward", server, 50053, src_namespace="elsewhere")
    monitor = objects(docs, "ServiceMonitor")["omrl-openmanus-rl"]
    assert {f"reward-{name}" for name in SERVER_ADDRESSES} <= set(
        monitor["spec"]["selector"]["matchExpressions"][0]["values"]
    )
    health = next(d for d in docs if d["kind"] == "Pod" and component_of(d) == "health-test")
    script = main_container(health)["args"][0]
    assert all(f"services.common.healthcheck {address};" in script for address in SERVER_ADDRESSES.values())
    assert not any(component_of(d).startswith("reward-") for d in render() if "labels" in d["metadata"])


@pytest.mark.parametrize(
    "settings, error",
    [
        (
            (
                "--set",
                "reward.servers.rm.components.reward_model.params.path=/m",
                "--set",
                "reward.servers.rm.flavor=cpu",
                "--set",
                "reward.servers.rm.gpus=1",
            ),
            "reward.servers.rm: 1 GPUs need flavor cuda",
        ),
        (
            (
                "--set",
                "reward.servers.rm.components.reward_model.params.path=/m",
                "--set",
                "config.reward.components.remote.params.servers.x=a:1",
            ),
            "comes from reward.servers",
        ),
        (("--set", "reward.servers.RM.components.goal.weight=1"), "RM"),
        (("--set", "reward.servers.rm.components.reward_modle.weight=1"), "reward_modle"),
        (("--set", "reward.servers.rm.gpus=1"), "components"),
    ],
    ids=["gpus-on-cpu", "remote-twice", "bad-name", "unknown-component", "no-components"],
)
def test_bad_reward_server_values_fail_the_render_naming_the_problem(settings, error):
    proc = run_helm("template", "omrl", str(CHART), *settings)
    assert proc.returncode != 0 and error in proc.stderr, proc.stderr


# -- the python toolset's sandbox server (sandbox.enabled) --------------------------------------------------------
SANDBOX = ("--set", "sandbox.enabled=true")
SANDBOX_URL = "http://omrl-openmanus-rl-sandbox:8090"
TOOLS = (
    "--set-json",
    "config.env.tools="
    + json.dumps(
        {
            "python": {"type": "python"},
            "py_wide": {"type": "python", "options": {"max_concurrent": 2}},
            "py_elsewhere": {"type": "python", "options": {"endpoint": "http://sandbox.example:8090"}},
            "calc": {"type": "calculator"},
        }
    ),
)


def sandbox_objects(docs) -> dict[str, dict]:
    return {d["kind"]: d for d in docs if component_of(d) == "sandbox"}


def env_of(pod: dict) -> dict[str, dict]:
    return {e["name"]: e for e in main_container(pod)["env"]}


def test_the_sandbox_is_off_by_default_and_leaves_the_env_pods_and_toolsets_alone(tmp_path):
    docs = render(*TOOLS)
    assert sandbox_objects(docs) == {}
    assert "OMRL_SANDBOX_TOKEN" not in env_of(workloads(docs)["envs"])
    tools = run_config_of(docs, "envs", tmp_path).env.tools
    assert tools["python"].options == {} and tools["py_wide"].options == {"max_concurrent": 2}
    health = next(d for d in docs if d["kind"] == "Pod" and component_of(d) == "health-test")
    assert "sandbox" not in main_container(health)["args"][0]


def test_the_sandbox_is_a_deployment_and_service_on_its_port_probed_on_healthz_with_the_shared_timings():
    docs = render(*SANDBOX, "--set", "sandbox.replicas=2", "--set-json", 'sandbox.options={"cpu_s": 4}')
    found = sandbox_objects(docs)
    assert set(found) == {"Deployment", "Service", "Secret", "NetworkPolicy"}
    deployment, service = found["Deployment"], found["Service"]
    assert deployment["metadata"]["name"] == service["metadata"]["name"] == "omrl-openmanus-rl-sandbox"
    assert deployment["spec"]["replicas"] == 2
    container = main_container(deployment["spec"]["template"])
    assert container["command"] == ["python", "-m", "services.envs.sandbox_server"]
    assert container["image"] == main_container(workloads(docs)["envs"])["image"]  # bubblewrap and fastapi are there
    args = container["args"]
    assert "--port=8090" in args and '--options={"cpu_s":4}' in args
    assert "--workspace-root=/workspaces/episodes" in args and "--workspace-ttl-s=3600" in args
    assert {"name": "http", "containerPort": 8090} in container["ports"]
    timings = yaml.safe_load((CHART / "values.yaml").read_text())["probes"]
    for probe in ("startup", "readiness", "liveness"):
        spec = container[f"{probe}Probe"]
        assert spec["httpGet"] == {"path": "/healthz", "port": "http"}, probe
        assert spec["periodSeconds"] == timings[probe]["periodSeconds"], probe
        assert spec["timeoutSeconds"] == timings["timeoutSeconds"], probe
    assert env_of(deployment["spec"]["template"])["OMRL_BIND_HOST"]["value"] == "0.0.0.0"
    assert service["spec"]["type"] == "ClusterIP" and service["spec"]["sessionAffinity"] == "ClientIP"
    assert service["spec"]["ports"] == [{"name": "http", "port": 8090, "targetPort": "http", "appProtocol": "http"}]
    assert service["spec"]["selector"] == deployment["spec"]["selector"]["matchLabels"]
    health = next(d for d in docs if d["kind"] == "Pod" and component_of(d) == "health-test")
    assert f"services.common.healthcheck {SANDBOX_URL}/healthz;" in main_container(health)["args"][0]


def test_the_env_pods_get_the_sandbox_token_from_the_servers_secret():
    docs = render(*SANDBOX)
    secret = objects(docs, "Secret")["omrl-openmanus-rl-sandbox-token"]
    assert len(base64.b64decode(secret["data"]["sandbox-token"])) == 48
    ref = {"name": "omrl-openmanus-rl-sandbox-token", "key": "sandbox-token"}
    pods = workloads(docs)
    for component in ("sandbox", "envs"):
        assert env_of(pods[component])["OMRL_SANDBOX_TOKEN"]["valueFrom"]["secretKeyRef"] == ref, component
    for component in ("reward", "rollout", "learner", "jobs-api", "redis"):
        assert "OMRL_SANDBOX_TOKEN" not in {e["name"] for e in main_container(pods[component]).get("env", [])}
    own = render(*SANDBOX, "--set", "sandbox.auth.existingSecret=mine", "--set", "sandbox.auth.existingSecretKey=t")
    assert "omrl-openmanus-rl-sandbox-token" not in objects(own, "Secret")
    for component in ("sandbox", "envs"):
        assert env_of(workloads(own)[component])["OMRL_SANDBOX_TOKEN"]["valueFrom"]["secretKeyRef"] == {
            "name": "mine",
            "key": "t",
        }


def test_python_toolsets_without_an_endpoint_run_on_the_sandbox_with_its_options(tmp_path):
    docs = render(*SANDBOX, *TOOLS, "--set-json", 'sandbox.options={"cpu_s": 4, "memory_mb": 512}')
    tools = run_config_of(docs, "envs", tmp_path).env.tools  # the services' own config checks pass
    assert tools["python"].options == {"endpoint": SANDBOX_URL, "cpu_s": 4, "memory_mb": 512}
    assert tools["py_wide"].options == {"endpoint": SANDBOX_URL, "cpu_s": 4, "memory_mb": 512, "max_concurrent": 2}
    assert tools["py_elsewhere"].options == {"endpoint": "http://sandbox.example:8090"}
    assert tools["calc"].options == {}


@pytest.mark.parametrize(
    "settings, error",
    [
        (
            ("--set", "config.env.tools.py.type=python", "--set", "config.env.tools.py.options.cpu_s=3"),
            "config.env.tools.py.options.cpu_s: this toolset runs on the sandbox server",
        ),
        (("--set", "sandbox.hostUsers=true"), "sandbox.procMount Unmasked needs sandbox.hostUsers false"),
        (("--set", "sandbox.options.endpoint=http://x"), "additional properties 'endpoint' not allowed"),
        (("--set", "sandbox.options.cpu_s=0"), "/sandbox/options/cpu_s"),
        (("--set", "sandbox.seccompProfile.type=Localhost"), "missing property 'localhostProfile'"),
        (("--set", "sandbox.procMount=Masked"), "/sandbox/procMount"),
    ],
    ids=[
        "toolset-limit",
        "unmasked-host-users",
        "server-endpoint",
        "options-range",
        "localhost-no-profile",
        "procmount",
    ],
)
def test_bad_sandbox_values_fail_the_render_naming_the_problem(settings, error):
    proc = run_helm("template", "omrl", str(CHART), *SANDBOX, *settings)
    assert proc.returncode != 0 and error in proc.stderr, proc.stderr


def sandbox_pod(*values: str, kube: str = "1.35.0") -> dict:
    return workloads(render(*SANDBOX, "--kube-version", kube, *values))["sandbox"]


def test_the_sandbox_pod_may_create_namespaces_for_bubblewrap_and_nothing_more():
    """Unconfined seccomp and AppArmor (the runtimes' default profiles refuse unshare and mount) and an unmasked /proc
    (a PID namespace's /proc cannot be mounted over runc's masked one), which the API server takes only with a user
    namespace of the pod's own; otherwise the chart's hardening: non-root, no capabilities, no privilege escalation,
    read-only root, no service-account token."""
    pod = sandbox_pod()
    spec, container = pod["spec"], main_container(pod)
    assert spec["hostUsers"] is False and spec["automountServiceAccountToken"] is False
    assert spec["securityContext"]["runAsNonRoot"] is True and spec["securityContext"]["runAsUser"] > 0
    assert spec["securityContext"]["seccompProfile"] == {"type": "Unconfined"}
    assert "runtimeClassName" not in spec
    ctx = container["securityContext"]
    assert ctx["procMount"] == "Unmasked" and ctx["appArmorProfile"] == {"type": "Unconfined"}
    assert ctx["allowPrivilegeEscalation"] is False and ctx["capabilities"] == {"drop": ["ALL"]}
    assert ctx["readOnlyRootFilesystem"] is True and "privileged" not in ctx
    volumes = {v["name"]: v for v in spec["volumes"]}
    assert volumes["workspaces"] == {"name": "workspaces", "emptyDir": {"sizeLimit": "1Gi"}}
    assert {m["mountPath"] for m in container["volumeMounts"]} == {"/tmp", "/workspaces"}
    assert "annotations" not in pod["metadata"]
    # before 1.30 AppArmor is an annotation; a Localhost profile is named the same way
    old = sandbox_pod(kube="1.27.0")
    assert "appArmorProfile" not in main_container(old)["securityContext"]
    assert old["metadata"]["annotations"] == {"container.apparmor.security.beta.kubernetes.io/sandbox": "unconfined"}
    mine = (
        "--set",
        "sandbox.appArmorProfile.type=Localhost",
        "--set",
        "sandbox.appArmorProfile.localhostProfile=bwrap",
    )
    assert sandbox_pod(*mine, kube="1.27.0")["metadata"]["annotations"] == {
        "container.apparmor.security.beta.kubernetes.io/sandbox": "localhost/bwrap"
    }
    assert main_container(sandbox_pod(*mine))["securityContext"]["appArmorProfile"] == {
        "type": "Localhost",
        "localhostProfile": "bwrap",
    }


def test_the_sandbox_takes_a_runtime_class_such_as_gvisor():
    pod = sandbox_pod(
        "--set",
        "sandbox.runtimeClassName=gvisor",
        "--set",
        "sandbox.procMount=Default",
        "--set",
        "sandbox.hostUsers=true",
        "--set",
        "sandbox.options.isolation=none",
    )
    assert pod["spec"]["runtimeClassName"] == "gvisor" and "hostUsers" not in pod["spec"]
    assert main_container(pod)["securityContext"]["procMount"] == "Default"
    assert '--options={"isolation":"none"}' in main_container(pod)["args"]


@pytest.mark.parametrize("kube", ["1.27.0", "1.35.0"])
def test_the_sandbox_objects_are_valid_kubernetes_objects_of_the_oldest_and_newest_version(kube):
    spec = importlib.util.spec_from_file_location("check_manifests", ROOT / "scripts/check_manifests.py")
    check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(check)
    docs = render(*SANDBOX, *TOOLS, "--kube-version", kube)
    chosen = [d for d in docs if component_of(d) in ("sandbox", "envs")]
    assert {d["kind"] for d in chosen} >= {"Deployment", "Service", "Secret", "NetworkPolicy", "StatefulSet"}
    assert check.check_documents(chosen, kube) == []


def test_only_the_env_pods_reach_the_sandbox_and_it_reaches_nothing():
    docs = render(*SANDBOX)
    policy = objects(docs, "NetworkPolicy")["omrl-openmanus-rl-sandbox"]
    assert set(policy["spec"]["policyTypes"]) == {"Ingress", "Egress"} and policy["spec"]["egress"] == []
    for caller in ("envs", "reward", "rollout", "learner", "redis", "jobs-api"):
        assert allowed(docs, caller, "sandbox", 8090) == (caller == "envs"), caller
        assert not allowed(docs, "sandbox", caller, 50052), caller
    assert not allowed(docs, "envs", "sandbox", 8090, src_namespace="elsewhere")
    assert not allowed(docs, "envs", "sandbox", 9102)
    plain = objects(render(), "NetworkPolicy")["omrl-openmanus-rl-envs"]["spec"]["egress"]
    assert not any("sandbox" in json.dumps(rule) for rule in plain)
    assert "omrl-openmanus-rl-sandbox" not in objects(
        render(*SANDBOX, "--set", "networkPolicy.enabled=false"), "NetworkPolicy"
    )
