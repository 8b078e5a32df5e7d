"""The Kubernetes objects of one job, as plain manifests (dicts), rendered from its spec.

The learner is an Indexed Job whose pods run torchrun, one node each; they meet at pod 0 through a
headless Service. The Job is the root: every other object names it as owner, so deleting it (cancel)
lets the garbage collector delete the rest. Rollout servers are a Deployment (GPUs requested, pod IP
advertised so the learner can push weights to each replica); envs and reward are Deployments with
Services; the run config is a ConfigMap mounted at /etc/omrl. A Secret holds the job's own weight-push
token (rollout and learner get it as OMRL_WEIGHT_TOKEN), and NetworkPolicies let each component be
reached only by the components of the same job that call it (metrics: from the monitoring namespace).
Pods with GPUs request them as `K8sOptions.gpu_resource` and alone get the GPU tolerations, node labels and
RuntimeClass; with a Kueue queue, the learner Job and the rollout Deployment carry its queue-name label.

With `K8sOptions.workload` JobSet the root is one JobSet (jobset.x-k8s.io/v1alpha2, the chart's
learner.workload: JobSet) of two replicated jobs: `learner` (the Indexed Job above) and `rollout` (the rollout
servers as an Indexed Job whose pods restart in place). Only the JobSet carries the queue-name label, so Kueue
admits learner and rollout servers as one workload; the JobSet controller's headless Service (the JobSet's
network subdomain) gives every pod a stable DNS name, pod 0 of the learner being torchrun's rendezvous.
The job's GPUs per rollout pod and its engines' tensor-parallel size are one number: JobSpec sets
rollout.gpus from resources.rollout.gpus (and refuses two different ones) before anything is rendered."""

from __future__ import annotations

import base64
import secrets
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from services.common.config import TrainConfig, dump_config
from services.common.cpu_budget import OPENMP_IDLE
from services.common.grpc_server import LIVENESS
from services.common.logs import FORMAT_ENV, log_format
from services.jobs.spec import ComponentResources, JobSpec

PORTS = {"rollout": 50051, "envs": 50052, "reward": 50053}
METRICS_PORT, RDZV_PORT = 9100, 29500
CONFIG_DIR = "/etc/omrl"
MANAGED_BY = "omrl-job-api"
SCRAPE = {"prometheus.io/scrape": "true", "prometheus.io/port": str(METRICS_PORT)}
QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
JOBSET_API = "jobset.x-k8s.io/v1alpha2"
WORKLOADS = ("Job", "JobSet")
ROLLOUT_BACKOFF = 20  # a crashed engine restarts in place; past this many restarts the JobSet fails


@dataclass
class K8sOptions:
    namespace: str = "default"
    image: str = "openmanus-rl/{component}:cpu"
    """Image of components without GPUs; `{component}` becomes envs, reward, rollout or learner."""
    gpu_image: str = "openmanus-rl/{component}:cuda"
    """Image of components with GPUs; `{component}` as above."""
    redis_url: str | None = None
    """Redis of the jobs (replaces the spec's stream.redis_url)."""
    redis_password_secret: str | None = None
    """Secret holding the Redis password: pods get it as the env var REDIS_PASSWORD, never in the ConfigMap or a
    command line."""
    redis_password_key: str = "redis-password"
    service_account: str | None = None
    run_as_user: int = 10001
    monitoring_namespace: str | None = "monitoring"
    """Namespace whose pods may scrape the jobs' metrics ports; empty: nobody."""
    network_policies: bool = True
    """Create the jobs' NetworkPolicies."""
    gpu_resource: str = "nvidia.com/gpu"
    """Extended resource GPUs are requested as (e.g. a MIG profile, nvidia.com/mig-1g.10gb)."""
    gpu_tolerations: list[dict[str, Any]] = field(default_factory=list)
    """Tolerations added to pods with GPUs only (the spec's schedule.tolerations go on every pod)."""
    gpu_node_selector: dict[str, str] = field(default_factory=dict)
    """Node labels pods with GPUs require, merged over the spec's schedule.node_selector."""
    gpu_runtime_class: str | None = None
    """RuntimeClass of pods with GPUs."""
    queue_name: str | None = None
    """Kueue LocalQueue the GPU workloads are submitted to (kueue.x-k8s.io/queue-name): the JobSet, or the
    learner Job and the rollout Deployment (each admitted on its own)."""
    workload: str = "Job"
    """What runs the learner and the rollout servers: Job (an Indexed Job and a Deployment) or JobSet (one
    JobSet holding both, admitted whole by Kueue; needs the JobSet controller)."""
    log_format: str = field(default_factory=log_format)
    """OMRL_LOG_FORMAT of the job's pods; by default this process's own (the chart sets the job API's)."""

    def __post_init__(self) -> None:
        if self.workload not in WORKLOADS:
            raise ValueError(f"workload must be one of {', '.join(WORKLOADS)}, not {self.workload!r}")

    def admission_warning(self) -> str | None:
        """Why a job's GPUs may be held while it waits: a queue, but learner and rollout servers queued apart."""
        if self.queue_name and self.workload == "Job":
            return (
                f"Kueue queue {self.queue_name} with workload Job: each job's learner Job and rollout Deployment are "
                "admitted separately (one may hold GPUs while the other waits); workload JobSet admits them whole"
            )
        return None


