"""A registry table: plug-in names to classes, each class imported when its name is first looked up.

The tables of ``registry.py`` name their classes by import path (``"fedavg":
"shared.algorithms.fedavg:FedAvg"``) rather than importing them, so the registry imports none of
the modules it lists:

* a plug-in module may import the registry at module level (to build a grouping, say) although
  the registry lists it: with the classes imported up front, the registry would be half
  initialised while it imported that module, and the module's import of it would fail;
* a process loads only the plug-ins its run uses (a device, the one algorithm it trains).

A name may come from the network (a task's algorithm); it only selects one of the table's own
entries, never an import path. A test resolves every entry (``tests/unit/shared/algorithms/test_registry.py``).
"""
from __future__ import annotations

import importlib
from collections.abc import Iterator, Mapping, MutableMapping
from typing import Any, Generic, TypeVar, cast

T = TypeVar("T")


def _resolve(path: str) -> Any:
    """The object ``package.module:Name`` names (ImportError or AttributeError as Python raises them:
    a registry entry that does not resolve is a bug, whose traceback should show)."""
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


class PluginTable(MutableMapping[str, "type[T]"], Generic[T]):
    """Names to subclasses of ``base`` (both given as import paths), each class imported with the
    first lookup of its name. ``what`` names the kind of plug-in in errors (``"grouping"``). A
    class set by name (``table[name] = cls``, as a test registering its own plug-in does) is
    taken as it is."""

    def __init__(self, what: str, base: str, entries: Mapping[str, str]) -> None:
        self.what = what
        self._base = base
        self._entries: dict[str, str | type[T]] = dict(entries)

    def __getitem__(self, name: str) -> type[T]:
        entry = self._entries[name]
        if isinstance(entry, str):
            loaded, base = _resolve(entry), _resolve(self._base)
            if not (isinstance(loaded, type) and issubclass(loaded, base)):
                raise TypeError(f"{self.what} {name!r}: {entry} is not a subclass of {self._base}")
            entry = self._entries[name] = cast("type[T]", loaded)
        return entry

    def __setitem__(self, name: str, plugin: type[T]) -> None:
        self._entries[name] = plugin

    def __delitem__(self, name: str) -> None:
        del self._entries[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def choose(self, name: str) -> type[T]:
        """The class registered as ``name``; ValueError naming the choices if none is."""
        if name not in self._entries:
            raise ValueError(f"unknown {self.what} {name!r}; choose one of {sorted(self._entries)}")
        return self[name]
