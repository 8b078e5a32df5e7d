"""Writes deploy/helm/openmanus-rl/values.schema.json: the chart's own values, and under `config` the
JSON schema of services/common/config.py TrainConfig, so that `helm install/lint/template` rejects a
run config the services would reject (unknown fields, out-of-range values, plugin names no registry
knows, an env's options or a reward function's params that plugin does not take).

    python scripts/gen_helm_schema.py          # rewrite the file
    python scripts/gen_helm_schema.py --check  # exit 1 if the file is not what this script writes
    python scripts/gen_helm_schema.py --import my_package.envs  # also your plugins (an image of your own)
    python scripts/gen_helm_schema.py --output /tmp/values.schema.json  # write elsewhere
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import typing
from pathlib import Path
from typing import Any

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


def reward_servers() -> dict:
    """`reward.servers` (name -> a server: its reward components and pod settings) and `reward.serverDefaults`."""
    pod = {k: v for k, v in component(grpc=False, gpu=True)["properties"].items() if k != "metricsPort"}
    pod.update(
        replicas=count(1),
        flavor={"enum": ["", "cpu", "cuda"]},
        image=obj({"component": {"enum": ["", "reward", "rollout"]}, "repository": STRING, "tag": STRING}),
        modelVolume=OBJECT,
        startupProbe=probe_timing(),
    )
    # the same components as config.reward.components, at least one
    components = {"allOf": [{"$ref": "#/$defs/RewardConfig/properties/components"}], "minProperties": 1}
    server = obj({**pod, "components": components}, ("components",))
    # a DNS label once prefixed <release>-reward-
    name = {"pattern": "^[a-z]([-a-z0-9]{0,13}[a-z0-9])?$"}
    return {
        "servers": {"type": "object", "propertyNames": name, "additionalProperties": server},
        "serversWeight": {"type": "number", "minimum": -1000, "maximum": 1000},
        "serversTimeoutSeconds": {"type": "number", "exclusiveMinimum": 0, "maximum": 3600},
        "serverDefaults": obj(pod),
    }


def sandbox(defs: dict) -> dict:
    """`sandbox`: the python toolset's sandbox server (templates/sandbox.yaml). Its `options` are the python toolset's
    (PythonOptions) without the client side's `endpoint` and `token_env`: the server runs the code itself and reads
    its token from OMRL_SANDBOX_TOKEN."""
    from services import plugins

    try:
        ref = model_schema(plugins.options_model("toolset", "python"), defs, "sandbox_options")
        options = defs["sandbox_options"]
        for client_only in ("endpoint", "token_env"):
            options["properties"].pop(client_only, None)
        options["additionalProperties"] = False
    except Exception as exc:  # the server still checks them
        ref = open_object("sandbox.options", exc)
    # a pod's seccompProfile or a container's appArmorProfile (Kubernetes' SeccompProfile / AppArmorProfile)
    profile = {
        **obj({"type": {"enum": ["Unconfined", "RuntimeDefault", "Localhost"]}, "localhostProfile": STRING}, ("type",)),
        "if": {"properties": {"type": {"const": "Localhost"}}},
        "then": {"required": ["localhostProfile"]},
    }
    pod = {k: v for k, v in component(grpc=True)["properties"].items() if k != "metricsPort"}
    return obj(
        {
            **pod,
            "enabled": BOOL,
            "options": ref,
            "workspaceTtlSeconds": {"type": "number", "exclusiveMinimum": 0},
            "workspaceSizeLimit": QUANTITY,
            "auth": obj({"existingSecret": STRING, "existingSecretKey": {**STRING, "minLength": 1}}),
            "seccompProfile": profile,
            "appArmorProfile": {"anyOf": [profile, {"type": "null"}]},
            "procMount": {"enum": ["Default", "Unmasked"]},
            "hostUsers": BOOL,
        }
    )


def train_config_schema() -> tuple[dict, dict]:
    """(schema of `config`, its $defs): pydantic's schema with every default made optional, as the
    services fill in defaults themselves; plugin names, env options and reward params constrained to
    what the registries hold."""
    from services.common.config import EnvConfig, RewardConfig, TrainConfig

    schema = TrainConfig.model_json_schema()
    defs = schema.pop("$defs", {})
    schema.pop("title", None)
    constrain_plugin_names(TrainConfig, defs)
    defs[EnvConfig.__name__]["allOf"] = env_options_conditions(defs, EnvConfig.model_fields["name"].default)
    components = defs[RewardConfig.__name__]["properties"]["components"]
    components["properties"], typed = reward_components(defs, defs.pop("RewardComponentConfig"))
    # any other name runs the function its `type` names (services.common.config.RewardComponentConfig.type)
    pattern = components.pop("patternProperties")
    components["propertyNames"] = {**components.get("propertyNames", {}), "pattern": next(iter(pattern))}
    components["propertyNames"].pop("enum", None)
    components["additionalProperties"] = {"anyOf": typed}
    return schema, defs


# -- plugin choices: the names and option schemas services/plugins.py lists ---------------------------------
def plugin_names(kind: str) -> list[str]:
    from services import plugins

    return plugins.names(kind)


def plugin_kind(metadata: typing.Iterable[Any]) -> str | None:
    from services.common.choices import PluginChoice

    return next((item.kind for item in metadata if isinstance(item, PluginChoice)), None)


def constrain_plugin_names(model: type, defs: dict) -> None:
    """An enum on every plugin-name field (a dict keyed by plugin names: on its keys), in every section."""
    from pydantic import BaseModel

    for name, field in model.model_fields.items():
        annotation = field.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            constrain_plugin_names(annotation, defs)
            continue
        node = defs.get(model.__name__, {}).get("properties", {}).get(name)
        if node is None:
            continue
        if kind := plugin_kind(field.metadata):
            node["enum"] = plugin_names(kind)
        elif typing.get_origin(annotation) is dict:
            key = typing.get_args(annotation)[0]
            if kind := plugin_kind(getattr(key, "__metadata__", ())):
                node["propertyNames"] = {"enum": plugin_names(kind)}


def model_schema(model: type, defs: dict, name: str) -> dict:
    """`model`'s schema stored as `defs[name]` (its own nested models beside it, prefixed), as a $ref."""
    schema = model.model_json_schema(ref_template=f"#/$defs/{name}.{{model}}")
    for sub, sub_schema in schema.pop("$defs", {}).items():
        defs[f"{name}.{sub}"] = sub_schema
    defs[name] = schema
    return {"$ref": f"#/$defs/{name}"}


