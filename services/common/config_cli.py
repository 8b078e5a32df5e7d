"""The run config on a command line: every schema field is a flag (`--algorithm.advantage grpo`) whose help is
the field's docstring (pydantic-settings' CLI source builds them), beside `--config FILE`, `--set a.b=value`
and `OMRL_CONFIG__A__B=value` environment variables. Layers apply in the order default < file < env < flag,
and a resolved config remembers which layer gave each value (`omrl config show`)."""

from __future__ import annotations

import argparse
import difflib
import importlib
import json
import os
import re
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from types import UnionType
from typing import Annotated, Any, Literal, Union, get_args, get_origin

from pydantic import BaseModel, ValidationError
from pydantic_settings import BaseSettings, CliSettingsSource, SettingsConfigDict
from pydantic_settings.exceptions import SettingsError

from services.common import choices
from services.common.config import RENAMED_FIELDS, TrainConfig, rename_old_fields
from services.common.config_errors import error_lines
from services.common.config_layers import ConfigError, env_layer, file_layer, merge_layers, set_layer


class UsageError(ValueError):
    """A command line argparse rejects (unknown flag, missing argument), as one line."""


class Parser(argparse.ArgumentParser):
    """argparse that raises instead of printing a usage screen and exiting: callers print one line."""

    def __init__(self, *args: Any, **kwargs: Any):
        kwargs.setdefault("allow_abbrev", False)  # `--algorithm.advantag` must not pass as a prefix
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> None:
        raise UsageError(_suggest(message, self))


def _suggest(message: str, parser: argparse.ArgumentParser) -> str:
    if not message.startswith("unrecognized arguments: "):
        return message
    known = _options(parser)
    flags = [
        arg.split("=", 1)[0] for arg in message.removeprefix("unrecognized arguments: ").split() if arg.startswith("--")
    ]
    for flag in flags:
        section, _, name = flag.removeprefix("--").partition(".")
        if name in RENAMED_FIELDS.get(section, {}):
            return f"unknown flag {flag}: renamed to --{section}.{RENAMED_FIELDS[section][name]}"
        close = difflib.get_close_matches(flag, known, n=1, cutoff=0.75)
        if close:
            return f"unknown flag {flag}; did you mean {close[0]}?"
        return f"unknown flag {flag}; see --help or `omrl config explain SECTION`"
    return message


def _options(parser: argparse.ArgumentParser) -> list[str]:
    """Every option string of `parser` and its sub-commands (argparse reports a sub-command's unknown flags
    from the root parser)."""
    found = []
    for action in parser._actions:
        found += action.option_strings
        if isinstance(action, argparse._SubParsersAction):
            for sub in set(action.choices.values()):
                found += _options(sub)
    return found


# -- the schema, walked ------------------------------------------------------------------------------
@dataclass
class FieldDoc:
    path: str
    annotation: Any
    default: Any
    doc: str
    bounds: str
    plugin: str | None
    literal: tuple[str, ...]
    section: bool


