"""What a caller may point a job at. A job runs with the API's rights, and a token is not a shell on the
host: a job spec is data, never code. No field of it, however nested, names a command, a module, a class
or a file to import; commands and plugins come from the operator's deployment (these settings), URLs and
paths only from what the operator allows. Every check refuses with SpecNotAllowed naming the field (422).

- Paths (`env.data_dir`, `env.dataset`, a local `model.path`, `output_dir`, `learner.checkpoint_dir`,
  `learner.export_dir`, and plugin options marked `trust.PATH`, or `trust.MODEL` when not a Hugging Face id) must
  stay inside the allowed folders (symlinks and `..` resolved).
- Plugin options (`env.options`, reward `params`, a toolset's `env.tools.<name>.options`) go through the plugin's
  schema markers
  (`services.common.trust`): a `trust.OPERATOR` option (a command) is refused unless it repeats the
  deployment's own value, a `trust.URL` option must name an allowed host.
- `rollout.engine_args`: only keys on the allow-list (`vllm_args.JOB_SPEC_ENGINE_ARGS` plus the operator's
  `extra_engine_args`): numbers, switches and choices, never files, classes, plugins or endpoints.
- Service addresses (`env.address`, `reward.address`, `rollout.addresses`) are the launcher's; a spec that
  sets them is refused. The launchers also set `run`, `output_dir`, `learner.checkpoint_dir` and
  `learner.weight_nccl_host` themselves.
- `resources.image` and `resources.volume_claim` only from the operator's lists.
- The Redis a job writes to is the server's: a caller's `stream.redis_url` is refused unless allowed.

Only values the caller set away from their defaults are checked (a dumped run config repeats every
default): defaults are the server's own choice. An accepted spec leaves with the server's Redis and the
deployment's env options merged in."""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from pydantic import BaseModel, ValidationError

from services import plugins
from services.common import trust
from services.engines import vllm_args
from services.jobs.launchers import SpecRejected
from services.jobs.spec import JobSpec

HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[\w.-]+)?")
SERVER_URL = re.compile(r"https?://([A-Za-z0-9.-]+|\[[0-9A-Fa-f:.]+\])(:[0-9]{1,5})?(/[\w.~%/-]*)?")
"""An environment server's URL: scheme, host[:port], a plain path; no user info, query, fragment or spaces
(a recycle command has the URL filled in, split like a shell line)."""
LAUNCHER_ADDRESSES = [("env", "address"), ("reward", "address"), ("rollout", "addresses")]
DEFAULT_PORTS = {"http": 80, "https": 443}


class SpecNotAllowed(SpecRejected):
    kind = "not_allowed"


