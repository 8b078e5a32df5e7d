#!/usr/bin/env bash
# Deployment checks that need no cluster and no Docker engine (CI runs this through
# tests/deploy/test_deploy_checks.py): values.schema.json and the chart README up to date; helm lint --strict
# and helm template for the default values, the GPU values, Kueue with a Job and with a JobSet, reward servers
# of their own, and other representative value sets; every rendered object against Kubernetes' schemas (the
# chart's oldest and newest supported versions) and the custom resources against theirs
# (scripts/check_manifests.py); the compose files against the Compose specification; the Prometheus config and
# alert rules with promtool.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
CHART=deploy/helm/openmanus-rl
HELM=$(bash scripts/get_helm.sh)
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
quiet() { "$@" 2> >(grep -v "found symbolic link in path" >&2); }

"$PY" scripts/gen_helm_schema.py --check
"$PY" scripts/gen_chart_readme.py --check

cases=(
  "default|"
  "gpu|-f $CHART/values-gpu.yaml"
  "external-redis|--set redis.enabled=false --set externalRedis.host=redis.example.internal --set externalRedis.existingSecret=redis-auth --set externalRedis.tls=true"
  "monitoring|--set metrics.serviceMonitor.enabled=true --set alerts.enabled=true --set redis.persistence.enabled=true --set jobsApi.auth.existingSecret=api-token"
  "multinode|-f $CHART/values-gpu.yaml --set learner.nodes=2 --set learner.persistence.accessModes={ReadWriteMany} --set networkPolicy.enabled=false --set jobsApi.enabled=false"
  "kueue-job|-f $CHART/values-gpu.yaml --set kueue.queueName=omrl-gpu --set kueue.clusterQueue=gpu-cluster --set gpu.resourceName=nvidia.com/mig-3g.40gb --set gpu.runtimeClassName=nvidia --set rollout.gpus=2"
  "kueue-jobset|-f $CHART/values-gpu.yaml --set learner.workload=JobSet --set learner.nodes=2 --set kueue.queueName=omrl-gpu --set kueue.priorityClass=training"
  "reward-servers|-f $CHART/values-gpu.yaml --set reward.servers.rm.components.reward_model.params.path=/models/rm --set reward.servers.rm.gpus=1 --set reward.servers.judge.components.reward_model.params.path=/models/judge --set reward.servers.judge.image.component=rollout --set modelVolume.persistentVolumeClaim.claimName=models --set metrics.serviceMonitor.enabled=true"
)
for case in "${cases[@]}"; do
  name=${case%%|*}
  read -r -a args <<< "${case#*|}"
  quiet "$HELM" lint --strict "$CHART" "${args[@]}" >/dev/null
  quiet "$HELM" template omrl "$CHART" --namespace omrl "${args[@]}" > "$out/$name.yaml"
  echo "helm lint + template ($name): $(grep -c '^kind:' "$out/$name.yaml") objects"
done
for version in 1.27.0 1.35.0; do
  "$PY" scripts/check_manifests.py -k "$version" "$out"/*.yaml
done

"$PY" scripts/check_compose.py docker-compose.yml docker-compose.gpu.yml
promtool check config --syntax-only deploy/prometheus/prometheus.yml
promtool check rules deploy/prometheus/alerts.yml
echo "deploy checks passed"
