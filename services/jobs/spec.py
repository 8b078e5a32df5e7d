"""The job spec: a run config (`services.common.config.TrainConfig`) plus where and how it runs, the resources
and schedule of its services. The job API takes one per job (REST, `omrl submit`) and hands it to its launcher;
every run config file is a valid job spec. Importing this module loads every plugin registry
(`services.plugins`): a job spec is checked against all of them when it is parsed."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, StringConstraints, ValidationError, model_validator

import services.plugins  # noqa: F401  (every plugin kind checked in a job spec)
from services.common.config import Section, TrainConfig

Quantity = Annotated[str, StringConstraints(pattern=r"^[0-9]+(\.[0-9]+)?(m|k|M|G|T|P|E|Ki|Mi|Gi|Ti|Pi|Ei)?$")]
DnsName = Annotated[str, StringConstraints(pattern=r"^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$")]


class ComponentResources(Section):
    replicas: int = Field(1, ge=1, le=512)
    """Pods of this component (learner: torchrun nodes, each running learner.nproc processes)."""
    cpu: Quantity = "2"
    """CPU request and limit per pod (Kubernetes quantity)."""
    memory: Quantity = "8Gi"
    """Memory request and limit per pod (Kubernetes quantity)."""
    gpus: int = Field(0, ge=0, le=16)
    """GPUs per pod (`nvidia.com/gpu`); the learner runs one process per GPU."""


class ResourcesConfig(Section):
    learner: ComponentResources = Field(default_factory=lambda: ComponentResources(cpu="4", memory="16Gi"))
    rollout: ComponentResources = Field(default_factory=lambda: ComponentResources(cpu="4", memory="16Gi"))
    envs: ComponentResources = Field(default_factory=lambda: ComponentResources(cpu="1", memory="2Gi"))
    reward: ComponentResources = Field(default_factory=lambda: ComponentResources(cpu="1", memory="2Gi"))
    image: str | None = None
    """Container image for every component (Kubernetes); empty: the launcher's default images."""
    volume_claim: DnsName | None = None
    """PersistentVolumeClaim mounted at /data in every pod (models, checkpoints); empty: scratch space per pod."""


class Toleration(Section):
    key: str | None = None
    operator: Literal["Equal", "Exists"] = "Equal"
    value: str | None = None
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = None


class ScheduleConfig(Section):
    max_runtime_s: int | None = Field(None, ge=60, le=30 * 86400)
    """Wall-clock limit of the job; past it the job is stopped and marked failed. Empty: no limit."""
    backoff_limit: int = Field(0, ge=0, le=10)
    """Kubernetes: retries of the learner pods before the job fails."""
    priority_class: DnsName | None = None
    """Kubernetes PriorityClass of the job's pods."""
    node_selector: dict[str, str] = Field(default_factory=dict)
    """Kubernetes node labels every pod of the job requires."""
    tolerations: list[Toleration] = Field(default_factory=list)
    """Kubernetes taints the job's pods tolerate (e.g. GPU node taints)."""
    ttl_after_finished_s: int = Field(86400, ge=0, le=365 * 86400)
    """Kubernetes: how long the finished learner Job (and its logs) is kept."""


class JobSpec(TrainConfig):
    """A training job: the run config plus the resources and schedule it runs with. Every run config
    file is a valid job spec; `run` becomes the job's name."""

    resources: ResourcesConfig = Field(default_factory=ResourcesConfig)
    schedule: ScheduleConfig = Field(default_factory=ScheduleConfig)

    @model_validator(mode="after")
    def _check_resources(self) -> JobSpec:
        # env-service replicas: one number, whichever of the two fields says it
        envs, env = self.resources.envs, self.env
        if "replicas" in envs.model_fields_set and "replicas" in env.model_fields_set and envs.replicas != env.replicas:
            raise ValueError(
                f"resources.envs.replicas ({envs.replicas}) and env.replicas ({env.replicas}) disagree; set one of them"
            )
        if "replicas" in envs.model_fields_set:
            try:
                env.replicas = envs.replicas
            except ValidationError as exc:
                raise ValueError(f"resources.envs.replicas: {exc.errors()[0]['msg']} (env.replicas' limit)") from None
        else:
            envs.replicas = env.replicas
        learner_gpus = self.resources.learner.gpus
        if learner_gpus and learner_gpus != self.learner.nproc:
            raise ValueError(
                f"resources.learner.gpus ({learner_gpus}) must equal learner.nproc "
                f"({self.learner.nproc}): the learner runs one process per GPU"
            )
        rollout_gpus = self.resources.rollout.gpus
        if rollout_gpus and "gpus" in self.rollout.model_fields_set and rollout_gpus != self.rollout.gpus:
            raise ValueError(
                f"resources.rollout.gpus ({rollout_gpus}) and rollout.gpus ({self.rollout.gpus}) "
                "disagree; set one of them"
            )
        if rollout_gpus:
            self.rollout.gpus = rollout_gpus  # tensor-parallel over the pod's GPUs
        elif self.rollout.gpus > 1:
            raise ValueError(
                f"rollout.gpus ({self.rollout.gpus}) needs resources.rollout.gpus = {self.rollout.gpus}: "
                "tensor parallelism runs on GPU pods"
            )
        return self

    def train_config(self) -> TrainConfig:
        """The run config the services load (they reject the job-only sections)."""
        return TrainConfig.model_validate(self.model_dump(exclude={"resources", "schedule"}))
