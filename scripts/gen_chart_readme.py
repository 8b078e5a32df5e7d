"""Writes deploy/helm/openmanus-rl/README.md: the hand-written README.md.tmpl with `@@VALUES@@` replaced by a
table of every values key, its default and the comment above it in values.yaml (helm-docs style: the comment
is the documentation, so the README cannot drift from the values).

    python scripts/gen_chart_readme.py          # rewrite the README
    python scripts/gen_chart_readme.py --check  # exit 1 if the README is not what this script writes
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
CHART = ROOT / "deploy/helm/openmanus-rl"
PLACEHOLDER = "@@VALUES@@"
KEY = re.compile(r"^(\s*)([A-Za-z_][\w.-]*):")


@dataclass
class Key:
    path: tuple[str, ...]
    doc: str


def documented_keys(text: str) -> list[Key]:
    """Every mapping key of a values file with the comment lines right above it (list items are data)."""
    keys, stack, comment, list_indent = [], [], [], None
    for line in text.splitlines():
        stripped = line.strip()
        if not stripped:
            comment = []
            continue
        indent = len(line) - len(line.lstrip())
        if list_indent is not None and indent > list_indent:
            continue
        list_indent = None
        if stripped.startswith("#"):
            comment.append(stripped.lstrip("#").strip())
            continue
        if stripped.startswith("- "):
            list_indent = indent
            comment = []
            continue
        match = KEY.match(line)
        if match:
            while stack and stack[-1][0] >= indent:
                stack.pop()
            stack.append((indent, match.group(2)))
            keys.append(Key(tuple(k for _, k in stack), " ".join(comment)))
        comment = []
    return keys


def lookup(values: dict, path: tuple[str, ...]) -> Any:
    for part in path:
        values = values[part]
    return values


def cell(text: str, code: bool = False) -> str:
    text = text.replace("|", "\\|")
    return text if code else text.replace("<", "&lt;").replace(">", "&gt;")


def values_table(values_text: str) -> str:
    values = yaml.safe_load(values_text)
    out, general = [], []
    sections: dict[str, list[str]] = {}
    for key in documented_keys(values_text):
        value = lookup(values, key.path)
        if isinstance(value, dict) and value:
            if len(key.path) == 1:
                sections[key.path[0]] = [
                    f"### `{key.path[0]}`",
                    "",
                    key.doc,
                    "",
                    "| key | default | description |",
                    "| --- | --- | --- |",
                ]
            continue
        row = f"| `{'.'.join(key.path)}` | `{cell(json.dumps(value), code=True)}` | {cell(key.doc)} |"
        (sections[key.path[0]] if len(key.path) > 1 else general).append(row)
    out += ["### General", "", "| key | default | description |", "| --- | --- | --- |", *general, ""]
    for lines in sections.values():
        out += [*lines, ""]
    return "\n".join(out).rstrip() + "\n"


def render() -> str:
    template = (CHART / "README.md.tmpl").read_text()
    if PLACEHOLDER not in template:
        raise SystemExit(f"README.md.tmpl has no {PLACEHOLDER}")
    return template.replace(PLACEHOLDER, values_table((CHART / "values.yaml").read_text()).rstrip())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="compare instead of writing")
    args = parser.parse_args()
    out, text = CHART / "README.md", render()
    if args.check:
        if not out.exists() or out.read_text() != text:
            print(f"{out.relative_to(ROOT)} is stale: run python scripts/gen_chart_readme.py", file=sys.stderr)
            return 1
        return 0
    out.write_text(text)
    print(f"wrote {out.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
