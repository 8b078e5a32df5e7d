"""Rendering the Helm chart (deploy/helm/openmanus-rl) with the real helm binary (scripts/get_helm.sh), and
picking objects out of the render, for the chart's tests."""

from __future__ import annotations

import functools
import re
import subprocess
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "deploy/helm/openmanus-rl"
GPU = ("-f", str(CHART / "values-gpu.yaml"))


@functools.cache
def helm() -> str:
    proc = subprocess.run(["bash", "scripts/get_helm.sh"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return str(ROOT / proc.stdout.strip().splitlines()[-1])


def run_helm(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([helm(), *args], cwd=ROOT, capture_output=True, text=True, timeout=120)


@functools.cache
def render(*args: str) -> tuple[dict, ...]:
    proc = run_helm("template", "omrl", str(CHART), "--namespace", "ml", *args)
    assert proc.returncode == 0, proc.stderr
    return tuple(doc for doc in yaml.safe_load_all(proc.stdout) if doc)


def objects(docs, kind: str) -> dict[str, dict]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


def component_of(doc: dict) -> str:
    return doc["metadata"]["labels"]["app.kubernetes.io/component"]


def workloads(docs) -> dict[str, dict]:
    """component -> pod template of every Deployment, StatefulSet, Job and of each job of a JobSet."""
    out = {}
    for doc in docs:
        if doc["kind"] in ("Deployment", "StatefulSet", "Job"):
            out[component_of(doc)] = doc["spec"]["template"]
        elif doc["kind"] == "JobSet":
            for rjob in doc["spec"]["replicatedJobs"]:
                pod = rjob["template"]["spec"]["template"]
                out[pod["metadata"]["labels"]["app.kubernetes.io/component"]] = pod
    return out


def learner_job(docs) -> dict:
    """The learner's Job: its name is the component's plus a hash of its spec."""
    (job,) = [d for d in docs if d["kind"] == "Job" and component_of(d) == "learner"]
    assert re.fullmatch(r"omrl-openmanus-rl-learner-[0-9a-f]{8}", job["metadata"]["name"])
    return job


def main_container(pod: dict) -> dict:
    return pod["spec"]["containers"][0]
