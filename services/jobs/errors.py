"""Validation errors as JSON even when the offending input is NaN or Infinity (which strict JSON cannot
hold): such numbers are echoed back as the literal the caller sent, as a string. The echoed input is cut
at ECHO_DEPTH levels, so an answer never recurses as deep as the caller's input went."""

from __future__ import annotations

import math
from typing import Any

from fastapi import Request
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

ECHO_DEPTH = 8
CUT = "..."
"""What stands for the part of an echoed input deeper than ECHO_DEPTH."""


def finite_json(value: Any, depth: int = ECHO_DEPTH) -> Any:
    """`value` with non-finite floats as strings and what lies deeper than `depth` levels replaced by CUT."""
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
    if isinstance(value, (dict, list, tuple)) and depth <= 0:
        return CUT
    if isinstance(value, dict):
        return {k: finite_json(v, depth - 1) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite_json(v, depth - 1) for v in value]
    return value


async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    # cut before jsonable_encoder, which recurses through the whole input too; then the list and each
    # error's own level come on top of the input's
    errors = [{**e, "input": finite_json(e["input"])} if "input" in e else e for e in exc.errors()]
    return JSONResponse({"detail": finite_json(jsonable_encoder(errors), ECHO_DEPTH + 2)}, status_code=422)
