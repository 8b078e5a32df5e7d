"""Validates compose files without a Docker engine: python scripts/check_compose.py FILE [FILE ...]

The first file, and its merge with each further one in the order given (as `docker compose -f A
-f B` merges them), is interpolated the way Compose does (`${VAR}`, `${VAR:-default}`, `${VAR:?error}`,
`$$`) with placeholder values for the variables it requires, then parsed and checked by `compose-spec` (the Rust
compose_spec library: the Compose specification's fields, types and references). Then the project's
own rules: every service has a healthcheck, and every `depends_on` waits for `service_healthy`.
Exits 1 and prints every problem if any."""

from __future__ import annotations

import copy
import json
import re
import sys
from pathlib import Path
from typing import Any

import yaml

_VAR = re.compile(
    r"\$(?:(?P<escaped>\$)|\{(?P<name>[A-Za-z_][A-Za-z0-9_]*)(?:(?P<op>:?[-?])(?P<arg>[^}]*))?\}"
    r"|(?P<bare>[A-Za-z_][A-Za-z0-9_]*))"
)


class MissingVariable(ValueError):
    pass


def interpolate(value: Any, env: dict[str, str]) -> Any:
    """Compose interpolation over every string of a loaded document."""
    if isinstance(value, dict):
        return {key: interpolate(item, env) for key, item in value.items()}
    if isinstance(value, list):
        return [interpolate(item, env) for item in value]
    if not isinstance(value, str):
        return value

    def substitute(match: re.Match) -> str:
        if match["escaped"]:
            return "$"
        name = match["name"] or match["bare"]
        op, arg, current = match["op"], match["arg"] or "", env.get(name)
        unset_or_empty = current is None or (current == "" and op and op.startswith(":"))
        if op in ("-", ":-"):
            return arg if unset_or_empty else current
        if op in ("?", ":?"):
            if unset_or_empty:
                raise MissingVariable(f"{name}: {arg or 'required'}")
            return current
        return current or ""

    return _VAR.sub(substitute, value)


def required_variables(text: str) -> set[str]:
    return {m["name"] for m in _VAR.finditer(text) if m["op"] in ("?", ":?")}


def merge(base: dict, override: dict) -> dict:
    """Compose's merge of -f files for what these files use: mappings merge, `command` and other
    sequences are replaced, except `volumes`/`ports` which are appended."""
    out = copy.deepcopy(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        elif key in ("volumes", "ports") and isinstance(value, list) and isinstance(out.get(key), list):
            out[key] = out[key] + [v for v in value if v not in out[key]]
        else:
            out[key] = copy.deepcopy(value)
    return out


def project_problems(doc: dict) -> list[str]:
    problems = []
    for name, service in (doc.get("services") or {}).items():
        if not (service.get("healthcheck") or {}).get("test"):
            problems.append(f"service {name}: no healthcheck")
        depends = service.get("depends_on") or {}
        if isinstance(depends, list):
            problems.append(f"service {name}: depends_on must give condition: service_healthy")
            continue
        for dep, spec in depends.items():
            if (spec or {}).get("condition") != "service_healthy":
                problems.append(f"service {name}: depends_on {dep} does not wait for service_healthy")
    return problems


def check(paths: list[Path]) -> list[str]:
    from compose_spec import PyCompose

    texts = [path.read_text() for path in paths]
    env = {name: "placeholder" for text in texts for name in required_variables(text)}
    problems, merged = [], {}
    for i, text in enumerate(texts):
        merged = merge(merged, interpolate(yaml.safe_load(text), env))
        label = " + ".join(map(str, paths[: i + 1]))
        try:
            PyCompose.from_json(json.dumps(merged)).validate()
        except ValueError as exc:
            problems.append(f"{label}: {exc}")
    problems += [f"{label}: {p}" for p in project_problems(merged)]
    return problems


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__, file=sys.stderr)
        return 2
    problems = check([Path(arg) for arg in argv])
    for problem in problems:
        print(problem, file=sys.stderr)
    if not problems:
        print(f"compose OK: {' + '.join(argv)}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
