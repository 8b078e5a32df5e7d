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
    proc = subprocess.run(["bash", "scripts/ci_deploy_checks.sh"], cwd=ROOT, capture_output=True, text=True,
                          timeout=900, env={**os.environ, "PYTHON": sys.executable})
    assert proc.returncode == 0, proc.stdout[-5000:] + proc.stderr[-5000:]
    for case in ("default", "gpu", "external-redis", "monitoring", "multinode", "kueue-job", "kueue-jobset"):
        assert f"helm lint + template ({case})" in proc.stdout
    assert proc.stdout.count("objects valid against Kubernetes") == 14
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
    path.write_text(deployment % ("unknown-field", 1, "{grpcc: {port: 1}}")
                    + deployment % ("bad-value", '"two"', "{grpc: {port: 1}}")
                    + deployment % ("good", 1, "{grpc: {port: 1}}") + """
apiVersion: monitoring.coreos.com/v1
kind: ServiceMonitor
metadata: {name: m}
spec:
  selector: {}
  endpoints: [{port: metrics, intervall: 15s}]
""")
    proc = subprocess.run([sys.executable, "scripts/check_manifests.py", str(path)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert "Deployment/unknown-field: spec.template.spec.containers.0.startupProbe" in proc.stderr
    assert "'grpcc' was unexpected" in proc.stderr
    assert "Deployment/bad-value: spec.replicas" in proc.stderr
    assert "Deployment/good" not in proc.stderr
    assert "ServiceMonitor/m: spec.endpoints[0].intervall: unknown field" in proc.stderr