class SpecPolicy:
    def __init__(
        self,
        roots: list[Path],
        redis_url: str | None = None,
        allow_spec_redis_url: bool = False,
        *,
        env_hosts: Iterable[str] = (),
        env_options: Mapping[str, Mapping[str, Any]] | None = None,
        extra_engine_args: Iterable[str] = (),
        images: Iterable[str] = (),
        volume_claims: Iterable[str] = (),
    ):
        self.roots = [Path(r).resolve() for r in roots]
        self.redis_url, self.allow_spec_redis_url = redis_url, allow_spec_redis_url
        self.env_hosts = sorted({_host_entry(h) for h in env_hosts}, key=str)
        self.env_options = {name: dict(options) for name, options in (env_options or {}).items()}
        self.engine_args = vllm_args.JOB_SPEC_ENGINE_ARGS | set(extra_engine_args)
        self.images, self.volume_claims = set(images), set(volume_claims)
        self._check_own_settings(extra_engine_args)

    @classmethod
    def from_settings(cls, settings) -> SpecPolicy:
        return cls(
            [*settings.allowed_data_roots, settings.output_dir],
            settings.jobs_redis_url(),
            settings.allow_spec_redis_url,
            env_hosts=settings.allowed_env_hosts,
            env_options=settings.env_options,
            extra_engine_args=settings.extra_engine_args,
            images=settings.allowed_images,
            volume_claims=settings.allowed_volume_claims,
        )

    def _check_own_settings(self, extra_engine_args: Iterable[str]) -> None:
        """A typo in the deployment's settings fails the API's start, not a job."""
        fields = vllm_args.engine_fields()
        for key in extra_engine_args:
            if key not in fields or key in vllm_args.OWN_FIELD or key in vllm_args.BACKEND_SET:
                raise ValueError(f"extra_engine_args: {key!r} is {vllm_args.problem(key, None) or 'not settable'}")
        for env, options in self.env_options.items():
            model = plugins.options_model("env", env)  # KeyError naming the known envs
            unknown = set(options) - {f.alias or name for name, f in model.model_fields.items()}
            if unknown:
                raise ValueError(f"env_options.{env}: {', '.join(sorted(unknown))} not options of env {env!r}")

    def apply(self, spec: JobSpec) -> JobSpec:
        """Raises SpecNotAllowed naming the field; returns the spec with the server's Redis and env options."""
        for loc, value in self._caller_paths(spec):
            self._check_path(loc, value)
        for loc in LAUNCHER_ADDRESSES:
            section, name = getattr(spec, loc[0]), loc[1]
            if _set_away_from_default(section, name):
                raise SpecNotAllowed(loc, "the launcher assigns the services' addresses; leave it out of the spec")
        if spec.logging.mlflow_tracking_uri:
            raise SpecNotAllowed(
                ("logging", "mlflow_tracking_uri"),
                "a job's trackers write into its own run folder; a tracking server is the deployment's to name",
            )
        self._check_env_options(spec)
        for name, component in spec.reward.components.items():
            loc = ("reward", "components", name, "params")
            model = _plugin_model(loc, component.params, "reward", component.function(name))
            if model is not None:
                self._check_marked(("reward", "components", name, "params"), model, component.params, {})
        for name, toolset in spec.env.tools.items():
            loc = ("env", "tools", name, "options")
            model = _plugin_model(loc, toolset.options, "toolset", toolset.type)
            if model is not None:
                self._check_marked(loc, model, toolset.options, {})
        self._check_engine_args(spec)
        self._check_resources(spec)
        callers_redis = _set_away_from_default(spec.stream, "redis_url") and spec.stream.redis_url != self.redis_url
        if callers_redis and not self.allow_spec_redis_url:
            raise SpecNotAllowed(
                ("stream", "redis_url"), "the server chooses the jobs' Redis; leave stream.redis_url out of the spec"
            )
        if self.redis_url and not callers_redis:
            spec.stream.redis_url = self.redis_url
        self._merge_env_options(spec)
        return spec

    # -- paths -------------------------------------------------------------------------------------
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

    def _check_path(self, loc: tuple[str, ...], value: Any) -> None:
        if not isinstance(value, str) or not self._inside_roots(value):
            raise SpecNotAllowed(
                loc, f"{value!r} is outside the folders this server allows: {', '.join(map(str, self.roots))}"
            )

    def _inside_roots(self, value: str) -> bool:
        try:
            resolved = Path(value).resolve()
        except (OSError, RuntimeError, ValueError):  # symlink loops, NUL bytes
            return False
        return any(resolved == root or root in resolved.parents for root in self.roots)

    # -- plugin options ----------------------------------------------------------------------------
    def _check_env_options(self, spec: JobSpec) -> None:
        loc = ("env", "options")
        model = _plugin_model(loc, spec.env.options, "env", spec.env.name)
        if model is not None:
            self._check_marked(loc, model, spec.env.options, self.env_options.get(spec.env.name, {}))

    def _check_marked(
        self, loc: tuple[str, ...], model: type[BaseModel], options: dict[str, Any], operators: dict[str, Any]
    ) -> None:
        """The caller's values of marked fields; a value that repeats the deployment's own passes. A plugin whose
        schema takes any key (`**params`) gets only the keys it declares."""
        if model.model_config.get("extra") != "forbid":
            declared = {f.alias or name for name, f in model.model_fields.items()}
            for key in options:
                if key not in declared:
                    raise SpecNotAllowed((*loc, key), "not a declared option of this plugin (it takes any key)")
        for where, kind, value in trust.marked_values(model, options):
            if value is None or (len(where) == 1 and where[0] in operators and operators[where[0]] == value):
                continue
            at = (*loc, *where)
            if kind == "operator":
                raise SpecNotAllowed(at, "set by the operator's deployment (OMRL_API_ENV_OPTIONS), not by a job spec")
            for item in value if isinstance(value, (list, tuple)) else [value]:
                if kind == "url":
                    self._check_url(at, item)
                elif kind == "path" or not (isinstance(item, str) and _is_hub_id(item)):
                    self._check_path(at, item)

    def _check_url(self, loc: tuple[str, ...], url: Any) -> None:
        allowed = ", ".join(f"{h}:{p}" if p else h for h, p in self.env_hosts) or "none"
        if not isinstance(url, str) or not SERVER_URL.fullmatch(url):
            raise SpecNotAllowed(loc, f"{url!r} is not an http(s) URL of the form http://host[:port][/path]")
        try:
            parts = urlsplit(url)
            host, port = (parts.hostname or "").lower(), parts.port or DEFAULT_PORTS[parts.scheme]
        except ValueError:  # a port out of range or not a number
            raise SpecNotAllowed(loc, f"{url!r} has no valid port") from None
        if (host, None) not in self.env_hosts and (host, port) not in self.env_hosts:
            raise SpecNotAllowed(loc, f"{url!r}: this server calls only the environment hosts it allows: {allowed}")

    def _merge_env_options(self, spec: JobSpec) -> None:
        """The deployment's options of the job's env under the caller's, its operator-only ones over them (a
        caller's may only repeat them, or be null)."""
        operators = self.env_options.get(spec.env.name)
        if not operators:
            return
        model = plugins.options_model("env", spec.env.name)
        own = {k: v for k, v in operators.items() if k in model.model_fields and trust.trust_of(model, k) == "operator"}
        try:
            spec.env.options = {**operators, **spec.env.options, **own}
        except ValidationError as exc:
            error = exc.errors()[0]
            raise SpecNotAllowed(
                ("env", "options", *map(str, error["loc"][1:])),
                f"with the deployment's options: {error['msg'].removeprefix('Value error, ')}",
            ) from None

    # -- engine arguments, images, volumes ---------------------------------------------------------
    def _check_engine_args(self, spec: JobSpec) -> None:
        for key in spec.rollout.engine_args:
            if key not in self.engine_args:
                raise SpecNotAllowed(
                    ("rollout", "engine_args", key),
                    "not an engine argument a job spec may set (the job API takes numbers, switches and choices "
                    f"that tune vLLM: {', '.join(sorted(self.engine_args))}); the operator adds more with "
                    "OMRL_API_EXTRA_ENGINE_ARGS",
                )

    def _check_resources(self, spec: JobSpec) -> None:
        image, claim = spec.resources.image, spec.resources.volume_claim
        if image and image not in self.images:
            raise SpecNotAllowed(
                ("resources", "image"),
                f"{image!r} is not an image this server runs (its own, or OMRL_API_ALLOWED_IMAGES): "
                f"{', '.join(sorted(self.images)) or 'none'}",
            )
        if claim and claim not in self.volume_claims:
            raise SpecNotAllowed(
                ("resources", "volume_claim"),
                f"{claim!r} is not a volume claim this server mounts (OMRL_API_ALLOWED_VOLUME_CLAIMS): "
                f"{', '.join(sorted(self.volume_claims)) or 'none'}",
            )


