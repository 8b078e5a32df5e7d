"""The kubernetes launcher with `workload: JobSet`: a job's learner and rollout servers as one JobSet that
Kueue admits whole, valid against the vendored JobSet schema (its Job templates against Kubernetes'), and
its state, completion and cancellation read through the fake API server."""

import logging

import pytest

from services.common.config import load_config
from services.jobs import launchers
from services.jobs.settings import JobsSettings
from services.jobs.spec import JobSpec
from services.launcher.k8s_objects import QUEUE_LABEL, JobObjects, K8sOptions
from services.launcher.kubernetes import KubernetesLauncher
from tests.support.fake_kubernetes import FakeCluster, check_manifests_module
from tests.support.job_examples import EXAMPLES, JOB, by_kind, cpu_spec, gpu_spec

JOBSET = K8sOptions(namespace="rl", queue_name="gpus", workload="JobSet", redis_url="redis://omrl-redis:6379/0")


def replicated(jobset) -> dict[str, dict]:
    return {r["name"]: r for r in jobset["spec"]["replicatedJobs"]}


def pod(rjob) -> dict:
    return rjob["template"]["spec"]["template"]


# -- rendering -------------------------------------------------------------------------------------
@pytest.mark.parametrize("version", ["1.27.0", "1.35.0"])
@pytest.mark.parametrize("make_spec", [cpu_spec, gpu_spec], ids=["cpu", "gpu"])
def test_every_object_passes_the_schemas_the_chart_is_checked_against(make_spec, version):
    objects = JobObjects(JOB, make_spec(), JOBSET).all()
    assert check_manifests_module().check_documents(objects, version) == []
    assert sorted(o["kind"] for o in objects) == [
        "ConfigMap",
        "Deployment",
        "Deployment",
        "JobSet",
        *["NetworkPolicy"] * 4,
        "Secret",
        "Service",
        "Service",
    ]


def test_the_schema_check_refuses_a_bad_jobset():
    (jobset, *_) = JobObjects(JOB, cpu_spec(), JOBSET).all()
    replicated(jobset)["rollout"]["template"]["spec"]["template"]["spec"]["restartPolicy"] = "Sometimes"
    jobset["spec"]["network"]["dnsHostnames"] = True
    assert check_manifests_module().check_documents([jobset]) != []


