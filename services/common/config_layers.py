"""The layers a run config is merged from, each a nested dict: a file, `--set a.b=value` overrides and
`OMRL_CONFIG__A__B=value` environment variables (values read as YAML); `merge_layers` applies one over
another. `services.common.config.load_config` merges a file and overrides, `services.common.config_cli`
every layer of a command line. A bad file or override raises ConfigError, one line per problem."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

ENV_PREFIX = "OMRL_CONFIG__"
"""`OMRL_CONFIG__ALGORITHM__ADVANTAGE=rloo` is `--set algorithm.advantage=rloo` (the value is read as YAML)."""


class ConfigError(ValueError):
    """A bad file, override, flag or value: one line per problem, each naming the field."""

    def __init__(self, lines: list[str]):
        super().__init__("; ".join(lines))
        self.lines = lines


def set_layer(items: list[str]) -> dict[str, Any]:
    """`a.b.c=value` overrides (values read as YAML) as one nested dict."""
    data: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ConfigError([f"--set {item!r}: expected KEY=VALUE, e.g. --set learner.steps=10"])
        _put(data, key.split("."), _yaml(raw, f"--set {key}"), f"--set {key}")
    return data


def env_layer(environ: dict[str, str]) -> dict[str, Any]:
    data: dict[str, Any] = {}
    for name, raw in sorted(environ.items()):
        if name.upper().startswith(ENV_PREFIX) and len(name) > len(ENV_PREFIX):
            path = [p.lower() for p in name[len(ENV_PREFIX) :].split("__")]
            _put(data, path, _yaml(raw, name), name)
    return data


def file_layer(path: str | None) -> dict[str, Any]:
    if not path:
        return {}
    try:
        data = yaml.safe_load(Path(path).read_text())
    except OSError as exc:
        raise ConfigError([f"{path}: {exc.strerror or exc}"]) from None
    except yaml.YAMLError as exc:
        raise ConfigError([f"{path}: not valid YAML: {' '.join(str(exc).split())}"]) from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError([f"{path}: expected a mapping of config sections, got {type(data).__name__}"])
    return data


def _yaml(raw: str, where: str) -> Any:
    try:
        return yaml.safe_load(raw)
    except yaml.YAMLError as exc:
        raise ConfigError([f"{where}: value is not valid YAML: {' '.join(str(exc).split())}"]) from None


def _put(data: dict[str, Any], path: list[str], value: Any, where: str) -> None:
    node = data
    for part in path[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError([f"{where}: {part} is set to a value, not a section"])
    node[path[-1]] = value


def merge_layers(base: dict[str, Any], update: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict) and value:
            out[key] = merge_layers(out[key], value)
        else:
            out[key] = value
    return out
