"""The kubernetes launcher without a cluster: every object it renders passes Kubernetes' own schemas, and
its logic runs through the real `kubernetes` client against an in-process fake API server."""

import base64

import kubernetes_validate
import pytest
import yaml

from services.common.config import TrainConfig, load_config
from services.common.cpu_budget import OPENMP_IDLE
from services.jobs import launchers
from services.jobs.manager import JobManager
from services.jobs.spec import JobSpec
from services.jobs.store import JobStore
from services.launcher.k8s_objects import JobObjects, K8sOptions, run_config
from services.launcher.kubernetes import KubernetesLauncher
from tests.support.fake_kubernetes import FakeCluster
from tests.support.job_examples import EXAMPLES, JOB, by_kind, cpu_spec, gpu_spec

OPTIONS = K8sOptions(namespace="rl", image="omrl:cpu", gpu_image="omrl:cuda", redis_url="redis://omrl-redis:6379/0")
DNS_LABEL = r"^[a-z]([-a-z0-9]*[a-z0-9])?$"


def pod_specs(objects):
    return [o["spec"]["template"]["spec"] for o in objects if o["kind"] in ("Job", "Deployment")]


# -- rendering -------------------------------------------------------------------------------------
@pytest.mark.parametrize("version", ["1.27.0", "1.37.0"])
@pytest.mark.parametrize("make_spec", [cpu_spec, gpu_spec], ids=["cpu", "gpu"])
def test_every_rendered_object_passes_the_kubernetes_schemas(make_spec, version):
    objects = JobObjects(JOB, make_spec(), OPTIONS).all()
    assert sorted(o["kind"] for o in objects) == [
        "ConfigMap",
        "Deployment",
        "Deployment",
        "Deployment",
        "Job",
        *["NetworkPolicy"] * 4,
        "Secret",
        "Service",
        "Service",
        "Service",
    ]
    for obj in objects:
        kubernetes_validate.validate(obj, version, strict=True)


def test_learner_is_a_torchrun_job_across_pods_meeting_through_a_headless_service():
    objects = JobObjects(JOB, gpu_spec(), OPTIONS).all()
    job = by_kind(objects, "Job")[f"{JOB}-learner"]
    pod = job["spec"]["template"]["spec"]
    assert job["spec"]["completionMode"] == "Indexed" and job["spec"]["completions"] == job["spec"]["parallelism"] == 2
    command = pod["containers"][0]["command"]
    assert command[0] == "torchrun" and "--nnodes=2" in command and "--nproc_per_node=4" in command
    assert "--node_rank=$(NODE_RANK)" in command
    assert f"--master_addr={JOB}-learner-0.{JOB}-learner" in command
    rank_env = {e["name"]: e for e in pod["containers"][0]["env"]}["NODE_RANK"]
    assert "job-completion-index" in rank_env["valueFrom"]["fieldRef"]["fieldPath"]
    headless = by_kind(objects, "Service")[pod["subdomain"]]
    assert headless["spec"]["clusterIP"] == "None" and headless["spec"]["publishNotReadyAddresses"] is True
    assert headless["spec"]["selector"].items() <= job["spec"]["template"]["metadata"]["labels"].items()
    assert job["spec"]["activeDeadlineSeconds"] == 86400 and job["spec"]["backoffLimit"] == 1


