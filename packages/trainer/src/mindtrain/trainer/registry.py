"""User classes by kind and name, and the ``--register_path`` folder that defines them.

A config names a class as a string (e.g. a callback ``type``); the string never imports
code. Only the folder the user names with ``--register_path`` (as in MindFormers'
``run_mindformer.py``) is imported (:func:`mindtrain.config.register_path.load_register_path`,
re-exported here), and its modules register their classes::

    from mindtrain.trainer.registry import register

    @register("callback", "MyCallback")
    class MyCallback: ...
"""

from __future__ import annotations

import difflib
from typing import Callable, Optional, TypeVar

from mindtrain.config import UserError
from mindtrain.config.register_path import RegisterPathError, load_register_path

__all__ = ["RegisterPathError", "RegistryError", "load_register_path", "lookup", "register", "registered"]

T = TypeVar("T")

_REGISTRY: dict[str, dict[str, object]] = {}


class RegistryError(UserError):
    """A registered name is missing or taken (a folder that cannot be loaded raises
    :class:`~mindtrain.config.register_path.RegisterPathError`)."""


def register(kind: str, name: Optional[str] = None) -> Callable[[T], T]:
    """Class decorator: make ``obj`` findable as ``lookup(kind, name)`` (name defaults to the
    class name). Registering another object under a taken name is an error."""

    def add(obj: T) -> T:
        key = name or getattr(obj, "__name__", None)
        if not key:
            raise RegistryError(f"register({kind!r}): pass a name for {obj!r}")
        table = _REGISTRY.setdefault(kind, {})
        old = table.get(key)
        if old is not None and old is not obj and _qualname(old) != _qualname(obj):
            raise RegistryError(f"{kind} '{key}' is registered twice ({_qualname(old)} and {_qualname(obj)}); "
                                "rename one of them")
        table[key] = obj
        return obj

    return add


def lookup(kind: str, name: str) -> object:
    """The object registered as ``name`` of ``kind``; a one-line error naming the choices."""
    table = _REGISTRY.get(kind, {})
    if name in table:
        return table[name]
    close = difflib.get_close_matches(name, list(table), n=1, cutoff=0.6)
    hint = f" (did you mean '{close[0]}'?)" if close else ""
    known = ", ".join(sorted(table)) or "none"
    raise RegistryError(f"{kind} '{name}' is not registered{hint}; registered: {known}. Define it in a module "
                        f"under --register_path and decorate it with @register({kind!r}, {name!r})")


def registered(kind: str) -> list[str]:
    """Names registered under ``kind``, sorted."""
    return sorted(_REGISTRY.get(kind, {}))


def _qualname(obj: object) -> str:
    return f"{getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', repr(obj))}"