def _bounds(info: Any) -> str:
    parts = []
    for item in info.metadata:
        for attr, sign in (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<")):
            if getattr(item, attr, None) is not None:
                parts.append(f"{sign} {getattr(item, attr)}")
    return ", ".join(parts)


def _plugin_kind(annotation: Any, metadata: list[Any]) -> str | None:
    for item in [*metadata, *getattr(annotation, "__metadata__", ())]:
        if isinstance(item, choices.PluginChoice):
            return item.kind
    if get_origin(annotation) is dict:  # reward.components: keys are plugin names
        return _plugin_kind(get_args(annotation)[0], [])
    return None


def _literal(annotation: Any) -> tuple[str, ...]:
    if get_origin(annotation) is Literal:
        return tuple(str(a) for a in get_args(annotation))
    for arg in get_args(annotation):  # Optional[Literal[...]]
        if get_origin(arg) is Literal:
            return tuple(str(a) for a in get_args(arg))
    return ()


def _section_type(annotation: Any) -> type[BaseModel] | None:
    return annotation if isinstance(annotation, type) and issubclass(annotation, BaseModel) else None


def walk(schema: type[BaseModel], prefix: str = "", instance: BaseModel | None = None) -> Iterator[FieldDoc]:
    """Every field of `schema`, sections first then their fields, with defaults from an instance."""
    instance = instance if instance is not None else _defaults(schema)
    for name, info in schema.model_fields.items():
        path, value = f"{prefix}{name}", getattr(instance, name)
        sub = _section_type(info.annotation)
        yield FieldDoc(
            path,
            info.annotation,
            value,
            (info.description or "").strip(),
            _bounds(info),
            _plugin_kind(info.annotation, info.metadata),
            _literal(info.annotation),
            sub is not None,
        )
        if sub is not None:
            yield from walk(sub, f"{path}.", value)


def _defaults(schema: type[BaseModel]) -> BaseModel:
    return schema.model_validate({})  # validated: factory defaults and derived values as a run gets them


def plugin_names(kind: str) -> list[str]:
    """The registered names of plugin kind `kind`; none where this process has not imported its registry."""
    try:
        found = choices.registry(kind)
    except ImportError:  # an OMRL_PLUGINS module this install cannot import
        return []
    return found.names() if found is not None else []


def type_name(annotation: Any) -> str:
    """`int`, `Optional[str]`, `dict[str, RewardComponentConfig]`: the type as a user writes a value of it."""
    origin, args = get_origin(annotation), get_args(annotation)
    if origin is Annotated:
        return type_name(args[0])
    if origin is Literal:
        return type(args[0]).__name__
    if origin is Union or origin is UnionType:
        rest = [a for a in args if a is not type(None)]
        inner = " | ".join(type_name(a) for a in rest)
        return f"Optional[{inner}]" if len(rest) < len(args) else inner
    if origin is not None:
        return f"{getattr(origin, '__name__', str(origin))}[{', '.join(type_name(a) for a in args)}]"
    if annotation is Any:
        return "Any"
    return annotation.__name__ if isinstance(annotation, type) else str(annotation)


# -- flags -----------------------------------------------------------------------------------------------
SHORTCUTS = {"--model.path": "--model", "--env.name": "--env", "--learner.steps": "--steps"}
"""Short flags of the launcher (`--model ID --env maze --steps 60`); they replace the sections' JSON flags."""


class ConfigFlags:
    """Adds `--config`, `--set` and one flag per field of `schema` to `parser`; `resolve` merges the layers."""

    def __init__(
        self,
        parser: argparse.ArgumentParser,
        schema: type[TrainConfig] = TrainConfig,
        shortcuts: bool = False,
        spec: Literal["--config", "SPEC", "SPEC?"] = "--config",
    ):
        """`spec`: the file as `--config FILE`, or as a positional argument, required or optional."""
        self.schema = schema
        what = f"YAML file ({schema.__module__}.{schema.__name__})"
        if spec == "--config":
            parser.add_argument("--config", metavar="FILE", help=what)
        else:
            parser.add_argument("config", metavar="SPEC", nargs="?" if spec == "SPEC?" else None, help=what)
        parser.add_argument(
            "--set",
            action="append",
            default=[],
            metavar="KEY=VALUE",
            help="override one field, the value read as YAML (e.g. --set 'env.options={size: 6}')",
        )
        docs = list(walk(schema))
        self._plugins = {f"--{d.path}": d.plugin for d in docs if d.plugin}
        defaults = {f"--{d.path}": d.default for d in docs if not d.section}
        short = SHORTCUTS if shortcuts else {}

        def add_argument(group: Any, *names: str, **kwargs: Any) -> Any:
            if short and kwargs.get("const") == "{}" and names[0] in short.values():
                kwargs["help"] = argparse.SUPPRESS  # the section's JSON flag, renamed: its name is a shortcut
                names = tuple(f"--{n.lstrip('-')}-json" for n in names)
            if names and names[0] in defaults and "(default factory:" in str(kwargs.get("help")):
                shown = f"(default: {_inline(defaults[names[0]])})".replace("%", "%%")
                kwargs["help"] = re.sub(r"\(default factory: [^)]*\)", lambda _: shown, kwargs["help"])
            if names and names[0] in self._plugins and kwargs.get("help") not in (None, argparse.SUPPRESS):
                names_ = ", ".join(plugin_names(self._plugins[names[0]]))
                kwargs["help"] = f"{kwargs['help']} One of: {names_}." if names_ else kwargs["help"]
            return group.add_argument(*names, *(short[n] for n in names if n in short), **kwargs)

        settings = type(
            f"{schema.__name__}Flags",
            (BaseSettings, schema),
            {
                "model_config": SettingsConfigDict(
                    cli_avoid_json=False, cli_hide_none_type=True, case_sensitive=True, cli_implicit_flags=False
                )
            },
        )
        self.source = CliSettingsSource(
            settings,
            root_parser=parser,
            cli_prog_name=parser.prog,
            add_argument_method=add_argument,
            cli_exit_on_error=False,
        )

    def flag_layer(self, args: argparse.Namespace) -> dict[str, Any]:
        values = {k: v for k, v in vars(args).items() if "." in k or k in self.schema.model_fields}
        try:
            return self.source(parsed_args=values)()
        except SettingsError as exc:
            raise ConfigError([_settings_error(exc)]) from None

    def resolve(self, args: argparse.Namespace, environ: dict[str, str] | None = None) -> Resolved:
        return resolve(self.schema, args.config, args.set, self.flag_layer(args), environ)


def add_import_flag(parser: argparse.ArgumentParser, what: str) -> None:
    """`--import MODULE` (repeatable, dest `imports`): modules whose plugins register on import;
    `parse_service_args` imports them before the config is validated."""
    parser.add_argument(
        "--import", dest="imports", action="append", default=[], metavar="MODULE", help=f"Import MODULE first: {what}"
    )


def parse_service_args(
    parser: Parser,
    argv: list[str] | None = None,
    schema: type[TrainConfig] = TrainConfig,
    shortcuts: bool = False,
) -> tuple[argparse.Namespace, TrainConfig]:
    """A service's command line: its own flags beside the run config's (`--config`, `--set`, one flag per
    field). A bad flag or value exits 2 with one line per problem naming it; nothing has started. Modules
    named by an `--import` flag (dest `imports`) are imported first: they register plugins the config names."""
    flags = ConfigFlags(parser, schema=schema, shortcuts=shortcuts)
    try:
        args = parser.parse_args(argv)
        for module in getattr(args, "imports", None) or []:
            importlib.import_module(module)
        return args, flags.resolve(args).config
    except (UsageError, ConfigError) as exc:
        for line in getattr(exc, "lines", [str(exc)]):
            print(f"{parser.prog}: config error: {line}", file=sys.stderr)
        raise SystemExit(2) from None


def _inline(value: Any) -> str:
    if isinstance(value, BaseModel):
        value = value.model_dump(mode="json")
    elif isinstance(value, dict):
        value = {k: v.model_dump(mode="json") if isinstance(v, BaseModel) else v for k, v in value.items()}
    return json.dumps(value)


def _settings_error(exc: SettingsError) -> str:
    text = str(exc)
    if 'for field "' in text:  # error parsing value for field "env" from source "CliSettingsSource"
        name = text.split('for field "', 1)[1].split('"', 1)[0]
        return f"--{name}: not valid JSON"
    return text


def _lookup(data: dict[str, Any], path: tuple[str, ...]) -> bool:
    node: Any = data
    for part in path:
        if not isinstance(node, dict) or part not in node:
            return False
        node = node[part]
    return True


@dataclass
class Resolved:
    config: TrainConfig
    layers: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    """(source, values) in the order they were applied."""
    _defaults: dict[str, Any] | None = field(default=None, repr=False)

    def source(self, path: str) -> str:
        """Which layer set `path`: default, file, env, flag, or derived (a value
        the schema computed from others, such as env.replicas from resources.envs.replicas)."""
        parts = tuple(path.split("."))
        for name, data in reversed(self.layers):
            if _lookup(data, parts):
                return name
        if self._defaults is None:
            self._defaults = {d.path: d.default for d in walk(type(self.config))}
        return "default" if _value(self.config, path) == self._defaults.get(path) else "derived"

    def rows(self, changed_only: bool = False) -> list[tuple[str, Any, str]]:
        rows = []
        for doc in walk(type(self.config), instance=self.config):
            if doc.section:
                continue
            source = self.source(doc.path)
            if not changed_only or source != "default":
                rows.append((doc.path, doc.default, source))
        return rows


def _value(model: BaseModel, path: str) -> Any:
    value: Any = model
    for part in path.split("."):
        value = getattr(value, part)
    return value


def resolve(
    schema: type[TrainConfig],
    config_path: str | None,
    overrides: list[str],
    flags: dict[str, Any] | None = None,
    environ: dict[str, str] | None = None,
) -> Resolved:
    """Defaults < file < env < `--set` < flags, validated once; a problem raises ConfigError naming the field."""
    layers = [  # each with the old names of renamed fields replaced: a later layer's new name overrides them
        ("file", rename_old_fields(file_layer(config_path))),
        ("env", rename_old_fields(env_layer(dict(os.environ if environ is None else environ)))),
        ("flag", merge_layers(rename_old_fields(set_layer(overrides)), rename_old_fields(flags or {}))),
    ]
    data: dict[str, Any] = {}
    for _, layer in layers:
        data = merge_layers(data, layer)
    try:
        config = schema.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(explain_errors(exc, schema)) from None
    return Resolved(config, [(name, layer) for name, layer in layers if layer])


def explain_errors(exc: ValidationError, schema: type[BaseModel]) -> list[str]:
    """`error_lines`, and for an unknown field the closest known one."""
    known = [d.path for d in walk(schema)]
    lines = []
    for error, line in zip(exc.errors(), error_lines(exc)):
        if error["type"] == "extra_forbidden":
            path = ".".join(str(p) for p in error["loc"])
            close = difflib.get_close_matches(path, known, n=1, cutoff=0.75)
            line = f"{path}: unknown field" + (f"; did you mean {close[0]}?" if close else "")
        lines.append(line)
    return lines


def find_field(schema: type[BaseModel], path: str) -> FieldDoc:
    for doc in walk(schema):
        if doc.path == path:
            return doc
    close = difflib.get_close_matches(path, [d.path for d in walk(schema)], n=1, cutoff=0.6)
    raise ConfigError([f"{path}: no such field" + (f"; did you mean {close[0]}?" if close else "")])