def test_learner_and_rollout_servers_are_one_workload_kueue_admits_whole():
    objects = JobObjects(JOB, gpu_spec(), JOBSET).all()
    queued = {(o["kind"], o["metadata"]["name"]) for o in objects if QUEUE_LABEL in o["metadata"]["labels"]}
    assert queued == {("JobSet", JOB)}
    (jobset,) = by_kind(objects, "JobSet").values()
    assert jobset["metadata"]["labels"][QUEUE_LABEL] == "gpus"
    jobs = replicated(jobset)
    assert set(jobs) == {"learner", "rollout"} and all(r["replicas"] == 1 for r in jobs.values())
    assert jobset["spec"]["successPolicy"] == {"operator": "All", "targetReplicatedJobs": ["learner"]}
    assert jobset["spec"]["failurePolicy"] == {"maxRestarts": 0}
    assert f"{JOB}-rollout" not in by_kind(objects, "Deployment")  # the rollout servers are the JobSet's
    spec = gpu_spec()
    learner, rollout = jobs["learner"]["template"]["spec"], jobs["rollout"]["template"]["spec"]
    assert learner["completions"] == learner["parallelism"] == spec.resources.learner.replicas
    assert learner["completionMode"] == rollout["completionMode"] == "Indexed"
    assert rollout["completions"] == rollout["parallelism"] == spec.resources.rollout.replicas
    assert pod(jobs["rollout"])["spec"]["restartPolicy"] == "OnFailure"  # a crashed engine restarts in place
    assert pod(jobs["learner"])["spec"]["restartPolicy"] == "Never"
    assert learner["activeDeadlineSeconds"] == 86400 and learner["backoffLimit"] == 1
    assert jobset["spec"]["ttlSecondsAfterFinished"] == spec.schedule.ttl_after_finished_s
    # the rollout pods are the ones the Deployment would have run: GPUs, probes, advertised pod IP, token
    deployment = JobObjects(JOB, gpu_spec(), K8sOptions(namespace="rl", redis_url=JOBSET.redis_url)).deployment(
        "rollout", {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": "x", "uid": "u"}}
    )
    expected = deployment["spec"]["template"]
    assert pod(jobs["rollout"])["spec"]["containers"] == expected["spec"]["containers"]
    assert pod(jobs["rollout"])["metadata"] == expected["metadata"]


def test_torchrun_meets_at_learner_pod_0_by_the_name_the_jobset_controller_gives_it():
    objects = JobObjects(JOB, gpu_spec(), JOBSET).all()
    (jobset,) = by_kind(objects, "JobSet").values()
    network = jobset["spec"]["network"]
    assert network["enableDNSHostnames"] is True and network["publishNotReadyAddresses"] is True
    subdomain = network["subdomain"]
    command = pod(replicated(jobset)["learner"])["spec"]["containers"][0]["command"]
    assert f"--master_addr={JOB}-learner-0-0.{subdomain}" in command
    # the controller makes the headless Service and sets the pods' subdomain: none of ours
    assert subdomain not in by_kind(objects, "Service") and f"{JOB}-learner" not in by_kind(objects, "Service")
    assert "subdomain" not in pod(replicated(jobset)["learner"])["spec"]
    # hostnames <jobset>-<job>-<job index>-<pod index> stay DNS labels for the longest job id
    longest = "a" * 24 + "-0123abcd"
    spec = load_config(str(EXAMPLES / "gpu-cluster.yaml"), ["resources.rollout.replicas=99"], schema=JobSpec)
    (long_set,) = by_kind(JobObjects(longest, spec, JOBSET).all(), "JobSet").values()
    assert len(f"{long_set['metadata']['name']}-rollout-0-98") <= 63
    assert len(long_set["spec"]["network"]["subdomain"]) <= 63


def test_the_network_policies_still_select_the_jobsets_pods():
    objects = JobObjects(JOB, gpu_spec(), JOBSET).all()
    policies = by_kind(objects, "NetworkPolicy")
    for name, rjob in replicated(by_kind(objects, "JobSet")[JOB]).items():
        selected = policies[f"{JOB}-{name}-ingress"]["spec"]["podSelector"]["matchLabels"]
        assert selected.items() <= pod(rjob)["metadata"]["labels"].items()


def test_an_unknown_workload_is_refused():
    with pytest.raises(ValueError, match="Job, JobSet"):
        K8sOptions(workload="TrainJob")
    with pytest.raises(ValueError):
        JobsSettings(k8s_workload="Deployment")
    assert JobsSettings(k8s_workload="JobSet").k8s_workload == "JobSet"


# -- a job's life through the fake API server ------------------------------------------------------
@pytest.fixture
def cluster():
    return FakeCluster("1.30.0")


@pytest.fixture
def launcher(cluster):
    options = K8sOptions(namespace="default", redis_url="redis://r:6379/0", workload="JobSet", queue_name="gpus")
    return KubernetesLauncher(cluster.api_client(), options)


def servers_available(cluster, spec):
    for component in ("envs", "reward"):
        replicas = getattr(spec.resources, component).replicas
        cluster.set_status("Deployment", f"{JOB}-{component}", {"replicas": replicas, "availableReplicas": replicas})


def test_start_creates_the_jobset_and_everything_else_owned_by_it(cluster, launcher):
    handle = launcher.start(JOB, gpu_spec())
    root = cluster.get("JobSet", JOB)
    assert handle["kind"] == "JobSet" and handle["job"] == JOB and handle["uid"] == root["metadata"]["uid"]
    dependents = [o for o in cluster.objects.values() if o is not root]
    assert len(dependents) == 10 and not cluster.of_kind("Job")
    for obj in dependents:
        assert obj["metadata"]["ownerReferences"][0] == {
            "apiVersion": "jobset.x-k8s.io/v1alpha2",
            "kind": "JobSet",
            "name": JOB,
            "uid": root["metadata"]["uid"],
            "blockOwnerDeletion": True,
        }
    assert sorted(handle["deployments"]) == [f"{JOB}-envs", f"{JOB}-reward"]


def test_running_once_every_replicated_job_is_ready_and_done_when_the_learner_is(cluster, launcher):
    spec = gpu_spec()
    handle = launcher.start(JOB, spec)
    servers_available(cluster, spec)
    suspended = {"conditions": [{"type": "Suspended", "status": "True", "reason": "WaitingForAdmission"}]}
    cluster.set_status("JobSet", JOB, suspended)  # Kueue has not admitted it yet
    assert launcher.poll(JOB, handle).state == launchers.STARTING
    learner_only = {"replicatedJobsStatus": [{"name": "learner", "ready": 1}, {"name": "rollout", "active": 1}]}
    cluster.set_status("JobSet", JOB, learner_only)
    assert launcher.poll(JOB, handle).state == launchers.STARTING  # rollout pods still loading the model
    both = {"replicatedJobsStatus": [{"name": "learner", "ready": 1}, {"name": "rollout", "ready": 1}]}
    cluster.set_status("JobSet", JOB, both)
    assert launcher.poll(JOB, handle).state == launchers.RUNNING
    cluster.set_status("JobSet", JOB, {**both, "conditions": [{"type": "Completed", "status": "True"}]})
    status = launcher.poll(JOB, handle)
    assert status.state == launchers.SUCCEEDED and status.handle["released"]
    # envs and reward are freed; the JobSet (its controller stops the rollout Job), config, token stay until TTL
    assert {o["kind"] for o in cluster.objects.values()} == {"JobSet", "ConfigMap", "Secret", "NetworkPolicy"}


def test_a_failed_jobset_reports_why(cluster, launcher):
    handle = launcher.start(JOB, cpu_spec())
    why = "jobset failed due to one or more job failures"
    failed = {"type": "Failed", "status": "True", "reason": "FailedJobs", "message": why}
    cluster.set_status("JobSet", JOB, {"conditions": [failed]})
    status = launcher.poll(JOB, handle)
    assert status.state == launchers.FAILED and status.error == f"FailedJobs: {failed['message']}"
    assert not cluster.of_kind("Deployment")


def test_cancel_deletes_the_jobset_and_everything_it_owns(cluster, launcher):
    handle = launcher.start(JOB, cpu_spec())
    root = cluster.get("JobSet", JOB)
    labels = {"app.kubernetes.io/instance": JOB, "app.kubernetes.io/component": "rollout"}
    cluster.add_pod(f"{JOB}-rollout-0-0-abcde", labels, {"phase": "Running"}, owner=root)
    assert launcher.poll(JOB, handle).state == launchers.STARTING
    handle = launcher.cancel(JOB, handle)
    assert cluster.objects == {}
    assert ("DELETE", f"/apis/jobset.x-k8s.io/v1alpha2/namespaces/default/jobsets/{JOB}") in cluster.calls
    assert launcher.poll(JOB, handle).state == launchers.CANCELLED


def test_a_jobset_deleted_behind_the_apis_back_is_failed(cluster, launcher):
    handle = launcher.start(JOB, cpu_spec())
    cluster.objects.clear()
    status = launcher.poll(JOB, handle)
    assert status.state == launchers.FAILED and status.error == f"JobSet {JOB} was deleted outside the job API"


def test_a_rejected_object_rolls_the_jobset_back(cluster, launcher, monkeypatch):
    service = JobObjects.service

    def broken(self, component, root):
        rendered = service(self, component, root)
        return {**rendered, "spec": {**rendered["spec"], "clusterIp": "None"}}  # misspelt: the schema refuses it

    monkeypatch.setattr(JobObjects, "service", broken)
    with pytest.raises(Exception, match="clusterIp"):
        launcher.start(JOB, cpu_spec())
    assert cluster.objects == {}


def test_a_restarted_api_adopts_its_own_jobset(cluster, launcher):
    first = launcher.start(JOB, cpu_spec())
    again = launcher.start(JOB, cpu_spec())
    assert again["uid"] == first["uid"] and len(cluster.of_kind("JobSet")) == 1


def test_handles_recorded_before_jobsets_still_name_a_job(cluster):
    launcher = KubernetesLauncher(cluster.api_client(), K8sOptions(namespace="default", redis_url="redis://r:6379/0"))
    handle = launcher.start(JOB, cpu_spec())
    assert handle.pop("kind") == "Job"
    assert launcher.poll(JOB, handle).state == launchers.STARTING
    launcher.cancel(JOB, handle)
    assert cluster.objects == {}


# -- the warning at start ------------------------------------------------------------------------
def test_a_queue_with_plain_jobs_is_warned_about_once_at_start(cluster, caplog):
    caplog.set_level(logging.WARNING, logger="services.launcher.kubernetes")
    KubernetesLauncher(cluster.api_client(), K8sOptions(queue_name="gpus"))
    (record,) = caplog.records
    assert "admitted separately" in record.getMessage() and "\n" not in record.getMessage()
    caplog.clear()
    KubernetesLauncher(cluster.api_client(), K8sOptions(queue_name="gpus", workload="JobSet"))
    KubernetesLauncher(cluster.api_client(), K8sOptions())
    assert caplog.records == []


def test_the_api_server_refuses_a_jobset_its_schema_does_not_allow(cluster, launcher, monkeypatch):
    job_set = JobObjects.job_set

    def broken(self):
        rendered = job_set(self)
        return {**rendered, "spec": {**rendered["spec"], "sucessPolicy": {}}}  # misspelt: the CRD refuses it

    monkeypatch.setattr(JobObjects, "job_set", broken)
    with pytest.raises(Exception, match="sucessPolicy"):
        launcher.start(JOB, cpu_spec())
    assert cluster.objects == {}
