"""What a caller may point a job at. A job runs with the API's rights, so a spec's paths must stay inside
the folders the operator allowed (symlinks and `..` resolved), and the Redis a job writes to is the
server's: a caller's `stream.redis_url` is rejected unless the operator allows it. Only values the caller
set away from their defaults are checked (a dumped run config repeats every default): defaults are the
server's own choice, and launchers override output and checkpoint dirs."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

from services.common.config import JobSpec
from services.launcher.base import SpecRejected

HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[\w.-]+)?")


class SpecNotAllowed(SpecRejected):
    kind = "not_allowed"


class SpecPolicy:
    def __init__(self, roots: list[Path], redis_url: str | None = None, allow_spec_redis_url: bool = False):
        self.roots = [Path(r).resolve() for r in roots]
        self.redis_url, self.allow_spec_redis_url = redis_url, allow_spec_redis_url

    @classmethod
    def from_settings(cls, settings) -> SpecPolicy:
        return cls(
            [*settings.allowed_data_roots, settings.output_dir],
            settings.jobs_redis_url(),
            settings.allow_spec_redis_url,
        )

    def apply(self, spec: JobSpec) -> JobSpec:
        """Raises SpecNotAllowed naming the field; returns the spec with the server's Redis."""
        for loc, value in self._caller_paths(spec):
            if not self._inside_roots(value):
                raise SpecNotAllowed(
                    loc, f"{value!r} is outside the folders this server allows: {', '.join(map(str, self.roots))}"
                )
        callers_redis = _set_away_from_default(spec.stream, "redis_url") and spec.stream.redis_url != self.redis_url
        if callers_redis and not self.allow_spec_redis_url:
            raise SpecNotAllowed(
                ("stream", "redis_url"), "the server chooses the jobs' Redis; leave stream.redis_url out of the spec"
            )
        if self.redis_url and not callers_redis:
            spec.stream.redis_url = self.redis_url
        return spec

    @staticmethod
    def _caller_paths(spec: JobSpec) -> Iterator[tuple[tuple[str, ...], str]]:
        fields = [
            (("env", "data_dir"), spec.env, "data_dir"),
            (("env", "dataset"), spec.env, "dataset"),
            (("output_dir",), spec, "output_dir"),
            (("learner", "checkpoint_dir"), spec.learner, "checkpoint_dir"),
            (("learner", "export_dir"), spec.learner, "export_dir"),
        ]
        for loc, section, name in fields:
            value = getattr(section, name)
            if value and _set_away_from_default(section, name):
                yield loc, value
        path = spec.model.path
        if path and not _is_hub_id(path):
            yield ("model", "path"), path

    def _inside_roots(self, value: str) -> bool:
        try:
            resolved = Path(value).resolve()
        except (OSError, RuntimeError, ValueError):  # symlink loops, NUL bytes
            return False
        return any(resolved == root or root in resolved.parents for root in self.roots)


def _set_away_from_default(section, name: str) -> bool:
    return name in section.model_fields_set and getattr(section, name) != type(section).model_fields[name].default


def _is_hub_id(value: str) -> bool:
    """`org/name` of a Hugging Face model, not a local folder (a relative path that exists is a folder)."""
    return bool(HUB_ID.fullmatch(value)) and ".." not in value.split("/") and not Path(value).exists()
