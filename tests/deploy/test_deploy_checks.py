"""CI's offline deployment checks, as scripts/ci_deploy_checks.sh runs them: helm lint --strict and helm
template (default, GPU, Kueue with a Job and a JobSet, and other value sets), every rendered object against
the Kubernetes schemas of the oldest and newest supported versions and the custom resources against their
vendored schemas, values.schema.json and the chart README up to date, the compose files against the
Compose specification, promtool on the Prometheus config and alert rules."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_ci_deploy_checks_pass():
    proc = subprocess.run(
        ["bash", "scripts/ci_deploy_checks.sh"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
        env={**os.environ, "PYTHON": sys.executable},
    )
    assert proc.returncode == 0, proc.stdout[-5000:] + proc.stderr[-5000:]
    cases = (
        "default",
        "gpu",
        "external-redis",
        "monitoring",
        "multinode",
        "kueue-job",
        "kueue-jobset",
        "reward-servers",
    )
    for case in cases:
        assert f"helm lint + template ({case})" in proc.stdout
    assert proc.stdout.count("objects valid against Kubernetes") == 2 * len(cases)
    assert "compose OK: docker-compose.yml + docker-compose.gpu.yml" in proc.stdout
    assert proc.stdout.rstrip().endswith("deploy checks passed")


def test_manifest_check_rejects_unknown_fields_and_bad_values(tmp_path):
    path = tmp_path / "bad.yaml"
    deployment = """
apiVersion: apps/v1
kind: Deployment
metadata: {name: %s}
spec:
  replicas: %s
  selector: {matchLabels: {a: b}}
  template:
    metadata: {labels: {a: b}}
    spec:
      containers:
        - {name: c, image: i, startupProbe: %s}
---"""
    path.write_text(
        deployment % ("unknown-field", 1, "{grpcc: {port: 1}}")
        + deployment % ("bad-value", '"two"', "{grpc: {port: 1}}")
        + deployment % ("good", 1, "{grpc: {port: 1}}")
        + """
apiVersion: monitoring.coreos.com/v1
kind: ServiceMonitor
metadata: {name: m}
spec:
  selector: {}
  endpoints: [{port: metrics, intervall: 15s}]
"""
    )
    proc = subprocess.run(
        [sys.executable, "scripts/check_manifests.py", str(path)], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 1
    assert "Deployment/unknown-field: spec.template.spec.containers.0.startupProbe" in proc.stderr
    assert "'grpcc' was unexpected" in proc.stderr
    assert "Deployment/bad-value: spec.replicas" in proc.stderr
    assert "Deployment/good" not in proc.stderr
    assert "ServiceMonitor/m: spec.endpoints[0].intervall: unknown field" in proc.stderr


def test_manifest_check_holds_custom_resources_to_their_schemas(tmp_path):
    path = tmp_path / "crds.yaml"
    path.write_text("""
apiVersion: jobset.x-k8s.io/v1alpha2
kind: JobSet
metadata: {name: typo}
spec:
  successPolicy: {operator: All, targetReplicatedJob: [learner]}
  replicatedJobs: []
---
apiVersion: jobset.x-k8s.io/v1alpha2
kind: JobSet
metadata: {name: bad-pod}
spec:
  replicatedJobs:
    - name: learner
      template:
        spec:
          template:
            spec:
              restartPolicy: Never
              containers: [{name: c, image: i, gpus: 1}]
---
apiVersion: jobset.x-k8s.io/v1alpha2
kind: JobSet
metadata: {name: good}
spec:
  successPolicy: {operator: All, targetReplicatedJobs: [learner]}
  replicatedJobs:
    - name: learner
      replicas: 1
      template:
        spec:
          template:
            spec:
              restartPolicy: Never
              containers: [{name: c, image: i}]
---
apiVersion: kueue.x-k8s.io/v1beta1
kind: LocalQueue
metadata: {name: q}
spec: {clusterQueue: Cluster_Queue}
---
apiVersion: monitoring.coreos.com/v1
kind: PrometheusRule
metadata: {name: r}
spec:
  groups: [{name: g, rules: [{alert: A, expr: up == 0, forr: 5m}]}]
""")
    proc = subprocess.run(
        [sys.executable, "scripts/check_manifests.py", str(path)], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 1
    assert (
        "JobSet/typo: spec.successPolicy: Additional properties are not allowed ('targetReplicatedJob'" in proc.stderr
    )
    assert "JobSet/bad-pod: spec.replicatedJobs.0.template.spec.template.spec.containers.0: " in proc.stderr
    assert "'gpus' was unexpected" in proc.stderr
    assert "JobSet/good" not in proc.stderr
    assert "LocalQueue/q: spec.clusterQueue: 'Cluster_Queue' does not match" in proc.stderr
    assert "PrometheusRule/r: spec.groups[0].rules[0].forr: unknown field" in proc.stderr