def _plugin_model(loc: tuple[str, ...], options: dict[str, Any], kind: str, name: str) -> type[BaseModel] | None:
    """The schema a plugin checks its options with; None where there are no options to check."""
    if not options:
        return None
    try:
        return plugins.options_model(kind, name)
    except ImportError as exc:  # the config check skips such a plugin; a caller's options are not let through
        raise SpecNotAllowed(
            loc, f"{kind} {name!r} cannot be checked by this server ({exc}); leave its options out"
        ) from None


def _host_entry(entry: str) -> tuple[str, int | None]:
    """`host` or `host:port` ([v6]:port) of `allowed_env_hosts` as (host, port or None)."""
    parts = urlsplit(f"//{entry.strip()}")
    try:
        port = parts.port
    except ValueError:
        raise ValueError(f"allowed_env_hosts: {entry!r} is not host or host:port") from None
    if not parts.hostname or parts.path or parts.username:
        raise ValueError(f"allowed_env_hosts: {entry!r} is not host or host:port")
    return parts.hostname.lower(), port


def _set_away_from_default(section, name: str) -> bool:
    default = type(section).model_fields[name].get_default(call_default_factory=True)
    return name in section.model_fields_set and getattr(section, name) != default


def _is_hub_id(value: str) -> bool:
    """`org/name` of a Hugging Face model, not a local folder (a relative path that exists is a folder)."""
    return bool(HUB_ID.fullmatch(value)) and ".." not in value.split("/") and not Path(value).exists()
