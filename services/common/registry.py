"""A name -> implementation table for the pluggable parts (backends, envs, rewards, estimators)."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class Registry(Generic[T]):
    """Maps a config `type` string to a class or factory.

    Implementations register with a decorator in their own module; `lazy` entries name a module to
    import on first use, so heavy dependencies (vllm, torch) load only when that part is chosen.
    """

    def __init__(self, kind: str):
        self.kind = kind
        self._entries: dict[str, Callable[..., T]] = {}
        self._lazy: dict[str, str] = {}

    def register(self, name: str) -> Callable[[Callable[..., T]], Callable[..., T]]:
        def decorate(obj: Callable[..., T]) -> Callable[..., T]:
            if name in self._entries and self._entries[name] is not obj:
                raise ValueError(f"{self.kind} {name!r} is already registered")
            self._entries[name] = obj
            return obj

        return decorate

    def unregister(self, name: str) -> None:
        """Removes an entry (tests that register throwaway implementations clean up with this)."""
        self._entries.pop(name, None)
        self._lazy.pop(name, None)

    def register_lazy(self, name: str, module: str) -> None:
        self._lazy[name] = module

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
