"""Config errors as one line per problem, `field.path: message`, for CLIs (no pydantic banner, no traceback)."""

from __future__ import annotations

from pydantic import ValidationError


def error_lines(exc: ValueError) -> list[str]:
    """`env.options: env 'corridor': unknown option 'lenght'; known: ...` for each problem of a config."""
    if not isinstance(exc, ValidationError):
        return [str(exc)]
    lines = []
    for error in exc.errors():
        field = ".".join(str(part) for part in error["loc"] if part != "[key]")
        message = error["msg"].removeprefix("Value error, ")
        lines.append(f"{field}: {message}" if field else message)
    return lines
