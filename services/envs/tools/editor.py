"""The `editor` toolset: view, create and edit text files in the episode's workspace, in the shape of the
`str_replace_editor` tool SWE and OpenManus agents use.

Confinement: a path is taken relative to the workspace and refused (ToolError kind "refused") where it is absolute,
or where it, or any symlink along it, resolves outside the resolved workspace. Files are then opened at their
resolved path with O_NOFOLLOW, so a symlink swapped in after the check is not followed. No file over
`max_file_bytes` is read or written (kind "limit")."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path, PurePath
from typing import Any

from pydantic import Field

from services.envs.tools.base import TOOLSETS, ToolContext, ToolError, ToolOptions, ToolOutput, Toolset, ToolSpec

_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_LISTING_DEPTH = 2
_SNIPPET_LINES = 4


class EditorOptions(ToolOptions):
    max_file_bytes: int = Field(1_000_000, ge=1)
    """The largest file the editor reads or writes."""
    max_view_chars: int = Field(8000, ge=1)
    """The longest output of `view`; longer output is cut, with a note saying so."""


@TOOLSETS.register("editor")
class Editor(Toolset):
    type = "editor"
    Options = EditorOptions

    def specs(self) -> list[ToolSpec]:
        return [
            ToolSpec(
                name="editor",
                description=(
                    "Views, creates and edits text files in your workspace. `view` shows a file with line numbers "
                    "(optionally `view_range` [start, end], end -1 for the last line) or lists a directory; "
                    "`create` writes a new file with `file_text`; `str_replace` replaces `old_str`, which must occur "
                    "exactly once, with `new_str`; `insert` inserts `new_str` after line `insert_line` (0: the top)."
                ),
                parameters={
                    "type": "object",
                    "properties": {
                        "command": {"type": "string", "enum": ["view", "create", "str_replace", "insert"]},
                        "path": {"type": "string", "description": "Path relative to the workspace."},
                        "file_text": {"type": "string", "description": "Content of the new file (create)."},
                        "old_str": {"type": "string", "description": "Text to replace (str_replace)."},
                        "new_str": {"type": "string", "description": "Replacement (str_replace) or text to insert."},
                        "insert_line": {"type": "integer", "minimum": 0, "description": "Insert after this line."},
                        "view_range": {
                            "type": "array",
                            "items": {"type": "integer"},
                            "minItems": 2,
                            "maxItems": 2,
                            "description": "First and last line to view, 1-based; -1 as last means the end.",
                        },
                    },
                    "required": ["command", "path"],
                    "additionalProperties": False,
                },
            )
        ]

    async def call(self, name: str, arguments: dict[str, Any], ctx: ToolContext) -> ToolOutput:
        return ToolOutput(await asyncio.to_thread(self._run, arguments, ctx.workspace))

    def _run(self, args: dict[str, Any], workspace: Path) -> str:
        command, shown = args["command"], args["path"] or "."
        path = resolve(workspace, shown)
        if command == "view":
            return self._view(path, shown, args.get("view_range"))
        if command == "create":
            return self._create(path, shown, _required(args, "file_text", command))
        if command == "str_replace":
            return self._str_replace(path, shown, _required(args, "old_str", command), args.get("new_str", ""))
        return self._insert(path, shown, _required(args, "insert_line", command), _required(args, "new_str", command))

    def _create(self, path: Path, shown: str, text: str) -> str:
        if path.exists():
            raise ToolError(f"{shown} already exists; edit it with str_replace or insert", "failed")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            raise ToolError(f"cannot create the folder of {shown}: {error.strerror}", "failed") from None
        self._write(path, text, os.O_CREAT | os.O_EXCL)
        return f"created {shown} ({len(_lines(text))} lines)"

    def _str_replace(self, path: Path, shown: str, old: str, new: str) -> str:
        if not old:
            raise ToolError("old_str is empty", "failed")
        text = self._read(path, shown)
        count = text.count(old)
        if count != 1:
            hint = "" if count == 0 else "; include more surrounding lines so that it occurs once"
            raise ToolError(f"old_str occurs {count} times in {shown}{hint}", "failed")
        edited = text.replace(old, new, 1)
        self._write(path, edited, os.O_TRUNC)
        return f"edited {shown}:\n" + self._snippet(edited, text.count("\n", 0, text.index(old)) + 1, new)

    def _insert(self, path: Path, shown: str, after: int, new: str) -> str:
        text = self._read(path, shown)
        lines = _lines(text)
        if after > len(lines):
            raise ToolError(f"insert_line {after} is past the end of {shown} ({len(lines)} lines)", "failed")
        added = (new[:-1] if new.endswith("\n") else new).split("\n")
        ends_open = bool(text) and not text.endswith("\n")
        edited = "\n".join(lines[:after] + added + lines[after:]) + ("" if ends_open else "\n")
        self._write(path, edited, os.O_TRUNC)
        return f"inserted after line {after} of {shown}:\n" + self._snippet(edited, after + 1, new)

    def _view(self, path: Path, shown: str, view_range: list[int] | None) -> str:
        if path.is_dir():
            if view_range is not None:
                raise ToolError("view_range applies to files, not directories", "failed")
            return self._cut(_listing(path, shown))
        lines = _lines(self._read(path, shown))
        if not lines:
            return f"{shown} is empty"
        start, end = view_range if view_range is not None else (1, -1)
        end = len(lines) if end == -1 else min(end, len(lines))
        if not 1 <= start <= end:
            raise ToolError(f"view_range {view_range} is outside {shown} (lines 1 to {len(lines)})", "failed")
        return self._cut(_numbered(lines[start - 1 : end], start))

    def _read(self, path: Path, shown: str) -> str:
        if not path.is_file():
            raise ToolError(f"{shown} is not a file" if path.exists() else f"no such file: {shown}", "failed")
        fd = _open(path, os.O_RDONLY)
        with os.fdopen(fd, "rb") as file:
            data = file.read(self.options.max_file_bytes + 1)
        if len(data) > self.options.max_file_bytes:
            raise ToolError(f"{shown} is larger than {self.options.max_file_bytes} bytes", "limit")
        return data.decode("utf-8", errors="replace")

    def _write(self, path: Path, text: str, flags: int) -> None:
        data = text.encode()
        if len(data) > self.options.max_file_bytes:
            raise ToolError(f"the file would be larger than {self.options.max_file_bytes} bytes", "limit")
        fd = _open(path, os.O_WRONLY | flags, 0o644)
        with os.fdopen(fd, "wb") as file:
            file.write(data)

    def _snippet(self, text: str, first: int, new: str) -> str:
        lines = _lines(text)
        start = max(first - _SNIPPET_LINES, 1)
        end = min(first + new.count("\n") + _SNIPPET_LINES, len(lines))
        return self._cut(_numbered(lines[start - 1 : end], start))

    def _cut(self, text: str) -> str:
        limit = self.options.max_view_chars
        if len(text) <= limit:
            return text
        return text[:limit] + f"\n[output cut at {limit} characters; view a smaller view_range]"


def resolve(workspace: Path, path: str) -> Path:
    """`path` (relative to `workspace`) resolved, with no symlink left in it; ToolError where it leaves the
    workspace."""
    if PurePath(path).is_absolute():
        raise ToolError(f"{path} is absolute; give a path relative to the workspace", "refused")
    root = Path(workspace).resolve()
    try:
        current = root
        for part in PurePath(path).parts:
            current = current / part
            if current.is_symlink() and not current.resolve().is_relative_to(root):
                raise ToolError(f"{path} goes through a symlink that leaves the workspace", "refused")
        resolved = (root / path).resolve()
    except (OSError, ValueError, RuntimeError):  # a NUL byte, a symlink loop
        raise ToolError(f"{path!r} is not a usable path", "refused") from None
    if not resolved.is_relative_to(root):
        raise ToolError(f"{path} is outside the workspace", "refused")
    return resolved


def _open(path: Path, flags: int, mode: int = 0o644) -> int:
    try:
        return os.open(path, flags | _NOFOLLOW, mode)
    except FileExistsError:
        raise ToolError(f"{path.name} already exists", "failed") from None
    except OSError as error:
        raise ToolError(f"cannot open {path.name}: {error.strerror}", "failed") from None


def _required(args: dict[str, Any], key: str, command: str) -> Any:
    if args.get(key) is None:
        raise ToolError(f"{command} needs {key}", "failed")
    return args[key]


def _lines(text: str) -> list[str]:
    """Lines as `cat -n` counts them: split at newlines, a final newline ending the last line."""
    lines = text.split("\n")
    return lines[:-1] if lines[-1] == "" else lines


def _numbered(lines: list[str], first: int) -> str:
    return "\n".join(f"{number:6}\t{line}" for number, line in enumerate(lines, first))


def _listing(directory: Path, shown: str) -> str:
    """The files and folders `_LISTING_DEPTH` levels down, hidden ones left out, symlinked folders not entered."""
    entries = []
    for folder, folders, files in os.walk(directory):
        relative = Path(folder).relative_to(directory)
        folders[:] = [name for name in folders if not name.startswith(".")]
        entries += [f"{relative / name}/" for name in folders]
        entries += [str(relative / name) for name in files if not name.startswith(".")]
        if len(relative.parts) + 1 >= _LISTING_DEPTH:
            folders.clear()
    return f"{shown}:\n" + "\n".join(sorted(entries)) if entries else f"{shown} is an empty directory"