def names(job_id: str) -> dict[str, str]:
    return {
        "learner": f"{job_id}-learner",
        "config": f"{job_id}-config",
        "envs": f"{job_id}-envs",
        "reward": f"{job_id}-reward",
        "rollout": f"{job_id}-rollout",
        "token": f"{job_id}-weight-token",
        # the JobSet's network subdomain: the JobSet controller makes this headless Service
        "jobset": f"{job_id}-jobset",
    }


def run_config(job_id: str, spec: JobSpec, options: K8sOptions) -> TrainConfig:
    config = spec.train_config()
    n = names(job_id)
    config.run, config.output_dir = job_id, "/data/runs"
    config.env.address = f"{n['envs']}:{PORTS['envs']}"
    config.reward.address = f"{n['reward']}:{PORTS['reward']}"
    config.rollout.addresses = []  # rollout pods register their pod IPs in Redis; the learner pushes to each
    config.learner.checkpoint_dir = f"/data/runs/{job_id}/checkpoints"
    if not config.env.data_dir.startswith("/"):  # the pods' root is read-only; /data is their writable volume
        config.env.data_dir = f"/data/{config.env.data_dir}"
    if config.learner.weight_push == "nccl":  # the learner's rank 0 hosts the rendezvous store
        config.learner.weight_nccl_host = learner_pod0(job_id, options.workload)
    if options.redis_url:
        config.stream.redis_url = options.redis_url
    return config


def learner_pod0(job_id: str, workload: str) -> str:
    """DNS name of the learner's pod 0 (torchrun's rendezvous): `<job>-learner-0.<job>-learner` in a Job, the
    JobSet controller's `<jobset>-learner-0-0.<subdomain>` in a JobSet."""
    n = names(job_id)
    return f"{job_id}-learner-0-0.{n['jobset']}" if workload == "JobSet" else f"{n['learner']}-0.{n['learner']}"


