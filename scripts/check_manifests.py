"""Validates rendered Kubernetes manifests offline: python scripts/check_manifests.py [-k 1.31.0] FILE...

Every object is checked against Kubernetes' own OpenAPI schemas for that version with unknown fields
rejected (kubernetes-validate --strict). ServiceMonitors, which are a CRD, are checked against the
prometheus-operator models (cloudcoil-models-prometheus-operator: types and patterns), with unknown
fields rejected here. Exits 1 and prints every problem if any."""
from __future__ import annotations

import argparse
import sys
import typing
from pathlib import Path
from typing import Any

import yaml

DEFAULT_VERSION = "1.31.0"


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
            items = value if isinstance(value, list) else value.values() if isinstance(value, dict) and \
                _is_mapping(fields[key].annotation) else [value]
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
    if origin in (dict, typing.Dict):
        return True
    return any(_is_mapping(arg) for arg in typing.get_args(annotation))


def check_service_monitor(doc: dict) -> list[str]:
    from cloudcoil.models.prometheus_operator.v1 import ServiceMonitor
    from pydantic import ValidationError

    try:
        ServiceMonitor.model_validate(doc)
    except ValidationError as exc:
        return [str(exc)]
    return unknown_fields(ServiceMonitor, doc)


def check_documents(docs: list[dict], version: str = DEFAULT_VERSION) -> list[str]:
    import kubernetes_validate
    from kubernetes_validate.utils import SchemaNotFoundError

    problems = []
    for doc in docs:
        label = f"{doc.get('kind')}/{(doc.get('metadata') or {}).get('name')}"
        if doc.get("kind") == "ServiceMonitor":
            problems += [f"{label}: {p}" for p in check_service_monitor(doc)]
            continue
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except SchemaNotFoundError:
            problems.append(f"{label}: no schema for {doc.get('apiVersion')} {doc.get('kind')} in Kubernetes {version}")
        except kubernetes_validate.ValidationError as exc:
            where = ".".join(str(p) for p in exc.path)
            problems.append(f"{label}: {where}: {exc.message}")
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