def open_object(what: str, exc: Exception) -> dict:
    print(f"warning: {what} left unchecked: {exc!r}", file=sys.stderr)
    return {"type": "object"}


def env_options_conditions(defs: dict, default_env: str) -> list[dict]:
    """If env.name is X (the default when absent), options follow X's `Options` model."""
    from services import plugins

    conditions = []
    for env in plugin_names("env"):
        try:
            options = model_schema(plugins.options_model("env", env), defs, f"env_options.{env}")
        except Exception as exc:  # an env this process cannot import or describe: the services still check
            options = open_object(f"options of env {env!r}", exc)
        when = {"properties": {"name": {"const": env}}}
        if env != default_env:
            when["required"] = ["name"]
        conditions.append({"if": when, "then": {"properties": {"options": options}}})
    return conditions


def reward_components(defs: dict, component: dict) -> tuple[dict, list]:
    """(reward function name -> the schema of a component by that name: that function's params, `type` empty or
    the same name; the schemas of a component of another name: one per function, its `type` required)."""
    from services import plugins

    named, typed = {}, []
    for name in plugin_names("reward"):
        try:
            params = model_schema(plugins.options_model("reward", name), defs, f"reward_params.{name}")
        except Exception as exc:
            params = open_object(f"params of reward function {name!r}", exc)
        fields = {**component["properties"], "params": params}
        named[name] = {**component, "properties": {**fields, "type": {"enum": ["", name]}}}
        typed.append({**component, "properties": {**fields, "type": {"const": name}}, "required": ["type"]})
    return named, typed


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
                "sandbox": sandbox(defs),
                "reward": component(grpc=True, extra=reward_servers()),
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
                        "specPolicy": obj(
                            {
                                "allowedEnvHosts": {"type": "array", "items": STRING},
                                "envOptions": {"type": "object", "additionalProperties": OBJECT},
                                "extraEngineArgs": {"type": "array", "items": STRING},
                                "allowedImages": {"type": "array", "items": STRING},
                                "allowedVolumeClaims": {"type": "array", "items": STRING},
                            }
                        ),
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
                "weightPush": obj({"existingSecret": STRING, "existingSecretKey": STRING, "socketIfname": STRING}),
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
    from services.common.config_cli import add_import_flag

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="compare instead of writing")
    add_import_flag(parser, "its plugins register (repeatable): the schema of an image of your own")
    parser.add_argument("--output", type=Path, default=OUT, help=f"the file to write or check (default: {OUT})")
    args = parser.parse_args()
    for module in args.imports:
        importlib.import_module(module)
    text, out = render(), args.output.resolve()
    if args.check:
        if not out.exists() or out.read_text() != text:
            print(f"{out} is stale: run python scripts/gen_helm_schema.py", file=sys.stderr)
            return 1
        return 0
    out.write_text(text)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
