"""Writes deploy/helm/openmanus-rl/values.schema.json: the chart's own values, and under `config` the
JSON schema of services/common/config.py TrainConfig, so that `helm install/lint/template` rejects a
run config the services would reject (unknown fields, out-of-range values).

    python scripts/gen_helm_schema.py          # rewrite the file
    python scripts/gen_helm_schema.py --check  # exit 1 if the file is not what this script writes
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
OUT = ROOT / "deploy/helm/openmanus-rl/values.schema.json"

STRING, BOOL, OBJECT, ARRAY = ({"type": "string"}, {"type": "boolean"}, {"type": "object"}, {"type": "array"})
PORT = {"type": "integer", "minimum": 1, "maximum": 65535}
QUANTITY = {
    "anyOf": [
        {"type": "string", "pattern": r"^[0-9]+(\.[0-9]+)?(m|k|M|G|T|P|E|Ki|Mi|Gi|Ti|Pi|Ei)?$"},
        {"type": "number", "minimum": 0},
    ]
}


def obj(properties: dict, required: tuple[str, ...] = ()) -> dict:
    """A closed object: a misspelt key fails validation instead of being ignored."""
    out = {"type": "object", "additionalProperties": False, "properties": properties}
    if required:
        out["required"] = list(required)
    return out


def count(minimum: int = 0, maximum: int | None = None) -> dict:
    out = {"type": "integer", "minimum": minimum}
    if maximum is not None:
        out["maximum"] = maximum
    return out


# an extended resource name: nvidia.com/gpu, nvidia.com/mig-1g.10gb, amd.com/gpu; empty: the chart-wide one
GPU_RESOURCE = {
    "type": "string",
    "pattern": r"^([a-z0-9]([-a-z0-9.]*[a-z0-9])?/[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?)?$",
}
DNS_NAME_OR_EMPTY = {"type": "string", "pattern": r"^([a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?)?$"}
RESOURCES = obj({key: {"type": "object", "additionalProperties": QUANTITY} for key in ("requests", "limits")})
IMAGE_OVERRIDE = obj({"repository": STRING, "tag": STRING})


def component(*, grpc: bool, gpu: bool = False, extra: dict | None = None) -> dict:
    props = {
        "image": IMAGE_OVERRIDE,
        "resources": RESOURCES,
        "metricsPort": PORT,
        "extraArgs": {"type": "array", "items": STRING},
        "extraEnv": {"type": "array", "items": OBJECT},
        "readOnlyRootFilesystem": BOOL,
        "nodeSelector": {"type": "object", "additionalProperties": STRING},
        "tolerations": {"type": "array", "items": OBJECT},
        "affinity": OBJECT,
        "podAnnotations": {"type": "object", "additionalProperties": STRING},
        "runtimeClassName": STRING,
    }
    if grpc:
        props.update(replicas=count(0), port=PORT)
    if gpu:
        props.update(
            flavor={"enum": ["cpu", "cuda"]}, gpus=count(0, 16), shmSizeLimit=QUANTITY, gpuResourceName=GPU_RESOURCE
        )
    props.update(extra or {})
    return obj(props)


def probe_timing(period_min: int = 1) -> dict:
    return obj(
        {"periodSeconds": count(period_min), "failureThreshold": count(1)}, ("periodSeconds", "failureThreshold")
    )


def train_config_schema() -> tuple[dict, dict]:
    """(schema of `config`, its $defs): pydantic's schema with every default made optional, as the
    services fill in defaults themselves."""
    from services.common.config import TrainConfig

    schema = TrainConfig.model_json_schema()
    defs = schema.pop("$defs", {})
    schema.pop("title", None)
    return schema, defs


def build() -> dict:
    from services.common.logs import FORMATS as LOG_FORMATS

    config, defs = train_config_schema()
    config["description"] = (
        "Run config (services/common/config.py TrainConfig); rendered into the ConfigMap "
        "every service reads with --config."
    )
    return {
        "$schema": "http://json-schema.org/draft-07/schema#",
        "title": "openmanus-rl chart values",
        **obj(
            {
                "nameOverride": STRING,
                "fullnameOverride": STRING,
                "image": obj(
                    {
                        "repository": STRING,
                        "tag": STRING,
                        "pullPolicy": {"enum": ["Always", "IfNotPresent", "Never"]},
                        "pullSecrets": {"type": "array", "items": STRING},
                    }
                ),
                "logFormat": {"enum": list(LOG_FORMATS)},
                "config": config,
                "security": obj({"runAsUser": count(1), "runAsGroup": count(1), "fsGroup": count(1)}),
                "scratch": obj({"tmpSizeLimit": QUANTITY, "cacheSizeLimit": QUANTITY}),
                "modelVolume": OBJECT,
                "nodeSelector": {"type": "object", "additionalProperties": STRING},
                "tolerations": {"type": "array", "items": OBJECT},
                "priorityClassName": STRING,
                "gpu": obj(
                    {
                        "resourceName": {**GPU_RESOURCE, "minLength": 1},
                        "tolerations": {"type": "array", "items": OBJECT},
                        "nodeSelector": {"type": "object", "additionalProperties": STRING},
                        "runtimeClassName": STRING,
                    }
                ),
                "datasets": obj({"volume": OBJECT, "readOnly": BOOL}),
                "kueue": obj(
                    {
                        "queueName": DNS_NAME_OR_EMPTY,
                        "priorityClass": DNS_NAME_OR_EMPTY,
                        "clusterQueue": DNS_NAME_OR_EMPTY,
                    }
                ),
                "alerts": obj({"enabled": BOOL, "labels": {"type": "object", "additionalProperties": STRING}}),
                "probes": obj(
                    {
                        "timeoutSeconds": count(1),
                        "startup": probe_timing(),
                        "readiness": probe_timing(),
                        "liveness": probe_timing(),
                    }
                ),
                "envs": component(grpc=True),
                "reward": component(grpc=True),
                "rollout": component(grpc=True, gpu=True, extra={"startupProbe": probe_timing()}),
                "learner": component(
                    grpc=False,
                    gpu=True,
                    extra={
                        "nodes": count(1, 512),
                        "rendezvousPort": PORT,
                        "backoffLimit": count(0),
                        "ttlSecondsAfterFinished": {"type": ["integer", "null"], "minimum": 0},
                        "workload": {"enum": ["Job", "JobSet"]},
                        "activeDeadlineSeconds": {"type": ["integer", "null"], "minimum": 1},
                        "probes": obj(
                            {
                                "startupPeriodSeconds": count(1),
                                "startupFailureThreshold": count(1),
                                "livenessPeriodSeconds": count(1),
                                "livenessFailureThreshold": count(1),
                                "timeoutSeconds": count(1),
                            }
                        ),
                        "persistence": obj(
                            {
                                "enabled": BOOL,
                                "existingClaim": STRING,
                                "storageClass": STRING,
                                "volume": OBJECT,
                                "accessModes": {
                                    "type": "array",
                                    "items": {"enum": ["ReadWriteOnce", "ReadWriteMany", "ReadWriteOncePod"]},
                                },
                                "size": QUANTITY,
                            }
                        ),
                    },
                ),
                "jobsApi": obj(
                    {
                        "enabled": BOOL,
                        "port": PORT,
                        "service": obj({"type": {"enum": ["ClusterIP", "NodePort", "LoadBalancer"]}}),
                        "auth": obj({"token": STRING, "existingSecret": STRING, "existingSecretKey": STRING}),
                        "jobImages": obj({"cpu": STRING, "cuda": STRING}),
                        "jobWorkload": {"enum": ["", "Job", "JobSet"]},
                        "persistence": obj(
                            {"enabled": BOOL, "existingClaim": STRING, "storageClass": STRING, "size": QUANTITY}
                        ),
                        "ingressFrom": {"type": "array", "items": OBJECT},
                        **{k: v for k, v in component(grpc=False)["properties"].items() if k != "metricsPort"},
                    }
                ),
                "redis": obj(
                    {
                        "enabled": BOOL,
                        "image": obj({"repository": STRING, "tag": STRING}),
                        "auth": obj({"password": STRING, "existingSecret": STRING, "existingSecretKey": STRING}),
                        "persistence": obj({"enabled": BOOL, "storageClass": STRING, "size": QUANTITY}),
                        "resources": RESOURCES,
                    }
                ),
                "externalRedis": obj(
                    {
                        "host": STRING,
                        "port": PORT,
                        "db": count(0, 15),
                        "tls": BOOL,
                        "existingSecret": STRING,
                        "existingSecretKey": STRING,
                    }
                ),
                "metrics": obj(
                    {
                        "serviceMonitor": obj(
                            {
                                "enabled": BOOL,
                                "interval": STRING,
                                "scrapeTimeout": STRING,
                                "labels": {"type": "object", "additionalProperties": STRING},
                            }
                        )
                    }
                ),
                "grafana": obj(
                    {
                        "dashboards": obj(
                            {
                                "enabled": BOOL,
                                "labels": {"type": "object", "additionalProperties": STRING},
                                "annotations": {"type": "object", "additionalProperties": STRING},
                            }
                        )
                    }
                ),
                "weightPush": obj({"existingSecret": STRING, "existingSecretKey": STRING}),
                "networkPolicy": obj(
                    {
                        "enabled": BOOL,
                        "monitoringNamespace": STRING,
                        "metricsFrom": {"type": "array", "items": OBJECT},
                        "modelDownloadEgress": {"type": "array", "items": OBJECT},
                        "envsExtraEgress": {"type": "array", "items": OBJECT},
                        "rewardExtraEgress": {"type": "array", "items": OBJECT},
                        "redisExtraFrom": {"type": "array", "items": OBJECT},
                    }
                ),
                # helm passes the values of subcharts and `global` to every chart; this chart has none
                "global": OBJECT,
            }
        ),
        "$defs": defs,
    }


def render() -> str:
    return json.dumps(build(), indent=2, sort_keys=False) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="compare instead of writing")
    args = parser.parse_args()
    text = render()
    if args.check:
        if not OUT.exists() or OUT.read_text() != text:
            print(f"{OUT.relative_to(ROOT)} is stale: run python scripts/gen_helm_schema.py", file=sys.stderr)
            return 1
        return 0
    OUT.write_text(text)
    print(f"wrote {OUT.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
