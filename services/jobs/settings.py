"""The job API's settings, from the environment (OMRL_API_*) or constructor arguments."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import Field, SecretStr
from pydantic_settings import BaseSettings, SettingsConfigDict


class JobsSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="OMRL_API_", extra="ignore", use_attribute_docstrings=True)

    token: SecretStr | None = None
    """Bearer token every request but health needs (or token_file)."""
    token_file: Path | None = None
    """File holding the bearer token (a mounted Secret)."""
    db: Path = Path("runs/jobs.sqlite")
    """SQLite file of job records and events; keep it on a persistent volume."""
    launcher: Literal["local", "kubernetes"] = "local"
    """Where jobs run."""
    output_dir: Path = Path("runs/jobs")
    """Local launcher: run directories (models, logs, checkpoints) of the jobs."""
    max_local_jobs: int = Field(1, ge=1)
    """Local launcher: jobs running at once; later ones wait as `queued`."""
    cancel_grace_s: float = Field(90.0, gt=0)
    """Local launcher: a cancelled job's processes are killed after this long."""
    max_restarts: int = Field(3, ge=0, le=100)
    """Local launcher: times each service of a job is restarted after it exits; past that (or with 0) the job fails."""
    restart_delay_s: float = Field(5.0, ge=0, le=600)
    """Local launcher: wait before a service that exited is restarted."""
    poll_interval_s: float = Field(1.0, gt=0, le=60)
    """How often running jobs are checked (state, steps)."""
    max_body_bytes: int = Field(1 << 20, ge=1024)
    """Larger request bodies get 413."""
    max_json_depth: int = Field(64, ge=8, le=512)
    """Request bodies whose JSON nests deeper (arrays and objects, the top level counting 1) get 400."""
    public_docs: bool = True
    """Serve the OpenAPI document and /docs without the token (they hold no job data)."""
    redis_timeout_s: float = Field(2.0, gt=0)
    """Deadline of one Redis read of a job's progress."""
    reconcile_max_age_s: float = Field(60.0, gt=0, le=3600)
    """/readyz answers 503 when no reconcile pass has finished for this long."""
    reconcile_backoff_s: float = Field(1.0, gt=0, le=600)
    """First wait before a crashed reconcile loop is restarted; doubles per crash, up to 60 s."""
    allowed_data_roots: list[Path] = Field(default_factory=lambda: [Path("data")])
    """Folders a spec's paths (env.data_dir, env.dataset, model.path, output_dir, learner.checkpoint_dir,
    learner.export_dir, plugin options marked as paths) must lie in, besides output_dir; JSON list in the
    environment, e.g. OMRL_API_ALLOWED_DATA_ROOTS='["/data"]'."""
    redis_url: str | None = None
    """Redis of the jobs (local launcher; the kubernetes launcher uses k8s_redis_url); empty: the config default."""
    allow_spec_redis_url: bool = False
    """Accept a caller's stream.redis_url (off: a spec that sets one is rejected, the server's is used)."""
    allowed_env_hosts: list[str] = Field(default_factory=list)
    """Hosts that environment-server URLs in a spec (AgentGym's base_url) may name, each `host` (any port) or
    `host:port`; empty: a spec names none (the servers come from env_options). JSON list in the environment."""
    env_options: dict[str, dict[str, Any]] = Field(default_factory=dict)
    """Env options the deployment sets, by env name, e.g. {"agentgym": {"recycle_command": "...", "base_url":
    "http://webshop:8000"}}: the only source of operator-only options (commands), and defaults for the rest;
    merged into every accepted spec of that env (and so shown in its stored spec). JSON object in the environment."""
    extra_engine_args: list[str] = Field(default_factory=list)
    """vLLM engine arguments a spec may set beyond the built-in allow-list
    (`services.engines.vllm_args.JOB_SPEC_ENGINE_ARGS`). JSON list in the environment."""
    allowed_images: list[str] = Field(default_factory=list)
    """Kubernetes launcher: images a spec's resources.image may name (exactly); empty: the jobs run k8s_image and
    k8s_gpu_image only."""
    allowed_volume_claims: list[str] = Field(default_factory=list)
    """Kubernetes launcher: PersistentVolumeClaims a spec's resources.volume_claim may mount at /data; empty: none."""
    k8s_namespace: str = "default"
    """Kubernetes launcher: namespace the jobs' objects are created in."""
    k8s_image: str = "openmanus-rl/{component}:cpu"
    """Kubernetes launcher: image of components without GPUs (`{component}`: envs, reward, rollout, learner)."""
    k8s_gpu_image: str = "openmanus-rl/{component}:cuda"
    """Kubernetes launcher: image of components with GPUs."""
    k8s_redis_url: str | None = None
    """Kubernetes launcher: Redis the jobs use (replaces the spec's stream.redis_url); the API reads progress there."""
    k8s_redis_password_secret: str | None = None
    """Kubernetes launcher: Secret with the Redis password, given to the pods (and read by the API) as
    $REDIS_PASSWORD."""
    k8s_redis_password_key: str = "redis-password"
    """Kubernetes launcher: key of the password in that Secret."""
    k8s_service_account: str | None = None
    """Kubernetes launcher: service account of the jobs' pods."""
    k8s_run_as_user: int = 10001
    """Kubernetes launcher: uid (and gid, fsGroup) of the jobs' pods; the images' user."""
    k8s_monitoring_namespace: str | None = "monitoring"
    """Kubernetes launcher: namespace whose pods may scrape the jobs' metrics ports; empty: nobody."""
    k8s_network_policies: bool = True
    """Kubernetes launcher: give every job NetworkPolicies (its components reachable only by their callers)."""
    k8s_gpu_resource: str = "nvidia.com/gpu"
    """Kubernetes launcher: extended resource GPUs are requested as (a MIG profile: nvidia.com/mig-1g.10gb)."""
    k8s_gpu_tolerations: list[dict] = Field(default_factory=list)
    """Kubernetes launcher: tolerations added to pods with GPUs only (JSON list in the environment)."""
    k8s_gpu_node_selector: dict[str, str] = Field(default_factory=dict)
    """Kubernetes launcher: node labels pods with GPUs require, over the spec's (JSON object in the environment)."""
    k8s_gpu_runtime_class: str | None = None
    """Kubernetes launcher: RuntimeClass of pods with GPUs; empty: none."""
    k8s_queue_name: str | None = None
    """Kubernetes launcher: Kueue LocalQueue the jobs' GPU workloads are submitted to; empty: none."""
    k8s_workload: Literal["Job", "JobSet"] = "Job"
    """Kubernetes launcher: what runs a job's learner and rollout servers: Job (an Indexed Job and a Deployment,
    admitted by Kueue separately) or JobSet (one JobSet holding both, admitted whole; needs the JobSet controller)."""

    def jobs_redis_url(self) -> str | None:
        return self.k8s_redis_url if self.launcher == "kubernetes" and self.k8s_redis_url else self.redis_url

    def resolve_token(self) -> str:
        token = self.token.get_secret_value() if self.token else ""
        if not token and self.token_file:
            token = self.token_file.read_text().strip()
        if not token:
            raise SystemExit("the job API needs a bearer token: set OMRL_API_TOKEN or OMRL_API_TOKEN_FILE")
        return token
