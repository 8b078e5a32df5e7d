"""Validates rendered Kubernetes manifests offline: python scripts/check_manifests.py [-k 1.31.0] FILE...

Every object is checked against Kubernetes' own OpenAPI schemas for that version with unknown fields
rejected (kubernetes-validate --strict). Custom resources: ServiceMonitors and PrometheusRules against the
prometheus-operator models (cloudcoil-models-prometheus-operator: types and patterns), with unknown fields
rejected here; JobSets and Kueue LocalQueues against the JSON schemas in deploy/helm/crd-schemas (the JobSet
one generated from Kubeflow Trainer's published models, the LocalQueue one a hand-written subset), and each
Job template inside a JobSet as a batch/v1 Job against Kubernetes' schemas. Exits 1 and prints every problem
if any."""

from __future__ import annotations

import argparse
import functools
import json
import sys
import typing
from pathlib import Path
from typing import Any

import yaml

DEFAULT_VERSION = "1.31.0"
CRD_SCHEMAS = Path(__file__).resolve().parents[1] / "deploy/helm/crd-schemas"
JSON_SCHEMA_KINDS = {("jobset.x-k8s.io/v1alpha2", "JobSet"), ("kueue.x-k8s.io/v1beta1", "LocalQueue")}


def unknown_fields(model: type, data: Any, path: str = "") -> list[str]:
    """Keys of `data` that `model` (a pydantic model) does not define, at any depth."""
    from pydantic import BaseModel

    if not (isinstance(model, type) and issubclass(model, BaseModel)) or not isinstance(data, dict):
        return []
    fields = {(info.alias or name): info for name, info in model.model_fields.items()}
    problems = []
    for key, value in data.items():
        if key not in fields:
            problems.append(f"{path}{key}: unknown field")
            continue
        for inner in _models_in(fields[key].annotation):
            items = (
                value
                if isinstance(value, list)
                else value.values()
                if isinstance(value, dict) and _is_mapping(fields[key].annotation)
                else [value]
            )
            for i, item in enumerate(items):
                problems += unknown_fields(inner, item, f"{path}{key}{f'[{i}]' if isinstance(value, list) else ''}.")
    return problems


def _models_in(annotation: Any) -> list[type]:
    from pydantic import BaseModel

    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for arg in typing.get_args(annotation) for m in _models_in(arg)]


def _is_mapping(annotation: Any) -> bool:
    origin = typing.get_origin(annotation)
    if origin in (dict, dict):
        return True
    return any(_is_mapping(arg) for arg in typing.get_args(annotation))


def check_prometheus_operator(doc: dict) -> list[str]:
    from cloudcoil.models.prometheus_operator import v1
    from pydantic import ValidationError

    model = getattr(v1, doc["kind"])
    try:
        model.model_validate(doc)
    except ValidationError as exc:
        return [str(exc)]
    return unknown_fields(model, doc)


@functools.cache
def crd_validator(api_version: str, kind: str):
    import jsonschema

    path = CRD_SCHEMAS / f"{api_version.replace('/', '_')}_{kind}.json"
    schema = json.loads(path.read_text())
    return jsonschema.Draft202012Validator(schema)


def check_json_schema(doc: dict, version: str) -> list[str]:
    """A custom resource against its vendored schema; a JobSet's Job templates against Kubernetes' Job schema."""
    problems = []
    for err in crd_validator(doc["apiVersion"], doc["kind"]).iter_errors(doc):
        while err.context:  # an optional field is anyOf [its schema, null]: report the deepest reason
            err = max(err.context, key=lambda e: len(e.absolute_path))
        problems.append(f"{'.'.join(str(p) for p in err.absolute_path)}: {err.message}")
    if doc["kind"] == "JobSet" and not problems:
        for i, rjob in enumerate(doc["spec"].get("replicatedJobs") or []):
            job = {
                "apiVersion": "batch/v1",
                "kind": "Job",
                "metadata": {"name": rjob["name"]},
                **{k: v for k, v in rjob["template"].items() if k != "metadata"},
            }
            problems += [f"spec.replicatedJobs.{i}.template.{p}" for p in _kubernetes_problems(job, version)]
    return problems


def _kubernetes_problems(doc: dict, version: str) -> list[str]:
    import kubernetes_validate
    from kubernetes_validate.utils import SchemaNotFoundError

    try:
        kubernetes_validate.validate(doc, version, strict=True)
    except SchemaNotFoundError:
        return [f"no schema for {doc.get('apiVersion')} {doc.get('kind')} in Kubernetes {version}"]
    except kubernetes_validate.ValidationError as exc:
        return [f"{'.'.join(str(p) for p in exc.path)}: {exc.message}"]
    return []


def check_documents(docs: list[dict], version: str = DEFAULT_VERSION) -> list[str]:
    problems = []
    for doc in docs:
        label = f"{doc.get('kind')}/{(doc.get('metadata') or {}).get('name')}"
        if doc.get("apiVersion") == "monitoring.coreos.com/v1" and doc.get("kind") in (
            "ServiceMonitor",
            "PrometheusRule",
        ):
            found = check_prometheus_operator(doc)
        elif (doc.get("apiVersion"), doc.get("kind")) in JSON_SCHEMA_KINDS:
            found = check_json_schema(doc, version)
        else:
            found = _kubernetes_problems(doc, version)
        problems += [f"{label}: {p}" for p in found]
    return problems


def load(path: Path) -> list[dict]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-k", "--kubernetes-version", default=DEFAULT_VERSION)
    parser.add_argument("files", nargs="+", type=Path)
    args = parser.parse_args(argv)
    failed = False
    for path in args.files:
        docs = load(path)
        problems = check_documents(docs, args.kubernetes_version)
        for problem in problems:
            print(f"{path}: {problem}", file=sys.stderr)
        failed |= bool(problems) or not docs
        if not docs:
            print(f"{path}: no objects", file=sys.stderr)
        elif not problems:
            print(f"{path}: {len(docs)} objects valid against Kubernetes {args.kubernetes_version}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
