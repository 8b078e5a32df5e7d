"""The kubernetes launcher: creates a job's objects (see k8s_objects) through the `kubernetes` client and
reads the job's state back from the cluster. Cancelling deletes the root (the learner Job, or the JobSet
with `K8sOptions.workload` JobSet) in the foreground, and the garbage collector deletes everything it owns.

`python -m services.launcher.kubernetes render job.yaml` prints the manifests it would create."""

from __future__ import annotations

import argparse
import logging
import sys
import time
from typing import Any

import yaml

from services.common.config import TrainConfig, load_config
from services.jobs.launchers import (
    CANCELLED,
    CANCELLING,
    FAILED,
    LAUNCHERS,
    RUNNING,
    STARTING,
    SUCCEEDED,
    Launcher,
    LaunchStatus,
    SpecRejected,
)
from services.jobs.spec import JobSpec
from services.launcher.k8s_objects import JOBSET_API, MANAGED_BY, WORKLOADS, JobObjects, K8sOptions, run_config

log = logging.getLogger(__name__)

REQUEST_TIMEOUT = (5.0, 30.0)  # (connect, read) seconds, on every API call
APIS = {
    "Job": ("batch", "namespaced_job"),
    "ConfigMap": ("core", "namespaced_config_map"),
    "Service": ("core", "namespaced_service"),
    "Deployment": ("apps", "namespaced_deployment"),
    "Pod": ("core", "namespaced_pod"),
    "Secret": ("core", "namespaced_secret"),
    "NetworkPolicy": ("networking", "namespaced_network_policy"),
    "JobSet": ("jobsets", "namespaced_job_set"),
}
# the root's condition that says the learner finished well (a JobSet's when its success policy is met)
SUCCESS = {"Job": "Complete", "JobSet": "Completed"}
POD_PROBLEMS = {
    "ImagePullBackOff",
    "ErrImagePull",
    "InvalidImageName",
    "CrashLoopBackOff",
    "CreateContainerConfigError",
    "CreateContainerError",
    "RunContainerError",
}
INSTANCE = "app.kubernetes.io/instance"


class JobSetApi:
    """JobSets through the client's CustomObjectsApi, with the typed APIs' method names and argument order."""

    def __init__(self, custom: Any):
        self.custom = custom
        self.group, self.version = JOBSET_API.split("/")

    def create_namespaced_job_set(self, namespace: str, body: dict[str, Any], **kwargs: Any) -> Any:
        return self.custom.create_namespaced_custom_object(
            self.group, self.version, namespace, "jobsets", body, **kwargs
        )

    def read_namespaced_job_set(self, name: str, namespace: str, **kwargs: Any) -> Any:
        return self.custom.get_namespaced_custom_object(self.group, self.version, namespace, "jobsets", name, **kwargs)

    def delete_namespaced_job_set(self, name: str, namespace: str, **kwargs: Any) -> Any:
        return self.custom.delete_namespaced_custom_object(
            self.group, self.version, namespace, "jobsets", name, **kwargs
        )


