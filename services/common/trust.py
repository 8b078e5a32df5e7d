"""Who may set a plugin option. A job spec is data: no field of it, however nested, names a command, a
module, a class or a file to import. Plugin options (`env.options`, a reward function's `params`) are
free-form dicts that the plugin's own pydantic model checks; a field of that model that takes more than
data says so with a marker, `Field(..., json_schema_extra=trust.OPERATOR)`:

- `OPERATOR`: a command or plugin that the deployment supplies (AgentGym's `recycle_command`). The job
  API refuses it from a caller and sets it from its own settings (`OMRL_API_ENV_OPTIONS`).
- `URL`: a server the job calls. The job API takes only hosts its operator allows.
- `PATH`: a file or folder. The job API takes only paths inside the folders its operator allows.
- `MODEL`: a model, as `model.path` names one: a folder (inside the allowed folders) or a Hugging Face id.

Unmarked fields are data. The job API applies the markers (`services.jobs.spec_policy`); the CLI and
the services, run by the operator, honour every field as given."""

from __future__ import annotations

import types
import typing
from collections.abc import Iterator, Mapping
from typing import Any, Literal

from pydantic import BaseModel

Trust = Literal["operator", "url", "path", "model"]
OPERATOR: dict[str, Any] = {"trust": "operator"}
URL: dict[str, Any] = {"trust": "url"}
PATH: dict[str, Any] = {"trust": "path"}
MODEL: dict[str, Any] = {"trust": "model"}


def trust_of(model: type[BaseModel], name: str) -> Trust | None:
    extra = model.model_fields[name].json_schema_extra
    return extra.get("trust") if isinstance(extra, dict) else None


def _submodel(annotation: Any) -> type[BaseModel] | None:
    """The model a field holds, itself or optional (a field of several models is not walked)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        models = [m for m in map(_submodel, typing.get_args(annotation)) if m is not None]
        return models[0] if len(models) == 1 else None
    return None


def marked_values(
    model: type[BaseModel], data: Mapping[str, Any], loc: tuple[str, ...] = ()
) -> Iterator[tuple[tuple[str, ...], Trust, Any]]:
    """(location, trust, value) of every marked field `data` sets, nested models included. `data` is what
    the caller sent, before defaults: only values the caller chose are yielded."""
    for name, field in model.model_fields.items():
        key = field.alias or name
        if key not in data:
            continue
        trust, value = trust_of(model, name), data[key]
        if trust is not None:
            yield (*loc, key), trust, value
        elif (sub := _submodel(field.annotation)) is not None and isinstance(value, Mapping):
            yield from marked_values(sub, value, (*loc, key))