def test_gpus_are_requested_where_the_spec_asks_and_images_follow():
    objects = JobObjects(JOB, gpu_spec(), OPTIONS).all()
    containers = {
        o["metadata"]["name"]: o["spec"]["template"]["spec"]["containers"][0]
        for o in objects
        if o["kind"] in ("Job", "Deployment")
    }
    gpus = {name: c["resources"]["limits"].get("nvidia.com/gpu") for name, c in containers.items()}
    assert gpus == {f"{JOB}-learner": "4", f"{JOB}-rollout": "1", f"{JOB}-envs": None, f"{JOB}-reward": None}
    assert containers[f"{JOB}-rollout"]["image"] == "omrl:cuda" and containers[f"{JOB}-envs"]["image"] == "omrl:cpu"
    assert by_kind(objects, "Deployment")[f"{JOB}-rollout"]["spec"]["replicas"] == 4
    rollout = containers[f"{JOB}-rollout"]
    assert "$(POD_IP):50051" in rollout["command"] and rollout["startupProbe"]["grpc"]["port"] == 50051
    assert (
        rollout["livenessProbe"]["grpc"]["service"] == "omrl.live"
        and "service" not in rollout["readinessProbe"]["grpc"]
    )
    assert rollout["startupProbe"]["failureThreshold"] * rollout["startupProbe"]["periodSeconds"] >= 1800
    for pod in pod_specs(objects):
        assert pod["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
        assert pod["tolerations"] == [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
        assert {"name": "data", "persistentVolumeClaim": {"claimName": "omrl-data"}} in pod["volumes"]
        assert pod["securityContext"]["runAsNonRoot"] is True


def test_cpu_spec_requests_no_gpus():
    objects = JobObjects(JOB, cpu_spec(), OPTIONS).all()
    for pod in pod_specs(objects):
        assert all("nvidia.com/gpu" not in c["resources"]["limits"] for c in pod["containers"])
        assert {"name": "data", "emptyDir": {}} in pod["volumes"] and "nodeSelector" not in pod


def test_names_selectors_and_owner_references_fit_together():
    objects = JobObjects(JOB, gpu_spec(), OPTIONS).all(uid="uid-of-the-job")
    templates = [o["spec"]["template"]["metadata"]["labels"] for o in objects if o["kind"] in ("Job", "Deployment")]
    for obj in objects:
        assert len(obj["metadata"]["name"]) <= 63
        assert obj["metadata"]["name"] == obj["metadata"]["name"].lower()
        if obj["kind"] == "Service":
            assert any(obj["spec"]["selector"].items() <= t.items() for t in templates), obj["metadata"]["name"]
        if obj["kind"] == "Deployment":
            assert (
                obj["spec"]["selector"]["matchLabels"].items() <= obj["spec"]["template"]["metadata"]["labels"].items()
            )
        if obj["kind"] != "Job":
            assert obj["metadata"]["ownerReferences"] == [
                {
                    "apiVersion": "batch/v1",
                    "kind": "Job",
                    "name": f"{JOB}-learner",
                    "uid": "uid-of-the-job",
                    "blockOwnerDeletion": True,
                }
            ]


def test_config_map_holds_a_run_config_the_services_accept():
    objects = JobObjects(JOB, gpu_spec(), OPTIONS).all()
    data = yaml.safe_load(by_kind(objects, "ConfigMap")[f"{JOB}-config"]["data"]["config.yaml"])
    config = TrainConfig.model_validate(data)  # no job-only sections: the services reject unknown keys
    assert (
        config.run == JOB
        and config.env.address == f"{JOB}-envs:50052"
        and config.reward.address == f"{JOB}-reward:50053"
    )
    assert config.stream.redis_url == "redis://omrl-redis:6379/0"
    assert config.learner.checkpoint_dir.startswith("/data/runs/")
    assert config.learner.nproc == 4 and config.model.path == "/data/models/Qwen2.5-1.5B-Instruct"


def test_render_command_prints_valid_manifests(capsys):
    from services.launcher.kubernetes import main

    assert main(["render", str(EXAMPLES / "gpu-cluster.yaml"), "--namespace", "rl"]) == 0
    docs = list(yaml.safe_load_all(capsys.readouterr().out))
    assert len(docs) == 13 and all(d["metadata"]["namespace"] == "rl" for d in docs)


# -- the launcher against the fake API server ---------------------------------------------------------
@pytest.fixture
def cluster():
    return FakeCluster("1.30.0")


@pytest.fixture
def launcher(cluster):
    return KubernetesLauncher(cluster.api_client(), K8sOptions(namespace="default", redis_url="redis://r:6379/0"))


def mark_ready(cluster, spec):
    cluster.set_status(
        "Job", f"{JOB}-learner", {"active": spec.resources.learner.replicas, "ready": spec.resources.learner.replicas}
    )
    for component in ("envs", "reward", "rollout"):
        replicas = getattr(spec.resources, component).replicas
        cluster.set_status("Deployment", f"{JOB}-{component}", {"replicas": replicas, "availableReplicas": replicas})


def test_start_creates_every_object_owned_by_the_learner_job(cluster, launcher):
    handle = launcher.start(JOB, gpu_spec())
    root = cluster.get("Job", f"{JOB}-learner")
    assert handle["uid"] == root["metadata"]["uid"]
    dependents = [o for o in cluster.objects.values() if o is not root]
    assert len(dependents) == 12
    assert all(o["metadata"]["ownerReferences"][0]["uid"] == root["metadata"]["uid"] for o in dependents)
    assert sorted(handle["deployments"]) == [f"{JOB}-envs", f"{JOB}-reward", f"{JOB}-rollout"]


def test_state_is_read_back_from_the_cluster_and_a_finished_job_frees_its_servers(cluster, launcher):
    spec = gpu_spec()
    handle = launcher.start(JOB, spec)
    assert launcher.poll(JOB, handle).state == launchers.STARTING
    mark_ready(cluster, spec)
    cluster.set_status("Deployment", f"{JOB}-rollout", {"replicas": 4, "availableReplicas": 3})
    assert launcher.poll(JOB, handle).state == launchers.STARTING  # one rollout replica is still loading
    mark_ready(cluster, spec)
    assert launcher.poll(JOB, handle).state == launchers.RUNNING
    cluster.set_status(
        "Job", f"{JOB}-learner", {"succeeded": 2, "conditions": [{"type": "Complete", "status": "True"}]}
    )
    status = launcher.poll(JOB, handle)
    assert status.state == launchers.SUCCEEDED and status.handle["released"]
    # kept until the TTL: the Job (logs), its config, token and policies (they guard pods still shutting down)
    assert {o["kind"] for o in cluster.objects.values()} == {"Job", "ConfigMap", "Secret", "NetworkPolicy"}


def test_a_failed_learner_job_reports_why(cluster, launcher):
    handle = launcher.start(JOB, cpu_spec())
    cluster.set_status(
        "Job",
        f"{JOB}-learner",
        {
            "failed": 1,
            "conditions": [
                {
                    "type": "Failed",
                    "status": "True",
                    "reason": "DeadlineExceeded",
                    "message": "Job was active longer than specified deadline",
                }
            ],
        },
    )
    status = launcher.poll(JOB, handle)
    assert status.state == launchers.FAILED and status.error.startswith("DeadlineExceeded: Job was active longer")
    assert not cluster.of_kind("Deployment")


def test_cancel_deletes_everything_the_job_owns(cluster, launcher):
    spec = cpu_spec()
    handle = launcher.start(JOB, spec)
    root = cluster.get("Job", f"{JOB}-learner")
    cluster.add_pod(f"{JOB}-learner-0-abcde", {"app.kubernetes.io/instance": JOB}, {"phase": "Running"}, owner=root)
    handle = launcher.cancel(JOB, handle)
    assert cluster.objects == {}
    assert launcher.poll(JOB, handle).state == launchers.CANCELLED


def test_a_job_deleted_behind_the_apis_back_is_failed(cluster, launcher):
    handle = launcher.start(JOB, cpu_spec())
    cluster.objects.clear()
    status = launcher.poll(JOB, handle)
    assert status.state == launchers.FAILED and "deleted outside" in status.error


def test_pod_problems_are_reported_once(cluster, launcher):
    handle = launcher.start(JOB, gpu_spec())
    cluster.add_pod(
        f"{JOB}-rollout-7d9-x1",
        {"app.kubernetes.io/instance": JOB},
        {
            "phase": "Pending",
            "conditions": [
                {
                    "type": "PodScheduled",
                    "status": "False",
                    "reason": "Unschedulable",
                    "message": "0/3 nodes are available: 3 Insufficient nvidia.com/gpu.",
                }
            ],
        },
    )
    cluster.add_pod(
        f"{JOB}-envs-5c4-y2",
        {"app.kubernetes.io/instance": JOB},
        {
            "phase": "Pending",
            "containerStatuses": [
                {
                    "name": "envs",
                    "ready": False,
                    "restartCount": 0,
                    "image": "omrl:cpu",
                    "imageID": "",
                    "state": {"waiting": {"reason": "ImagePullBackOff", "message": "Back-off pulling image"}},
                }
            ],
        },
    )
    first = launcher.poll(JOB, handle)
    assert first.state == launchers.STARTING
    assert any("not scheduled (Unschedulable): 0/3 nodes" in m for m in first.messages)
    assert any("envs: ImagePullBackOff" in m for m in first.messages)
    assert launcher.poll(JOB, first.handle).messages == []


def test_start_adopts_its_own_objects_after_a_restart_and_refuses_foreign_ones(cluster, launcher):
    first = launcher.start(JOB, cpu_spec())
    again = launcher.start(JOB, cpu_spec())  # the API died between creating and recording the job
    assert again["uid"] == first["uid"] and len(cluster.objects) == 13
    cluster.objects.clear()
    cluster.handle(
        "POST",
        "/api/v1/namespaces/default/configmaps",
        {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": f"{JOB}-config", "labels": {"team": "other"}}},
    )
    with pytest.raises(RuntimeError, match="belongs to something else"):
        launcher.start(JOB, cpu_spec())
    assert [o["metadata"]["name"] for o in cluster.objects.values()] == [f"{JOB}-config"]  # theirs stays, ours went


def test_a_rejected_object_rolls_the_whole_job_back(cluster, launcher, monkeypatch):
    service = JobObjects.service

    def broken(self, component, root):
        rendered = service(self, component, root)
        return {**rendered, "spec": {**rendered["spec"], "clusterIp": "None"}}  # misspelt: the schema refuses it

    monkeypatch.setattr(JobObjects, "service", broken)
    with pytest.raises(Exception, match="clusterIp"):  # refused by the client or the API server
        launcher.start(JOB, cpu_spec())
    assert cluster.objects == {}


def test_logs_come_from_the_components_pods(cluster, launcher):
    handle = launcher.start(JOB, cpu_spec())
    cluster.add_pod(
        f"{JOB}-learner-0-aaaaa",
        {"app.kubernetes.io/instance": JOB, "app.kubernetes.io/component": "learner"},
        {"phase": "Running"},
        log="step 1\nstep 2\nstep 3",
    )
    text = launcher.logs(JOB, handle, "learner", tail=2)
    assert text == f"==> {JOB}-learner-0-aaaaa <==\nstep 2\nstep 3"


def test_a_spec_without_a_model_path_is_rejected_naming_the_field(launcher):
    with pytest.raises(launchers.SpecRejected) as info:
        launcher.check(JobSpec())
    assert info.value.loc == ("model", "path")


def test_job_manager_drives_a_kubernetes_job_to_completion(cluster, launcher, tmp_path):
    store = JobStore(tmp_path / "jobs.sqlite")
    manager = JobManager(store, launcher)
    spec = cpu_spec()
    job = manager.submit(spec)
    manager.tick()
    assert manager.get(job.id).state == "starting"
    assert cluster.get("Job", f"{job.id}-learner") is not None
    cluster.set_status("Job", f"{job.id}-learner", {"active": 1, "ready": 1})
    for component in ("envs", "reward", "rollout"):
        cluster.set_status("Deployment", f"{job.id}-{component}", {"availableReplicas": 1})
    manager.tick()
    assert manager.get(job.id).state == "running"
    cluster.set_status("Job", f"{job.id}-learner", {"conditions": [{"type": "Complete", "status": "True"}]})
    manager.tick()
    assert manager.get(job.id).state == "succeeded"
    states = [e.data["state"] for e in store.events(job.id) if e.type == "state"]
    assert states == ["queued", "starting", "running", "succeeded"]


def test_a_redis_password_reaches_the_pods_only_as_an_env_var_from_its_secret():
    options = K8sOptions(
        redis_url="redis://:s3cret@omrl-redis:6379/0",
        redis_password_secret="omrl-redis",
        image="reg.io/omrl/{component}:1.0",
        gpu_image="reg.io/omrl/{component}:1.0",
    )
    objects = JobObjects(JOB, gpu_spec(), options).all()
    config_map = by_kind(objects, "ConfigMap")[f"{JOB}-config"]["data"]["config.yaml"]
    assert "s3cret" not in config_map and "redis://omrl-redis:6379/0" in config_map
    for pod in pod_specs(objects):
        for container in pod["containers"] + pod.get("initContainers", []):
            line = " ".join([*container.get("command", []), *container.get("args", [])])
            assert "s3cret" not in line and "REDIS_PASSWORD" not in line and "redis_url" not in line, line
    for name in (f"{JOB}-learner", f"{JOB}-rollout"):
        obj = by_kind(objects, "Job").get(name) or by_kind(objects, "Deployment")[name]
        container = obj["spec"]["template"]["spec"]["containers"][0]
        password = {e["name"]: e for e in container["env"]}["REDIS_PASSWORD"]
        assert password["valueFrom"]["secretKeyRef"] == {"name": "omrl-redis", "key": "redis-password"}
        assert container["image"] == f"reg.io/omrl/{name.rsplit('-', 1)[1]}:1.0"
    # the API itself reads progress with the real password
    assert run_config(JOB, gpu_spec(), options).stream.redis_url == "redis://:s3cret@omrl-redis:6379/0"


def test_env_replicas_find_each_other_through_redis():
    spec = gpu_spec()  # two env-service replicas
    envs = by_kind(JobObjects(JOB, spec, OPTIONS).all(), "Deployment")[f"{JOB}-envs"]
    container = envs["spec"]["template"]["spec"]["containers"][0]
    assert envs["spec"]["replicas"] == 2 and spec.train_config().env.replicas == 2
    command = " ".join(container["command"])
    assert "--replica-id $(POD_NAME) --advertise $(POD_IP):50052 --registry redis" in command
    assert {"POD_NAME", "POD_IP"} <= {e["name"] for e in container["env"]}
    single = by_kind(JobObjects(JOB, cpu_spec(), OPTIONS).all(), "Deployment")[f"{JOB}-envs"]
    assert "--registry" not in single["spec"]["template"]["spec"]["containers"][0]["command"]
    assert "REDIS_PASSWORD" not in {e["name"] for e in container["env"]}  # no Secret, no password


def test_env_replicas_get_the_redis_password_from_the_secret_too():
    options = K8sOptions(redis_url="redis://omrl-redis:6379/0", redis_password_secret="omrl-redis")
    KubernetesLauncher(FakeCluster().api_client(), options).check(gpu_spec())  # two replicas are accepted
    envs = by_kind(JobObjects(JOB, gpu_spec(), options).all(), "Deployment")[f"{JOB}-envs"]
    container = envs["spec"]["template"]["spec"]["containers"][0]
    assert "--registry" in container["command"]
    password = {e["name"]: e for e in container["env"]}["REDIS_PASSWORD"]
    assert password["valueFrom"]["secretKeyRef"] == {"name": "omrl-redis", "key": "redis-password"}


def test_each_component_is_reached_only_by_its_callers_of_the_same_job_and_scrapers():
    objects = JobObjects(JOB, gpu_spec(), OPTIONS).all()
    policies = {
        p["spec"]["podSelector"]["matchLabels"]["app.kubernetes.io/component"]: p
        for p in by_kind(objects, "NetworkPolicy").values()
    }
    assert set(policies) == {"envs", "reward", "rollout", "learner"}
    expected = {
        "envs": ({"rollout", "envs"}, 50052),
        "reward": ({"rollout"}, 50053),
        "rollout": ({"learner"}, 50051),
        "learner": ({"learner"}, None),
    }
    for component, (callers, port) in expected.items():
        spec = policies[component]["spec"]
        assert spec["podSelector"]["matchLabels"]["app.kubernetes.io/instance"] == JOB
        calls, metrics = spec["ingress"]
        assert {p["podSelector"]["matchLabels"]["app.kubernetes.io/component"] for p in calls["from"]} == callers
        assert all(p["podSelector"]["matchLabels"]["app.kubernetes.io/instance"] == JOB for p in calls["from"])
        assert calls.get("ports") == ([{"port": port, "protocol": "TCP"}] if port else None)
        assert metrics == {
            "from": [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}],
            "ports": [{"port": 9100, "protocol": "TCP"}],
        }
    unscraped = JobObjects(JOB, gpu_spec(), K8sOptions(monitoring_namespace=None)).all()
    assert all(len(p["spec"]["ingress"]) == 1 for p in by_kind(unscraped, "NetworkPolicy").values())
    assert not by_kind(JobObjects(JOB, gpu_spec(), K8sOptions(network_policies=False)).all(), "NetworkPolicy")


def test_rollout_and_learner_share_a_weight_token_of_their_own_job_and_every_service_binds_all_addresses():
    objects = JobObjects(JOB, gpu_spec(), OPTIONS).all()
    secret = by_kind(objects, "Secret")[f"{JOB}-weight-token"]
    assert len(base64.b64decode(secret["data"]["weight-token"])) >= 32
    other = by_kind(JobObjects(JOB, gpu_spec(), OPTIONS).all(), "Secret")[f"{JOB}-weight-token"]
    assert other["data"] != secret["data"]  # random per rendering, kept by the cluster once created
    for obj in [*by_kind(objects, "Job").values(), *by_kind(objects, "Deployment").values()]:
        container = obj["spec"]["template"]["spec"]["containers"][0]
        env = {e["name"]: e for e in container["env"]}
        assert env["OMRL_BIND_HOST"]["value"] == "0.0.0.0"
        assert env["GOMP_SPINCOUNT"]["value"] == OPENMP_IDLE["GOMP_SPINCOUNT"]
        component = obj["metadata"]["labels"]["app.kubernetes.io/component"]
        if component in ("rollout", "learner"):
            assert env["OMRL_WEIGHT_TOKEN"]["valueFrom"]["secretKeyRef"] == {
                "name": f"{JOB}-weight-token",
                "key": "weight-token",
            }
        else:
            assert "OMRL_WEIGHT_TOKEN" not in env


def test_cluster_gpu_settings_reach_the_pods_with_gpus_only():
    taint = {"key": "example.com/a100", "operator": "Exists", "effect": "NoSchedule"}
    options = K8sOptions(
        namespace="rl",
        gpu_resource="nvidia.com/mig-3g.40gb",
        gpu_tolerations=[taint],
        gpu_node_selector={"pool": "a100"},
        gpu_runtime_class="nvidia",
    )
    objects = JobObjects(JOB, gpu_spec(), options).all()
    for obj in objects:
        kubernetes_validate.validate(obj, "1.31.0", strict=True)
    pods = {o["metadata"]["name"]: o["spec"]["template"]["spec"] for o in objects if o["kind"] in ("Job", "Deployment")}
    for name, pod in pods.items():
        gpu = name in (f"{JOB}-learner", f"{JOB}-rollout")
        limits = pod["containers"][0]["resources"]["limits"]
        assert ("nvidia.com/mig-3g.40gb" in limits) == gpu and "nvidia.com/gpu" not in limits, name
        assert (taint in pod["tolerations"]) == gpu, name  # the spec's own tolerations stay on every pod
        assert pod["nodeSelector"] == (
            {"nvidia.com/gpu.present": "true", "pool": "a100"} if gpu else {"nvidia.com/gpu.present": "true"}
        ), name
        assert pod.get("runtimeClassName") == ("nvidia" if gpu else None), name


@pytest.mark.parametrize(
    "settings", [["resources.rollout.gpus=2"], ["resources.rollout.gpus=2", "rollout.gpus=2"]], ids=["pod-gpus", "both"]
)
def test_rollout_pods_get_as_many_gpus_as_their_engines_tensor_parallel_size(settings):
    spec = load_config(str(EXAMPLES / "gpu-cluster.yaml"), settings, schema=JobSpec)
    objects = JobObjects(JOB, spec, OPTIONS).all()
    rollout = by_kind(objects, "Deployment")[f"{JOB}-rollout"]["spec"]["template"]["spec"]["containers"][0]
    assert rollout["resources"]["limits"]["nvidia.com/gpu"] == "2"
    config = yaml.safe_load(by_kind(objects, "ConfigMap")[f"{JOB}-config"]["data"]["config.yaml"])
    assert TrainConfig.model_validate(config).rollout.gpus == 2
    with pytest.raises(ValueError, match=r"resources.rollout.gpus \(2\) and rollout.gpus \(4\) disagree"):
        load_config(str(EXAMPLES / "gpu-cluster.yaml"), ["resources.rollout.gpus=2", "rollout.gpus=4"], schema=JobSpec)


def test_a_kueue_queue_labels_the_learner_job_and_the_rollout_deployment():
    def queued(options):
        return {
            o["metadata"]["name"]
            for o in JobObjects(JOB, gpu_spec(), options).all()
            if o["metadata"]["labels"].get("kueue.x-k8s.io/queue-name") == "gpus"
        }

    assert queued(OPTIONS) == set()
    assert queued(K8sOptions(namespace="rl", queue_name="gpus")) == {f"{JOB}-learner", f"{JOB}-rollout"}


def test_a_relative_data_dir_moves_onto_the_writable_data_volume():
    assert run_config(JOB, cpu_spec(), OPTIONS).env.data_dir == "/data/data"
    spec = cpu_spec()
    spec.env.data_dir = "/data/tasks"
    assert run_config(JOB, spec, OPTIONS).env.data_dir == "/data/tasks"


def test_a_one_pod_learner_is_probed_on_its_metrics_port():
    def container(spec):
        return by_kind(JobObjects(JOB, spec, OPTIONS).all(), "Job")[f"{JOB}-learner"]["spec"]["template"]["spec"][
            "containers"
        ][0]

    one = container(cpu_spec())
    assert "--metrics-port" in one["command"] and {"name": "metrics", "containerPort": 9100} in one["ports"]
    assert one["startupProbe"]["httpGet"] == one["livenessProbe"]["httpGet"] == {"path": "/metrics", "port": "metrics"}
    spec = gpu_spec()
    assert spec.resources.learner.replicas > 1
    assert "livenessProbe" not in container(spec)


def test_each_pod_becoming_ready_is_a_start_up_event_reported_once(cluster, launcher):
    handle = launcher.start(JOB, gpu_spec())
    labels = {"app.kubernetes.io/instance": JOB, "app.kubernetes.io/component": "rollout"}
    cluster.add_pod(
        f"{JOB}-rollout-7d9-x1", labels, {"phase": "Running", "conditions": [{"type": "Ready", "status": "True"}]}
    )
    first = launcher.poll(JOB, handle)
    assert first.messages == [
        {"message": f"rollout: pod {JOB}-rollout-7d9-x1 ready", "service": "rollout", "stage": "healthy"}
    ]
    assert launcher.poll(JOB, first.handle).messages == []


def test_a_pods_start_up_is_scheduled_then_loading_then_ready_each_once(cluster, launcher):
    handle = launcher.start(JOB, gpu_spec())
    labels = {"app.kubernetes.io/instance": JOB, "app.kubernetes.io/component": "rollout"}
    pod = f"{JOB}-rollout-7d9-x1"
    scheduled = {"type": "PodScheduled", "status": "True"}
    cluster.add_pod(pod, labels, {"phase": "Pending", "conditions": [scheduled]}, node="gpu-node-3")
    first = launcher.poll(JOB, handle)
    assert [m["stage"] for m in first.messages] == ["scheduled"]
    assert first.messages[0]["message"] == f"rollout: pod {pod} scheduled on gpu-node-3"
    running = {
        "name": "rollout",
        "image": "omrl",
        "imageID": "",
        "ready": False,
        "restartCount": 0,
        "state": {"running": {}},
    }
    cluster.set_status("Pod", pod, {"phase": "Running", "conditions": [scheduled], "containerStatuses": [running]})
    second = launcher.poll(JOB, first.handle)
    assert [(m["stage"], m["service"]) for m in second.messages] == [("loading", "rollout")]
    ready = {"type": "Ready", "status": "True"}
    cluster.set_status(
        "Pod",
        pod,
        {"phase": "Running", "conditions": [scheduled, ready], "containerStatuses": [{**running, "ready": True}]},
    )
    third = launcher.poll(JOB, second.handle)
    assert [m["stage"] for m in third.messages] == ["healthy"]
    assert launcher.poll(JOB, third.handle).messages == []