def redis_url_with_password(url: str, password: str | None) -> str:
    """`url` with its password replaced (None: removed)."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    if parts.port:
        host = f"{host}:{parts.port}"
    user = parts.username or ""
    auth = f"{user}:{password}@" if password is not None else (f"{user}@" if user else "")
    return urlunsplit(parts._replace(netloc=auth + host))


def labels(job_id: str, component: str) -> dict[str, str]:
    return {
        "app.kubernetes.io/name": "openmanus-rl",
        "app.kubernetes.io/instance": job_id,
        "app.kubernetes.io/component": component,
        "app.kubernetes.io/managed-by": MANAGED_BY,
    }


def selector(job_id: str, component: str) -> dict[str, str]:
    return {"app.kubernetes.io/instance": job_id, "app.kubernetes.io/component": component}


def owner_reference(root: dict[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": root["apiVersion"],
        "kind": root["kind"],
        "name": root["metadata"]["name"],
        "uid": root["metadata"]["uid"],
        "blockOwnerDeletion": True,
    }


class JobObjects:
    """Renders the manifests of one job; `dependents` need the created root (its uid)."""

    def __init__(self, job_id: str, spec: JobSpec, options: K8sOptions):
        self.job_id, self.spec, self.options = job_id, spec, options
        self.names = names(job_id)
        self.config = run_config(job_id, spec, options)
        self.redis_env: list[dict[str, Any]] = []
        if options.redis_password_secret:
            # the services' redis_client reads $REDIS_PASSWORD: it stays off the ConfigMap and every command line
            self.config.stream.redis_url = redis_url_with_password(self.config.stream.redis_url, None)
            self.redis_env = [
                {
                    "name": "REDIS_PASSWORD",
                    "valueFrom": {
                        "secretKeyRef": {"name": options.redis_password_secret, "key": options.redis_password_key}
                    },
                }
            ]

    def _meta(
        self, name: str, component: str, owner: dict[str, Any] | None = None, queued: bool = False
    ) -> dict[str, Any]:
        meta = {"name": name, "namespace": self.options.namespace, "labels": labels(self.job_id, component)}
        if queued and self.options.queue_name:
            meta["labels"][QUEUE_LABEL] = self.options.queue_name
        if owner is not None:
            meta["ownerReferences"] = [owner_reference(owner)]
        return meta

    def _resources(self, res: ComponentResources) -> dict[str, Any]:
        amounts = {"cpu": res.cpu, "memory": res.memory}
        if res.gpus:
            amounts[self.options.gpu_resource] = str(res.gpus)
        return {"requests": dict(amounts), "limits": dict(amounts)}

    def _container(
        self,
        component: str,
        command: list[str],
        res: ComponentResources,
        ports: list[dict[str, Any]],
        env: list[dict[str, Any]] = (),
        probes: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        image = self.spec.resources.image or (self.options.gpu_image if res.gpus else self.options.image)
        container = {
            "name": component,
            "image": image.replace("{component}", component),
            "command": command,
            "ports": [*ports, {"name": "metrics", "containerPort": METRICS_PORT}],
            "env": [
                {"name": "HOME", "value": "/tmp"},
                {"name": "HF_HOME", "value": "/data/hf"},
                {"name": "PYTHONUNBUFFERED", "value": "1"},
                # the services bind 127.0.0.1 unless told otherwise; in a pod, peers come over the pod IP
                {"name": "OMRL_BIND_HOST", "value": "0.0.0.0"},
                # idle OpenMP threads spin briefly, then sleep; pools are sized by the container's CPU limit
                *({"name": k, "value": v} for k, v in OPENMP_IDLE.items()),
                {"name": FORMAT_ENV, "value": self.options.log_format},
                *env,
            ],
            "resources": self._resources(res),
            "volumeMounts": [
                {"name": "config", "mountPath": CONFIG_DIR, "readOnly": True},
                {"name": "data", "mountPath": "/data"},
                {"name": "tmp", "mountPath": "/tmp"},
                {"name": "shm", "mountPath": "/dev/shm"},
            ],
            "securityContext": {
                "allowPrivilegeEscalation": False,
                "readOnlyRootFilesystem": True,
                "capabilities": {"drop": ["ALL"]},
            },
        }
        container.update(probes or {})
        return container

    def _pod_spec(self, containers: list[dict[str, Any]], gpus: int = 0, **extra: Any) -> dict[str, Any]:
        sched, res = self.spec.schedule, self.spec.resources
        data = {"persistentVolumeClaim": {"claimName": res.volume_claim}} if res.volume_claim else {"emptyDir": {}}
        pod = {
            "containers": containers,
            "securityContext": {
                "runAsNonRoot": True,
                "runAsUser": self.options.run_as_user,
                "runAsGroup": self.options.run_as_user,
                "fsGroup": self.options.run_as_user,
                "seccompProfile": {"type": "RuntimeDefault"},
            },
            "volumes": [
                {"name": "config", "configMap": {"name": self.names["config"]}},
                {"name": "data", **data},
                {"name": "tmp", "emptyDir": {}},
                # torch and vLLM share tensors between processes through /dev/shm (64Mi by default)
                {"name": "shm", "emptyDir": {"medium": "Memory"}},
            ],
            "enableServiceLinks": False,
            **extra,
        }
        selector = {**sched.node_selector, **(self.options.gpu_node_selector if gpus else {})}
        if selector:
            pod["nodeSelector"] = selector
        tolerations = [t.model_dump(exclude_none=True) for t in sched.tolerations]
        tolerations += [dict(t) for t in self.options.gpu_tolerations] if gpus else []
        if tolerations:
            pod["tolerations"] = tolerations
        if gpus and self.options.gpu_runtime_class:
            pod["runtimeClassName"] = self.options.gpu_runtime_class
        if sched.priority_class:
            pod["priorityClassName"] = sched.priority_class
        if self.options.service_account:
            pod["serviceAccountName"] = self.options.service_account
        return pod

    @staticmethod
    def _grpc_probes(port: int, startup_s: int) -> dict[str, Any]:
        """Startup probe long enough for model loading; readiness on the whole server, startup and liveness
        on `LIVENESS` (a rollout server waiting for weights is alive but not ready)."""
        live = {"port": port, "service": LIVENESS}
        return {
            "startupProbe": {"grpc": live, "periodSeconds": 10, "failureThreshold": max(1, startup_s // 10)},
            "readinessProbe": {"grpc": {"port": port}, "periodSeconds": 10, "failureThreshold": 3},
            "livenessProbe": {"grpc": live, "periodSeconds": 20, "failureThreshold": 3},
        }

    # -- the root --------------------------------------------------------------------------------
    @property
    def jobset(self) -> bool:
        return self.options.workload == "JobSet"

    def root(self) -> dict[str, Any]:
        """The object every other one is owned by: the learner Job, or the JobSet."""
        return self.job_set() if self.jobset else self.learner_job()

    def learner_job(self) -> dict[str, Any]:
        n = self.names
        # pod i is reachable as <job>-learner-i.<job>-learner: torchrun's rendezvous at pod 0
        spec = self._learner_job_spec(learner_pod0(self.job_id, "Job"), subdomain=n["learner"])
        spec["ttlSecondsAfterFinished"] = self.spec.schedule.ttl_after_finished_s
        return {
            "apiVersion": "batch/v1",
            "kind": "Job",
            "metadata": self._meta(n["learner"], "learner", queued=True),
            "spec": spec,
        }

    def job_set(self) -> dict[str, Any]:
        """Learner and rollout servers as one JobSet: one Kueue workload, done when the learner is."""
        name, subdomain = self.job_id, self.names["jobset"]
        rollout = self.spec.resources.rollout
        return {
            "apiVersion": JOBSET_API,
            "kind": "JobSet",
            "metadata": self._meta(name, "learner", queued=True),
            "spec": {
                # the learner Job retries its pods itself (schedule.backoff_limit); its final failure fails the set
                "failurePolicy": {"maxRestarts": 0},
                # the rollout servers never complete: the JobSet is done when the learner is
                "successPolicy": {"operator": "All", "targetReplicatedJobs": ["learner"]},
                "network": {"enableDNSHostnames": True, "subdomain": subdomain, "publishNotReadyAddresses": True},
                "ttlSecondsAfterFinished": self.spec.schedule.ttl_after_finished_s,
                "replicatedJobs": [
                    {
                        "name": "learner",
                        "replicas": 1,
                        # the controller names pod i of job 0 <jobset>-learner-0-i
                        "template": {"spec": self._learner_job_spec(learner_pod0(name, "JobSet"))},
                    },
                    {
                        "name": "rollout",
                        "replicas": 1,
                        "template": {
                            "spec": {
                                "completionMode": "Indexed",
                                "completions": rollout.replicas,
                                "parallelism": rollout.replicas,
                                "backoffLimit": ROLLOUT_BACKOFF,
                                "template": self._server_pod_template("rollout", restartPolicy="OnFailure"),
                            }
                        },
                    },
                ],
            },
        }

    def _learner_job_spec(self, master_addr: str, subdomain: str | None = None) -> dict[str, Any]:
        res, sched = self.spec.resources.learner, self.spec.schedule
        nodes, nproc = res.replicas, self.spec.learner.nproc
        command = [
            "torchrun",
            f"--nnodes={nodes}",
            f"--nproc_per_node={nproc}",
            "--node_rank=$(NODE_RANK)",
            f"--master_addr={master_addr}",
            f"--master_port={RDZV_PORT}",
            "-m",
            "services.learner",
            "--config",
            f"{CONFIG_DIR}/config.yaml",
            "--metrics-port",
            str(METRICS_PORT),
        ]
        env = [
            {
                "name": "NODE_RANK",
                "valueFrom": {
                    "fieldRef": {"fieldPath": "metadata.annotations['batch.kubernetes.io/job-completion-index']"}
                },
            },
            *self.redis_env,
            self._token_env(),
        ]
        probes = None
        if nodes == 1:  # rank 0 serves /metrics once the model is loaded; with more pods it is in one of them
            # a scrape reads the stream backlog from Redis (up to 3 reads of 2 s when it hangs): a 10 s deadline
            metrics = {"httpGet": {"path": "/metrics", "port": "metrics"}, "timeoutSeconds": 10}
            probes = {
                "startupProbe": {**metrics, "periodSeconds": 10, "failureThreshold": 180},
                "livenessProbe": {**metrics, "periodSeconds": 30, "failureThreshold": 4},
            }
        container = self._container(
            "learner", command, res, [{"name": "rdzv", "containerPort": RDZV_PORT}], env, probes
        )
        pod_extra = {"restartPolicy": "Never", **({"subdomain": subdomain} if subdomain else {})}
        spec: dict[str, Any] = {
            "completionMode": "Indexed",
            "completions": nodes,
            "parallelism": nodes,
            "backoffLimit": sched.backoff_limit,
            "template": {
                "metadata": {"labels": labels(self.job_id, "learner"), "annotations": SCRAPE},
                "spec": self._pod_spec([container], res.gpus, **pod_extra),
            },
        }
        if sched.max_runtime_s:
            spec["activeDeadlineSeconds"] = sched.max_runtime_s
        return spec

    # -- owned by the root -----------------------------------------------------------------------
    def dependents(self, root: dict[str, Any]) -> list[dict[str, Any]]:
        # policies and the token first: no pod of the job runs unprotected or without its token
        policies = self.network_policies(root) if self.options.network_policies else []
        # in a JobSet the rollout servers are one of its jobs, and its controller makes the headless Service
        separate = [] if self.jobset else [self.learner_service(root)]
        rollout = [] if self.jobset else [self.deployment("rollout", root)]
        return [
            *policies,
            self.weight_token(root),
            self.config_map(root),
            *separate,
            self.service("envs", root),
            self.deployment("envs", root),
            self.service("reward", root),
            self.deployment("reward", root),
            *rollout,
        ]

    def _token_env(self) -> dict[str, Any]:
        return {
            "name": "OMRL_WEIGHT_TOKEN",
            "valueFrom": {"secretKeyRef": {"name": self.names["token"], "key": "weight-token"}},
        }

    def weight_token(self, root: dict[str, Any]) -> dict[str, Any]:
        """A random token per job: only this job's learner may push weights to its rollout servers."""
        token = base64.b64encode(secrets.token_urlsafe(32).encode()).decode()
        return {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": self._meta(self.names["token"], "weight-token", root),
            "type": "Opaque",
            "data": {"weight-token": token},
        }

    def network_policies(self, root: dict[str, Any]) -> list[dict[str, Any]]:
        """Ingress of each component: the job's own callers on its port, scrapers on the metrics port.
        Peers are pods of this namespace carrying this job's labels (see docs/operations.md: residual trust)."""

        def peer(component: str) -> dict[str, Any]:
            return {"podSelector": {"matchLabels": selector(self.job_id, component)}}

        callers = {
            "envs": (["rollout", "envs"], PORTS["envs"]),
            "reward": (["rollout"], PORTS["reward"]),
            "rollout": (["learner"], PORTS["rollout"]),
            "learner": (["learner"], None),
        }
        policies = []
        for component, (sources, port) in callers.items():
            rule: dict[str, Any] = {"from": [peer(s) for s in sources]}
            if port is not None:
                rule["ports"] = [{"port": port, "protocol": "TCP"}]
            ingress = [rule]
            if self.options.monitoring_namespace:
                ingress.append(
                    {
                        "from": [
                            {
                                "namespaceSelector": {
                                    "matchLabels": {"kubernetes.io/metadata.name": self.options.monitoring_namespace}
                                }
                            }
                        ],
                        "ports": [{"port": METRICS_PORT, "protocol": "TCP"}],
                    }
                )
            policies.append(
                {
                    "apiVersion": "networking.k8s.io/v1",
                    "kind": "NetworkPolicy",
                    "metadata": self._meta(f"{self.names[component]}-ingress", component, root),
                    "spec": {
                        "podSelector": {"matchLabels": selector(self.job_id, component)},
                        "policyTypes": ["Ingress"],
                        "ingress": ingress,
                    },
                }
            )
        return policies

    def config_map(self, root: dict[str, Any]) -> dict[str, Any]:
        return {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": self._meta(self.names["config"], "config", root),
            "data": {"config.yaml": dump_config(self.config)},
        }

    def learner_service(self, root: dict[str, Any]) -> dict[str, Any]:
        return {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": self._meta(self.names["learner"], "learner", root),
            "spec": {
                "clusterIP": "None",
                "selector": selector(self.job_id, "learner"),
                # DNS names exist before the pods are ready: the rendezvous happens during start-up
                "publishNotReadyAddresses": True,
                "ports": [{"name": "rdzv", "port": RDZV_PORT, "targetPort": RDZV_PORT}],
            },
        }

    def service(self, component: str, root: dict[str, Any]) -> dict[str, Any]:
        port = PORTS[component]
        return {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": self._meta(self.names[component], component, root),
            "spec": {
                "selector": selector(self.job_id, component),
                "ports": [{"name": "grpc", "port": port, "targetPort": port, "appProtocol": "grpc"}],
            },
        }

    def _server_pod_template(self, component: str, **pod_extra: Any) -> dict[str, Any]:
        res, port = getattr(self.spec.resources, component), PORTS[component]
        command = [
            "python",
            "-m",
            f"services.{component}",
            "--config",
            f"{CONFIG_DIR}/config.yaml",
            "--port",
            str(port),
            "--metrics-port",
            str(METRICS_PORT),
        ]
        env: list[dict[str, Any]] = []
        startup_s = 300
        pod_ip = {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}
        if component == "rollout":
            command += ["--advertise", f"$(POD_IP):{port}"]
            env += [pod_ip, *self.redis_env, self._token_env()]
            startup_s = 1800  # model download and load, engine warm-up
        if component == "envs" and res.replicas > 1:
            # an episode lives in one replica: replicas find each other through Redis and forward its calls
            command += ["--replica-id", "$(POD_NAME)", "--advertise", f"$(POD_IP):{port}", "--registry", "redis"]
            env += [
                pod_ip,
                {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
                *self.redis_env,
            ]
        container = self._container(
            component, command, res, [{"name": "grpc", "containerPort": port}], env, self._grpc_probes(port, startup_s)
        )
        return {
            "metadata": {"labels": labels(self.job_id, component), "annotations": SCRAPE},
            "spec": self._pod_spec([container], res.gpus, **pod_extra),
        }

    def deployment(self, component: str, root: dict[str, Any]) -> dict[str, Any]:
        replicas = getattr(self.spec.resources, component).replicas
        return {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": self._meta(self.names[component], component, root, queued=component == "rollout"),
            "spec": {
                "replicas": replicas,
                "selector": {"matchLabels": selector(self.job_id, component)},
                "template": self._server_pod_template(component),
            },
        }

    def all(self, uid: str = "00000000-0000-0000-0000-000000000000") -> list[dict[str, Any]]:
        """Every manifest, the root first (with a placeholder uid in owner references when not created yet)."""
        root = self.root()
        created = {**root, "metadata": {**root["metadata"], "uid": uid}}
        return [root, *self.dependents(created)]
