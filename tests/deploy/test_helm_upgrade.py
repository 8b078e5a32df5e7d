"""`helm upgrade` of a running release: the previous chart version (the last commit whose Chart.yaml had another
version) and this one are rendered with the same values, and every object both render must be one the API
server lets helm patch: no change to a field Kubernetes keeps immutable (a Job's pod template, a StatefulSet's
claim templates, selectors, a Service's cluster IP, a claim's spec). What does change is listed exactly."""

from __future__ import annotations

import io
import subprocess
import tarfile
from pathlib import Path

import pytest
import yaml

from tests.support.helm_chart import CHART, ROOT, helm, render

CHART_PATH = "deploy/helm/openmanus-rl"
# fields of a StatefulSet spec the API server accepts changes to; any other change is refused
STATEFULSET_MUTABLE = {
    "replicas",
    "template",
    "updateStrategy",
    "persistentVolumeClaimRetentionPolicy",
    "minReadySeconds",
    "ordinals",
}


def immutable_changes(old: list[dict], new: list[dict]) -> list[str]:
    """Changes helm would send to the API server for objects in both renders that it would refuse."""
    before = {(d["kind"], d["metadata"]["name"]): d for d in old}
    problems = []
    for doc in new:
        key = (doc["kind"], doc["metadata"]["name"])
        if key not in before:
            continue
        a, b, label = before[key].get("spec") or {}, doc.get("spec") or {}, "/".join(key)

        def same(*fields: str, a=a, b=b, label=label) -> None:
            problems.extend(f"{label}: spec.{field} changed" for field in fields if a.get(field) != b.get(field))

        if doc["kind"] == "Job":
            same("template", "completionMode", "completions", "selector", "podFailurePolicy", "successPolicy")
        elif doc["kind"] == "JobSet":
            same("replicatedJobs", "network", "successPolicy", "failurePolicy", "managedBy")
        elif doc["kind"] == "StatefulSet":
            same(*sorted((set(a) | set(b)) - STATEFULSET_MUTABLE))
        elif doc["kind"] == "Deployment":
            same("selector")
        elif doc["kind"] == "Service":
            same("clusterIP", "selector")
        elif doc["kind"] == "PersistentVolumeClaim":
            same(*sorted((set(a) | set(b)) - {"resources"}))
            if a.get("resources") != b.get("resources"):
                problems.append(f"{label}: spec.resources changed (a claim can only grow, where its class allows)")
    return problems


def previous_chart_commit() -> str | None:
    """The chart as it was right before its version became the working tree's: the parent of the oldest commit
    whose Chart.yaml has the current version (the working tree itself, when that version is not committed yet)."""
    current = yaml.safe_load((CHART / "Chart.yaml").read_text())["version"]
    proc = subprocess.run(
        ["git", "log", "--format=%H", "--", f"{CHART_PATH}/Chart.yaml"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    bump = None  # the oldest commit seen so far with the current version
    for commit in proc.stdout.split():
        text = subprocess.run(
            ["git", "show", f"{commit}:{CHART_PATH}/Chart.yaml"], cwd=ROOT, capture_output=True, text=True, timeout=60
        ).stdout
        if yaml.safe_load(text)["version"] != current:
            return f"{bump}^" if bump else "HEAD"
        bump = commit
    return None


def render_at(commit: str, tmp_path: Path, *args: str) -> list[dict]:
    archive = subprocess.run(
        ["git", "archive", commit, "deploy"], cwd=ROOT, capture_output=True, timeout=60, check=True
    ).stdout
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(tmp_path, filter="tar")
    chart = tmp_path / CHART_PATH
    args = tuple(a.replace(str(CHART), str(chart)) for a in args)
    proc = subprocess.run(
        [helm(), "template", "omrl", str(chart), "--namespace", "ml", *args],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    return [doc for doc in yaml.safe_load_all(proc.stdout) if doc]


def names(docs) -> set[tuple[str, str]]:
    return {(d["kind"], d["metadata"]["name"]) for d in docs}


@pytest.mark.parametrize("values", [(), ("-f", str(CHART / "values-gpu.yaml"))], ids=["default", "gpu"])
def test_upgrading_from_the_previous_chart_version_changes_no_immutable_field(values, tmp_path):
    commit = previous_chart_commit()
    if commit is None:
        pytest.skip("no earlier chart version in this checkout's git history (shallow clone?)")
    old, new = render_at(commit, tmp_path, *values), list(render(*values))
    assert immutable_changes(old, new) == []
    # what the upgrade replaces rather than patches: the learner Job, now named after its spec
    gone, added = names(old) - names(new), names(new) - names(old)
    assert gone == {("Job", "omrl-openmanus-rl-learner")}
    assert [kind for kind, _ in added] == ["Job"]
    ((_, job),) = added
    assert job.startswith("omrl-openmanus-rl-learner-")


@pytest.mark.parametrize("workload", [(), ("--set", "learner.workload=JobSet")], ids=["job", "jobset"])
def test_a_changed_run_config_replaces_the_learner_workload_instead_of_patching_it(workload):
    old = list(render(*workload))
    new = list(render(*workload, "--set", "config.learner.steps=400", "--set", "config.rollout.group_size=4"))
    assert immutable_changes(old, new) == []
    changed = {kind for kind, _ in names(old) ^ names(new)}
    assert changed == {"JobSet" if workload else "Job"}


def test_the_check_finds_changes_the_api_server_would_refuse():
    old = list(render())
    grown = list(render("--set", "redis.persistence.size=16Gi", "--set", "learner.persistence.size=40Gi"))
    assert immutable_changes(old, grown) == [
        "PersistentVolumeClaim/omrl-openmanus-rl-learner-data: spec.resources changed (a claim can only grow, where "
        "its class allows)",
        "StatefulSet/omrl-openmanus-rl-redis: spec.volumeClaimTemplates changed",
    ]
    job = next(d for d in old if d["kind"] == "Job")
    patched = {**job, "spec": {**job["spec"], "template": {**job["spec"]["template"], "metadata": {}}}}
    assert immutable_changes([job], [patched]) == [f"Job/{job['metadata']['name']}: spec.template changed"]
