"""`omrl config show` and `omrl config explain`: the effective config with each value's source, and what a
field means (type, bounds, default, valid choices, docstring), from the schema itself."""

from __future__ import annotations

import json
import sys
from typing import Any

from pydantic import BaseModel

from services import plugins
from services.common.config_cli import FieldDoc, Resolved, find_field, plugin_names, type_name, walk
from services.common.config_layers import ENV_PREFIX


def _text(value: Any) -> str:
    if isinstance(value, BaseModel):
        value = value.model_dump(mode="json")
    if isinstance(value, dict):
        value = {k: v.model_dump(mode="json") if isinstance(v, BaseModel) else v for k, v in value.items()}
    return "null" if value is None else json.dumps(value) if isinstance(value, (dict, list)) else str(value)


def show(resolved: Resolved, changed_only: bool = False, as_json: bool = False) -> str:
    rows = resolved.rows(changed_only)
    if as_json:
        return json.dumps(
            {
                path: {"value": json.loads(json.dumps(value, default=_text)), "source": source}
                for path, value, source in rows
            },
            indent=1,
        )
    if sys.stdout.isatty():
        from rich.console import Console
        from rich.table import Table

        table = Table("field", "value", "source", box=None, pad_edge=False)
        colors = {"default": "dim", "file": "green", "env": "magenta", "flag": "cyan", "derived": "yellow"}
        for path, value, source in rows:
            table.add_row(path, _text(value), f"[{colors[source]}]{source}[/]")
        console = Console()
        with console.capture() as capture:
            console.print(table)
        return capture.get().rstrip()
    width = max((len(path) for path, _, _ in rows), default=5)
    return "\n".join(f"{path:<{width}}  {source:<7}  {_text(value)}" for path, value, source in rows)


def explain(schema: type[BaseModel], path: str) -> str:
    if not path:
        return "\n".join(
            f"{d.path:<10} {d.doc.splitlines()[0] if d.doc else type_name(d.annotation)}"
            for d in walk(schema)
            if "." not in d.path
        )
    doc = find_field(schema, path)
    if doc.section:
        depth = doc.path.count(".") + 1
        fields = [d for d in walk(schema) if d.path.startswith(doc.path + ".") and d.path.count(".") == depth]
        width = max(len(d.path) for d in fields)
        return "\n".join(
            [f"{doc.path}: {doc.doc or type_name(doc.annotation)}", ""]
            + [f"  {d.path:<{width}}  {_first_sentence(d.doc) or type_name(d.annotation)}" for d in fields]
            + ["", f"omrl config explain {fields[0].path} (and so on) for one field"]
        )
    return _explain_field(doc)


def _first_sentence(doc: str) -> str:
    line = " ".join(doc.split())
    return line if len(line) <= 90 else line[:87] + "..."


def _explain_field(doc: FieldDoc) -> str:
    lines = [
        doc.path,
        f"  type     {type_name(doc.annotation)}" + (f" ({doc.bounds})" if doc.bounds else ""),
        f"  default  {_text(doc.default)}",
    ]
    valid = plugin_names(doc.plugin) if doc.plugin else list(doc.literal)
    if valid:
        lines.append(f"  {'keys' if doc.plugin == 'reward' else 'choices':<8} {', '.join(valid)}")
    env_name = ENV_PREFIX + "__".join(doc.path.upper().split("."))
    lines.append(f"  set by   --{doc.path} VALUE | --set {doc.path}=VALUE | {env_name}=VALUE")
    if doc.doc:
        lines += ["", *("  " + line for line in doc.doc.splitlines())]
    lines += _plugin_options(doc.path)
    return "\n".join(lines)


def _plugin_options(path: str) -> list[str]:
    """env.options and reward.components take what each plugin declares: list it."""
    out: list[str] = []
    try:
        if path == "env.options":
            out = ["", "  options of each env:"]
            for name in plugin_names("env"):
                fields = plugins.options_model("env", name).model_fields
                out.append(f"    {name:<13} {', '.join(_param(n, f) for n, f in fields.items()) or '(none)'}")
        elif path == "reward.components":
            out = ["", "  params of each reward function:"]
            for name in plugin_names("reward"):
                fields = plugins.options_model("reward", name).model_fields
                out.append(f"    {name:<15} {', '.join(_param(n, f) for n, f in fields.items()) or '(none)'}")
    except ImportError:  # a plugin whose package this install lacks
        pass
    return out


def _param(name: str, info: Any) -> str:
    default = "required" if info.is_required() else f"default {_text(info.get_default(call_default_factory=True))}"
    return f"{name} ({type_name(info.annotation)}, {default})"
