"""The job specs of docs/job-examples (one CPU, one GPU cluster) and how tests pick rendered objects apart."""

from pathlib import Path

from services.common.config import load_config
from services.jobs.spec import JobSpec

EXAMPLES = Path(__file__).resolve().parents[2] / "docs" / "job-examples"
JOB = "qwen-corridor-1a2b3c4d"
"""A job name as the job API makes them."""


def cpu_spec() -> JobSpec:
    return load_config(str(EXAMPLES / "tiny-local.yaml"), ["model.path=/data/models/tiny"], schema=JobSpec)


def gpu_spec() -> JobSpec:
    return load_config(str(EXAMPLES / "gpu-cluster.yaml"), schema=JobSpec)


def by_kind(objects, kind):
    """The rendered objects of `kind`, by name."""
    return {o["metadata"]["name"]: o for o in objects if o["kind"] == kind}
