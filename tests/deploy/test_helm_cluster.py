"""What the chart renders for a real GPU cluster: GPU settings on the GPU pods only (resource name, MIG,
RuntimeClass, tolerations, node labels), a rollout pod's GPUs as its engine's tensor-parallel size, the
services' log format, the learner's probes and deadline, datasets and checkpoints on volumes, the alert rules
as a PrometheusRule, Kueue labels and the LocalQueue, and the learner with the rollout servers as one JobSet."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from services.common.config import load_config
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

GPU_TAINT = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
JOBSET = ("--set", "learner.workload=JobSet")
KUEUE = ("--set", "kueue.queueName=omrl-gpu")


def run_config(docs, tmp_path: Path):
    configmap = next(d for d in objects(docs, "ConfigMap").values() if component_of(d) == "config")
    path = tmp_path / "config.yaml"
    path.write_text(configmap["data"]["config.yaml"])
    return load_config(str(path))


def volumes(pod: dict) -> dict[str, dict]:
    return {v["name"]: v for v in pod["spec"]["volumes"]}


def mounts(pod: dict) -> dict[str, dict]:
    return {m["mountPath"]: m for m in main_container(pod)["volumeMounts"]}


# -- GPUs ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("workload", [(), JOBSET], ids=["job", "jobset"])
def test_gpu_tolerations_labels_and_runtime_class_reach_the_gpu_pods_only(workload):
    docs = render(
        *GPU,
        *workload,
        "--set",
        "gpu.nodeSelector.gpu-pool=a100",
        "--set",
        "gpu.runtimeClassName=nvidia",
        "--set",
        "nodeSelector.zone=z1",
    )
    pods = workloads(docs)
    assert set(pods) == {"envs", "reward", "rollout", "learner", "redis", "jobs-api"}
    for component, pod in pods.items():
        spec, gpu = pod["spec"], component in ("rollout", "learner")
        assert (GPU_TAINT in spec.get("tolerations", [])) == gpu, component
        assert spec.get("runtimeClassName") == ("nvidia" if gpu else None), component
        assert spec["nodeSelector"] == ({"zone": "z1", "gpu-pool": "a100"} if gpu else {"zone": "z1"}), component


def test_the_gpu_resource_name_is_configurable_per_component():
    docs = render(
        *GPU, "--set", "gpu.resourceName=nvidia.com/mig-3g.40gb", "--set", "learner.gpuResourceName=nvidia.com/gpu"
    )
    pods = workloads(docs)
    assert main_container(pods["rollout"])["resources"]["limits"]["nvidia.com/mig-3g.40gb"] == 1
    assert "nvidia.com/gpu" not in main_container(pods["rollout"])["resources"]["limits"]
    assert main_container(pods["learner"])["resources"]["limits"]["nvidia.com/gpu"] == 8
    for component in ("envs", "reward", "redis", "jobs-api"):
        limits = main_container(pods[component])["resources"].get("limits", {})
        assert not [k for k in limits if "gpu" in k], component


@pytest.mark.parametrize("workload", [(), JOBSET], ids=["job", "jobset"])
def test_the_rollout_engine_is_tensor_parallel_over_its_pods_gpus(workload, tmp_path):
    docs = render(*GPU, *workload, "--set", "rollout.gpus=4")
    assert run_config(docs, tmp_path).rollout.gpus == 4  # vLLM's tensor_parallel_size
    assert main_container(workloads(docs)["rollout"])["resources"]["limits"]["nvidia.com/gpu"] == 4
    assert (
        run_config(
            render(*GPU, *workload, "--set", "rollout.gpus=4", "--set", "config.rollout.gpus=4"), tmp_path
        ).rollout.gpus
        == 4
    )  # both set, agreeing
    assert run_config(render(*GPU), tmp_path).rollout.gpus == 1
    assert (
        "gpus"
        not in yaml.safe_load(
            next(d for d in objects(render(), "ConfigMap").values() if component_of(d) == "config")["data"][
                "config.yaml"
            ]
        )["rollout"]
    )


@pytest.mark.parametrize(
    "settings, message",
    [
        (
            ("rollout.gpus=2", "config.rollout.gpus=4"),
            (
                "rollout.gpus (2 GPUs per rollout pod) and config.rollout.gpus "
                "(4, vLLM's tensor-parallel size) disagree: set rollout.gpus only"
            ),
        ),
        (
            ("config.rollout.gpus=2",),
            "config.rollout.gpus (2) needs rollout.gpus = 2: tensor parallelism runs on GPU pods",
        ),
    ],
    ids=["disagree", "cpu-pods"],
)
def test_a_tensor_parallel_size_other_than_the_pods_gpus_is_refused_at_render_time(settings, message):
    proc = run_helm("template", "omrl", str(CHART), *[a for s in settings for a in ("--set", s)])
    assert proc.returncode != 0 and message in proc.stderr


def test_the_schema_refuses_a_gpu_resource_that_is_not_a_resource_name():
    proc = run_helm("lint", "--strict", str(CHART), "--set", "gpu.resourceName=gpu")
    assert proc.returncode != 0 and "resourceName" in proc.stdout + proc.stderr


def test_runtime_class_per_workload():
    pods = workloads(render("--set", "envs.runtimeClassName=gvisor"))
    assert {c: p["spec"].get("runtimeClassName") for c, p in pods.items() if p["spec"].get("runtimeClassName")} == {
        "envs": "gvisor"
    }


# -- logs ------------------------------------------------------------------------------------------------
def log_formats(docs) -> dict[str, str | None]:
    """component -> OMRL_LOG_FORMAT of its main container."""
    return {
        c: {e["name"]: e.get("value") for e in main_container(p).get("env", [])}.get("OMRL_LOG_FORMAT")
        for c, p in workloads(docs).items()
    }


@pytest.mark.parametrize("workload", [(), JOBSET], ids=["job", "jobset"])
def test_every_service_logs_in_the_charts_log_format(workload):
    services = {"envs", "reward", "rollout", "learner", "jobs-api"}
    formats = log_formats(render(*GPU, *workload))
    assert {c: f for c, f in formats.items() if c in services} == dict.fromkeys(services, "json")
    assert formats["redis"] is None  # the official Redis image: not one of our services
    text = log_formats(render(*GPU, *workload, "--set", "logFormat=text"))
    assert {c: f for c, f in text.items() if c in services} == dict.fromkeys(services, "text")


def test_the_schema_refuses_an_unknown_log_format():
    proc = run_helm("lint", "--strict", str(CHART), "--set", "logFormat=yaml")
    assert proc.returncode != 0 and "logFormat" in proc.stdout + proc.stderr


def test_jobs_the_api_launches_log_in_the_charts_format(monkeypatch):
    from services.jobs.spec import JobSpec
    from services.launcher.k8s_objects import JobObjects, K8sOptions

    api = main_container(workloads(render("--set", "logFormat=text"))["jobs-api"])
    monkeypatch.setenv("OMRL_LOG_FORMAT", {e["name"]: e.get("value") for e in api["env"]}["OMRL_LOG_FORMAT"])
    pods = [
        o["spec"]["template"]["spec"]
        for o in JobObjects("job-1", JobSpec(), K8sOptions()).all()
        if o["kind"] in ("Job", "Deployment")
    ]
    assert len(pods) == 4
    for pod in pods:
        assert {"name": "OMRL_LOG_FORMAT", "value": "text"} in main_container({"spec": pod})["env"]


# -- the learner: probes, deadline ---------------------------------------------------------------------
def test_a_one_pod_learner_is_probed_on_its_metrics_port_and_has_a_deadline():
    job = learner_job(render())
    container = main_container(job["spec"]["template"])
    assert "--metrics-port=9104" in container["args"]
    assert {"name": "metrics", "containerPort": 9104} in container["ports"]
    for probe in ("startupProbe", "livenessProbe"):
        assert container[probe]["httpGet"] == {"path": "/metrics", "port": "metrics"}, probe
    startup = container["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] == 1800  # model download and load
    # longer than a scrape that finds Redis hanging (services/learner/prometheus_metrics.py: 3 reads, 2 s each)
    assert container["livenessProbe"]["timeoutSeconds"] > 3 * 2
    assert job["spec"]["activeDeadlineSeconds"] == 7 * 86400
    assert learner_job(render("--set", "learner.activeDeadlineSeconds=3600"))["spec"]["activeDeadlineSeconds"] == 3600
    assert "activeDeadlineSeconds" not in learner_job(render("--set", "learner.activeDeadlineSeconds=null"))["spec"]


# -- data on volumes -----------------------------------------------------------------------------------
def test_datasets_live_on_an_absolute_path_mounted_where_they_are_read(tmp_path):
    docs = render()
    assert run_config(docs, tmp_path).env.data_dir == "/datasets/generated"
    pods = workloads(docs)
    for component in ("rollout", "envs"):
        assert mounts(pods[component])["/datasets"]["name"] == "datasets", component
        assert "readOnly" not in mounts(pods[component])["/datasets"]
        assert volumes(pods[component])["datasets"] == {"name": "datasets", "emptyDir": {}}
    claim = {"persistentVolumeClaim": {"claimName": "task-data"}}
    docs = render(
        "--set",
        "datasets.volume.persistentVolumeClaim.claimName=task-data",
        "--set",
        "datasets.readOnly=true",
        "--set",
        "config.env.dataset=/datasets/my-tasks",
    )
    rollout = workloads(docs)["rollout"]
    assert volumes(rollout)["datasets"] == {"name": "datasets", **claim}
    assert mounts(rollout)["/datasets"]["readOnly"] is True
    assert run_config(docs, tmp_path).env.dataset == "/datasets/my-tasks"


@pytest.mark.parametrize("setting", ["config.env.data_dir=data", "config.env.dataset=tasks/mine"])
def test_a_relative_dataset_path_is_refused_at_render_time(setting):
    proc = run_helm("template", "omrl", str(CHART), "--set", setting)
    assert proc.returncode != 0 and "must be an absolute path" in proc.stderr


def test_checkpoints_can_live_on_any_volume_source_such_as_an_object_storage_mount():
    docs = render(
        "--set-json",
        'learner.persistence.volume={"csi":{"driver":"s3.csi.aws.com","volumeAttributes":{"bucketName":"ckpts"}}}',
    )
    data = volumes(learner_job(docs)["spec"]["template"])["data"]
    assert data["csi"]["driver"] == "s3.csi.aws.com"
    assert "omrl-openmanus-rl-learner-data" not in objects(docs, "PersistentVolumeClaim")
    assert "omrl-openmanus-rl-learner-data" in objects(render(), "PersistentVolumeClaim")


# -- alert rules ---------------------------------------------------------------------------------------
def test_alert_rules_ship_as_a_prometheus_rule_behind_a_flag():
    assert not objects(render(), "PrometheusRule")
    rule = objects(render("--set", "alerts.enabled=true", "--set", "alerts.labels.release=kps"), "PrometheusRule")[
        "omrl-openmanus-rl"
    ]
    assert rule["metadata"]["labels"]["release"] == "kps"
    assert rule["spec"]["groups"] == yaml.safe_load((ROOT / "deploy/prometheus/alerts.yml").read_text())["groups"]


# -- Kueue and JobSet ----------------------------------------------------------------------------------
def queued(docs) -> dict[str, str]:
    return {
        f"{d['kind']}/{component_of(d)}": d["metadata"]["labels"]["kueue.x-k8s.io/queue-name"]
        for d in docs
        if "kueue.x-k8s.io/queue-name" in d["metadata"].get("labels", {})
    }


def test_kueue_queues_the_gpu_workloads_and_can_create_the_local_queue():
    assert not queued(render(*GPU)) and not objects(render(*GPU), "LocalQueue")
    docs = render(*GPU, *KUEUE, "--set", "kueue.clusterQueue=gpu-cluster")
    assert queued(docs) == {"Job/learner": "omrl-gpu", "Deployment/rollout": "omrl-gpu"}
    assert objects(docs, "LocalQueue")["omrl-gpu"]["spec"] == {"clusterQueue": "gpu-cluster"}
    assert not objects(render(*GPU, *KUEUE), "LocalQueue")  # no ClusterQueue named: the queue exists already


def test_the_jobset_holds_learner_and_rollout_servers_as_one_workload():
    docs = render(
        *GPU,
        *JOBSET,
        *KUEUE,
        "--set",
        "kueue.priorityClass=training",
        "--set",
        "learner.nodes=2",
        "--set",
        "rollout.replicas=3",
    )
    assert not objects(docs, "Job") and "omrl-openmanus-rl-rollout" not in objects(docs, "Deployment")
    (jobset,) = objects(docs, "JobSet").values()
    assert queued(docs) == {"JobSet/learner": "omrl-gpu"}  # the one workload Kueue admits, all pods or none
    assert jobset["metadata"]["labels"]["kueue.x-k8s.io/priority-class"] == "training"
    spec = jobset["spec"]
    jobs = {r["name"]: r["template"]["spec"] for r in spec["replicatedJobs"]}
    assert set(jobs) == {"learner", "rollout"}
    assert all(r["replicas"] == 1 for r in spec["replicatedJobs"])
    assert spec["successPolicy"] == {"operator": "All", "targetReplicatedJobs": ["learner"]}
    assert jobs["learner"]["completions"] == jobs["learner"]["parallelism"] == 2
    assert jobs["rollout"]["completions"] == jobs["rollout"]["parallelism"] == 3
    assert jobs["rollout"]["template"]["spec"]["restartPolicy"] == "OnFailure"
    # torchrun meets at pod 0 of the learner job, by the hostname the JobSet controller gives it
    name, subdomain = jobset["metadata"]["name"], spec["network"]["subdomain"]
    command = main_container(jobs["learner"]["template"])["command"]
    assert f"--master_addr={name}-learner-0-0.{subdomain}" in command
    assert subdomain not in objects(docs, "Service")  # the controller creates it
    # pod hostnames <jobset>-<job>-<job index>-<pod index> stay DNS labels for the longest release name
    long = render(*GPU, *JOBSET, "--set", "fullnameOverride=" + "x" * 60, "--set", "rollout.replicas=99")
    longest = f"{next(iter(objects(long, 'JobSet')))}-rollout-0-98"
    assert len(longest) <= 63, longest
    # the Services still reach the JobSet's pods
    pods = workloads(docs)
    for service in ("omrl-openmanus-rl-rollout", "omrl-openmanus-rl-learner"):
        selector = objects(docs, "Service")[service]["spec"]["selector"]
        component = selector["app.kubernetes.io/component"]
        assert selector.items() <= pods[component]["metadata"]["labels"].items(), service


@pytest.mark.parametrize("workload", [(), JOBSET], ids=["job", "jobset"])
def test_the_workload_name_follows_its_spec(workload):
    def name(*extra):
        docs = render(*GPU, *workload, *extra)
        return next(d["metadata"]["name"] for d in docs if d["kind"] in ("Job", "JobSet"))

    assert name() == name()
    assert name("--set", "envs.replicas=3") == name()  # not part of the learner's spec
    assert name("--set", "config.learner.steps=10") != name()  # the run config is (its checksum annotation)
    assert name("--set", "learner.resources.requests.cpu=16") != name()


def test_the_job_api_launches_jobs_with_the_same_gpu_and_queue_settings(monkeypatch):
    from services.jobs.settings import JobsSettings

    docs = render(
        *GPU, *KUEUE, "--set", "gpu.runtimeClassName=nvidia", "--set", "gpu.resourceName=nvidia.com/mig-1g.10gb"
    )
    for env in main_container(workloads(docs)["jobs-api"])["env"]:
        if "value" in env and env["name"].startswith("OMRL_API_K8S_"):
            monkeypatch.setenv(env["name"], env["value"])
    settings = JobsSettings()
    assert settings.k8s_gpu_resource == "nvidia.com/mig-1g.10gb"
    assert settings.k8s_gpu_tolerations == [GPU_TAINT]
    assert settings.k8s_gpu_node_selector == {}
    assert settings.k8s_gpu_runtime_class == "nvidia"
    assert settings.k8s_queue_name == "omrl-gpu"
    assert settings.k8s_workload == "Job"  # learner.workload's


def test_the_job_api_launches_jobsets_where_the_chart_runs_one_or_where_told(monkeypatch):
    from services.jobs.settings import JobsSettings

    def workload(*values):
        env = {e["name"]: e.get("value") for e in main_container(workloads(render(*values))["jobs-api"])["env"]}
        monkeypatch.setenv("OMRL_API_K8S_WORKLOAD", env["OMRL_API_K8S_WORKLOAD"])
        return JobsSettings().k8s_workload

    assert workload(*GPU, *JOBSET) == "JobSet"
    assert workload(*GPU, "--set", "jobsApi.jobWorkload=JobSet") == "JobSet"
    assert workload(*GPU, *JOBSET, "--set", "jobsApi.jobWorkload=Job") == "Job"
    proc = run_helm("template", "omrl", str(CHART), "--set", "jobsApi.jobWorkload=TrainJob")
    assert proc.returncode != 0 and "jobWorkload" in proc.stderr


def notes(*args: str) -> str:
    proc = run_helm("install", "--dry-run=client", "omrl", str(CHART), "--namespace", "ml", *args)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.partition("\nNOTES:\n")[2]


def test_the_notes_warn_when_kueue_admits_learner_and_rollouts_separately():
    assert "admitted separately" not in notes()  # no queue, nothing admitted
    plain = notes(*KUEUE)
    assert "learner.workload=JobSet admits them as one workload" in plain
    assert "jobsApi.jobWorkload=JobSet" in plain
    assert "admitted separately" not in notes(*KUEUE, *JOBSET)  # the job API's jobs follow the learner
    only_api = notes(*KUEUE, *JOBSET, "--set", "jobsApi.jobWorkload=Job")
    assert "jobsApi.jobWorkload=JobSet" in only_api and "learner.workload=JobSet" not in only_api
