"""A name -> implementation table for the pluggable parts (backends, envs, rewards, estimators).

A registry that serves a config field names that field's plugin kind (`choice`, the `kind` of
`services.common.config`'s `_plugin(kind)`): created, it is known by that kind to the config checks of
the process that imported it (`services.common.choices`), which need no import of any service. A plugin
that takes options from the config declares their schema here too (`options`), so the checks read it
from the registry."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any, Generic, TypeVar

T = TypeVar("T")

OptionsSchema = Any
"""What checks a plugin's options from the config: a pydantic model (env options, reward params), or a
function that raises a located ValidationError (a backend's `rollout.engine_args`)."""

_BY_CHOICE: dict[str, Registry] = {}


class Registry(Generic[T]):
    """Maps a config `type` string to a class or factory.

    Implementations register with a decorator in their own module; `lazy` entries name a module to
    import on first use, so heavy dependencies (vllm, torch) load only when that part is chosen.
    `choice`: the plugin kind config fields name (see the module docstring). `options(name)`: the schema
    of an entry's options where the entry did not declare one itself (it may import the entry).
    """

    def __init__(self, kind: str, *, choice: str | None = None, options: Callable[[str], OptionsSchema] | None = None):
        self.kind = kind
        self.choice = choice
        self._entries: dict[str, Callable[..., T]] = {}
        self._lazy: dict[str, str] = {}
        self._options: dict[str, OptionsSchema] = {}
        self._options_of = options
        if choice is not None:
            declare(choice, self)

    def register(self, name: str, *, options: OptionsSchema = None) -> Callable[[Callable[..., T]], Callable[..., T]]:
        def decorate(obj: Callable[..., T]) -> Callable[..., T]:
            if name in self._entries and self._entries[name] is not obj:
                raise ValueError(f"{self.kind} {name!r} is already registered")
            self._entries[name] = obj
            if options is not None:
                self._options[name] = options
            return obj

        return decorate

    def unregister(self, name: str) -> None:
        """Removes an entry (tests that register throwaway implementations clean up with this)."""
        self._entries.pop(name, None)
        self._lazy.pop(name, None)
        self._options.pop(name, None)

    def register_lazy(self, name: str, module: str, *, options: OptionsSchema = None) -> None:
        """`options`: the entry's options schema, known without importing `module`."""
        self._lazy[name] = module
        if options is not None:
            self._options[name] = options

    def names(self) -> list[str]:
        return sorted(set(self._entries) | set(self._lazy))

    def get(self, name: str) -> Callable[..., T]:
        if name not in self._entries and name in self._lazy:
            importlib.import_module(self._lazy[name])
        try:
            return self._entries[name]
        except KeyError:
            raise KeyError(f"unknown {self.kind} {name!r}; known: {', '.join(self.names()) or 'none'}") from None

    def create(self, name: str, *args, **kwargs) -> T:
        return self.get(name)(*args, **kwargs)

    def options(self, name: str) -> OptionsSchema:
        """The schema of `name`'s options: the one its entry declared, else the registry's rule; None where
        neither says (its options are not checked). The rule may import the entry: ImportError where it
        needs a package this install lacks, KeyError for an unknown name."""
        if name in self._options:
            return self._options[name]
        return self._options_of(name) if self._options_of is not None else None


def declare(choice: str, registry: Registry) -> None:
    """Makes `registry` the one config fields of plugin kind `choice` are checked against in this process."""
    known = _BY_CHOICE.get(choice)
    if known is not None and known is not registry:
        raise ValueError(f"plugin kind {choice!r} already has its registry ({known.kind})")
    _BY_CHOICE[choice] = registry


def chosen_by(choice: str) -> Registry | None:
    """The registry of plugin kind `choice`, if this process imported it."""
    return _BY_CHOICE.get(choice)