@LAUNCHERS.register("kubernetes")
class KubernetesLauncher(Launcher):
    name = "kubernetes"

    def __init__(self, api_client: Any, options: K8sOptions):
        from kubernetes import client

        self.api, self.options = api_client, options
        self.core, self.apps, self.batch = (
            client.CoreV1Api(api_client),
            client.AppsV1Api(api_client),
            client.BatchV1Api(api_client),
        )
        self.networking = client.NetworkingV1Api(api_client)
        self.jobsets = JobSetApi(client.CustomObjectsApi(api_client))
        if warning := options.admission_warning():
            log.warning(warning)

    @classmethod
    def from_settings(cls, settings: Any) -> KubernetesLauncher:
        from kubernetes import client, config

        try:
            config.load_incluster_config()
        except config.ConfigException:
            config.load_kube_config()
        return cls(
            client.ApiClient(),
            K8sOptions(
                namespace=settings.k8s_namespace,
                image=settings.k8s_image,
                gpu_image=settings.k8s_gpu_image,
                redis_url=settings.k8s_redis_url,
                redis_password_secret=settings.k8s_redis_password_secret,
                redis_password_key=settings.k8s_redis_password_key,
                service_account=settings.k8s_service_account,
                run_as_user=settings.k8s_run_as_user,
                monitoring_namespace=settings.k8s_monitoring_namespace or None,
                network_policies=settings.k8s_network_policies,
                gpu_resource=settings.k8s_gpu_resource,
                gpu_tolerations=settings.k8s_gpu_tolerations,
                gpu_node_selector=settings.k8s_gpu_node_selector,
                gpu_runtime_class=settings.k8s_gpu_runtime_class or None,
                queue_name=settings.k8s_queue_name or None,
                workload=settings.k8s_workload,
            ),
        )

    def close(self) -> None:
        self.api.close()

    # -- the interface ---------------------------------------------------------------------------
    def check(self, spec: JobSpec) -> None:
        if not spec.model.path:
            raise SpecRejected(
                ("model", "path"),
                "the kubernetes launcher needs model.path (a Hugging Face id, or a "
                "directory on resources.volume_claim); only the local launcher "
                "builds the tiny demo model",
            )

    def run_config(self, job_id: str, spec: JobSpec) -> TrainConfig:
        return run_config(job_id, spec, self.options)

    def start(self, job_id: str, spec: JobSpec) -> dict[str, Any]:
        objects = JobObjects(job_id, spec, self.options)
        root = self._create(objects.root())
        dependents = objects.dependents(root)
        try:
            for body in dependents:
                self._create(body)
        except Exception:
            self._delete(root["kind"], root["metadata"]["name"], "Foreground")  # nothing half-made stays behind
            raise
        return {
            "namespace": self.options.namespace,
            "kind": root["kind"],
            "job": root["metadata"]["name"],
            "uid": root["metadata"]["uid"],
            "deployments": [b["metadata"]["name"] for b in dependents if b["kind"] == "Deployment"],
            "services": [b["metadata"]["name"] for b in dependents if b["kind"] == "Service"],
        }

    def poll(self, job_id: str, handle: dict[str, Any]) -> LaunchStatus:
        handle = dict(handle)
        cancelling = bool(handle.get("cancel_requested_at"))
        kind = root_kind(handle)
        job = self._read(kind, handle["job"])
        if job is None or job["metadata"].get("uid") != handle["uid"]:
            if cancelling:
                return LaunchStatus(CANCELLED, handle=handle)
            return LaunchStatus(FAILED, error=f"{kind} {handle['job']} was deleted outside the job API", handle=handle)
        messages = self._pod_problems(job_id, handle)
        done = {c["type"]: c for c in (job.get("status") or {}).get("conditions") or [] if c.get("status") == "True"}
        if SUCCESS[kind] in done or "Failed" in done:
            self._release(handle)
            if SUCCESS[kind] in done:
                return LaunchStatus(SUCCEEDED, messages=messages, handle=handle)
            why = done["Failed"]
            return LaunchStatus(
                FAILED,
                error=f"{why.get('reason', 'Failed')}: {why.get('message', '')}".strip(": "),
                messages=messages,
                handle=handle,
            )
        if cancelling:
            return LaunchStatus(CANCELLING, messages=messages, handle=handle)
        return LaunchStatus(RUNNING if self._all_ready(job, handle) else STARTING, messages=messages, handle=handle)

    def cancel(self, job_id: str, handle: dict[str, Any]) -> dict[str, Any]:
        self._delete(root_kind(handle), handle["job"], "Foreground")
        return {**handle, "cancel_requested_at": time.time()}

    def logs(self, job_id: str, handle: dict[str, Any], service: str, tail: int) -> str:
        if service == "supervisor":
            return "jobs on kubernetes have no supervisor process; ask for envs, reward, rollout or learner"
        pods = self._list_pods(f"{INSTANCE}={job_id},app.kubernetes.io/component={service}")
        parts = []
        for pod in sorted(pods, key=lambda p: p["metadata"]["name"])[:8]:
            name = pod["metadata"]["name"]
            try:
                text = self.core.read_namespaced_pod_log(
                    name, self.options.namespace, container=service, tail_lines=tail, _request_timeout=REQUEST_TIMEOUT
                )
            except self._api_exception() as exc:
                text = f"(no log: {exc.status} {exc.reason})"
            parts.append(f"==> {name} <==\n{text}")
        return "\n".join(parts)

    # -- cluster reads and writes ----------------------------------------------------------------
    def _method(self, kind: str, verb: str):
        api, suffix = APIS[kind]
        return getattr(getattr(self, api), f"{verb}_{suffix}")

    def _plain(self, obj: Any) -> dict[str, Any]:
        return self.api.sanitize_for_serialization(obj)

    @staticmethod
    def _api_exception():
        from kubernetes.client.exceptions import ApiException

        return ApiException

    def _create(self, body: dict[str, Any]) -> dict[str, Any]:
        try:
            return self._plain(
                self._method(body["kind"], "create")(self.options.namespace, body, _request_timeout=REQUEST_TIMEOUT)
            )
        except self._api_exception() as exc:
            if exc.status != 409:
                raise
        # it exists: an API restart between creating and recording; adopt it only if it is this job's
        existing = self._read(body["kind"], body["metadata"]["name"])
        theirs = ((existing or {}).get("metadata") or {}).get("labels") or {}
        if (
            theirs.get(INSTANCE) != body["metadata"]["labels"][INSTANCE]
            or theirs.get("app.kubernetes.io/managed-by") != MANAGED_BY
        ):
            raise RuntimeError(f"{body['kind']} {body['metadata']['name']} exists and belongs to something else")
        return existing

    def _read(self, kind: str, name: str) -> dict[str, Any] | None:
        try:
            return self._plain(
                self._method(kind, "read")(name, self.options.namespace, _request_timeout=REQUEST_TIMEOUT)
            )
        except self._api_exception() as exc:
            if exc.status == 404:
                return None
            raise

    def _delete(self, kind: str, name: str, propagation: str) -> None:
        try:
            # explicit policy: the API's default for Jobs orphans their pods and dependents
            self._method(kind, "delete")(
                name, self.options.namespace, propagation_policy=propagation, _request_timeout=REQUEST_TIMEOUT
            )
        except self._api_exception() as exc:
            if exc.status != 404:
                raise

    def _list_pods(self, label_selector: str) -> list[dict[str, Any]]:
        pods = self.core.list_namespaced_pod(
            self.options.namespace, label_selector=label_selector, _request_timeout=REQUEST_TIMEOUT
        )
        return self._plain(pods).get("items") or []

    # -- reading the job back ----------------------------------------------------------------------
    @staticmethod
    def _root_ready(root: dict[str, Any]) -> bool:
        status = root.get("status") or {}
        if root["kind"] == "JobSet":
            # per replicated job, `ready` counts its Jobs whose pods are all ready (or done)
            ready = {r["name"]: r.get("ready") or 0 for r in status.get("replicatedJobsStatus") or []}
            return all(ready.get(r["name"], 0) >= r.get("replicas", 1) for r in root["spec"]["replicatedJobs"])
        return max(status.get("ready") or 0, status.get("active") or 0) >= root["spec"].get("parallelism", 1)

    def _all_ready(self, job: dict[str, Any], handle: dict[str, Any]) -> bool:
        if not self._root_ready(job):
            return False
        for name in handle["deployments"]:
            deployment = self._read("Deployment", name)
            if deployment is None:
                return False
            want = deployment["spec"].get("replicas", 1)
            if ((deployment.get("status") or {}).get("availableReplicas") or 0) < want:
                return False
        return True

    def _release(self, handle: dict[str, Any]) -> None:
        """A finished job frees its GPUs and services; the Job (logs) and ConfigMap stay until its TTL."""
        if handle.get("released"):
            return
        for name in handle["deployments"]:
            self._delete("Deployment", name, "Background")
        for name in handle["services"]:
            self._delete("Service", name, "Background")
        handle["released"] = True

    def _pod_problems(self, job_id: str, handle: dict[str, Any]) -> list[str | dict[str, Any]]:
        """Why pods do not run (unschedulable, image pulls, crash loops), and each pod's start-up (scheduled,
        started and loading, ready: structured start-up events, as the local launcher's), each reported once."""
        seen, messages = set(handle.get("reported", [])), []
        for pod in self._list_pods(f"{INSTANCE}={job_id}"):
            name, status = pod["metadata"]["name"], pod.get("status") or {}
            component = (pod["metadata"].get("labels") or {}).get("app.kubernetes.io/component", name)
            found: list[tuple[str, str | dict[str, Any]]] = []
            for cond in status.get("conditions") or []:
                if cond.get("type") == "PodScheduled" and cond.get("status") == "True":
                    node = (pod.get("spec") or {}).get("nodeName")
                    message = f"{component}: pod {name} scheduled" + (f" on {node}" if node else "")
                    found.append(_stage(name, "scheduled", component, "scheduled", message))
            for cs in status.get("containerStatuses") or []:
                if "running" in (cs.get("state") or {}) and not cs.get("ready"):
                    message = f"{component}: pod {name} started, loading (model, engine) until its health check passes"
                    found.append(
                        _stage(name, f"{cs['name']}/started/{cs.get('restartCount', 0)}", component, "loading", message)
                    )
            for cond in status.get("conditions") or []:
                if cond.get("type") == "Ready" and cond.get("status") == "True":
                    found.append(_stage(name, "ready", component, "healthy", f"{component}: pod {name} ready"))
                if cond.get("type") == "PodScheduled" and cond.get("status") == "False":
                    found.append(
                        (
                            f"{name}/{cond.get('reason')}",
                            f"{name}: not scheduled ({cond.get('reason')}): {cond.get('message', '')}",
                        )
                    )
            for cs in status.get("containerStatuses") or []:
                waiting = (cs.get("state") or {}).get("waiting") or {}
                if waiting.get("reason") in POD_PROBLEMS:
                    text = f"{name}/{cs['name']}: {waiting['reason']}: {waiting.get('message', '')}"
                    found.append((f"{name}/{cs['name']}/{waiting['reason']}", text.rstrip(": ")))
                last = (cs.get("lastState") or {}).get("terminated") or {}
                if last.get("reason") == "OOMKilled":
                    found.append(
                        (
                            f"{name}/{cs['name']}/OOMKilled/{cs.get('restartCount')}",
                            f"{name}/{cs['name']}: killed for running out of memory",
                        )
                    )
            for key, message in found:
                if key not in seen:
                    seen.add(key)
                    messages.append(message)
        if messages:
            handle["reported"] = sorted(seen)[-200:]
        return messages


def _stage(pod: str, key: str, service: str, stage: str, message: str) -> tuple[str, dict[str, Any]]:
    """A pod's start-up event, with the key that reports it once."""
    return f"{pod}/{key}", {"message": message, "service": service, "stage": stage}


def root_kind(handle: dict[str, Any]) -> str:
    return handle.get("kind", "Job")  # handles recorded before JobSets have none


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m services.launcher.kubernetes", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    render = sub.add_parser("render", help="print the manifests the launcher would create for a job spec")
    render.add_argument("spec", help="job spec YAML (services.jobs.spec.JobSpec)")
    render.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    render.add_argument("--job-id", default="example-job-00000000")
    render.add_argument("--namespace", default="default")
    render.add_argument("--image", default=K8sOptions.image)
    render.add_argument("--gpu-image", default=K8sOptions.gpu_image)
    render.add_argument("--redis-url", default=None)
    render.add_argument("--redis-password-secret", default=None)
    render.add_argument("--workload", choices=WORKLOADS, default="Job")
    render.add_argument("--queue-name", default=None, help="Kueue LocalQueue")
    args = parser.parse_args(argv)
    spec = load_config(args.spec, args.set, schema=JobSpec)
    options = K8sOptions(
        namespace=args.namespace,
        image=args.image,
        gpu_image=args.gpu_image,
        redis_url=args.redis_url,
        redis_password_secret=args.redis_password_secret,
        workload=args.workload,
        queue_name=args.queue_name,
    )
    yaml.safe_dump_all(JobObjects(args.job_id, spec, options).all(), sys.stdout, sort_keys=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
