"""User classes by kind and name, and the ``--register_path`` folder that defines them.

A config names a class as a string (e.g. a callback ``type``); the string never imports
code. Only the folder the user names with ``--register_path`` (as in MindFormers'
``run_mindformer.py``) is imported, and its modules register their classes::

    from mindtrain.trainer.registry import register

    @register("callback", "MyCallback")
    class MyCallback: ...
"""

from __future__ import annotations

import difflib
import importlib.util
import os
import sys
from typing import Callable, Optional, TypeVar

from mindtrain.config import UserError

T = TypeVar("T")

_REGISTRY: dict[str, dict[str, object]] = {}


class RegistryError(UserError):
    """A registered name is missing or taken, or the register folder cannot be loaded."""


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


def load_register_path(path: str) -> list[str]:
    """Import every module of folder ``path`` (``*.py`` files and packages, in name order)
    so that their ``@register`` decorators run; returns the module names.

    The folder also goes on ``sys.path`` (modules may import each other) and into the
    ``REGISTER_PATH`` environment variable, as MindFormers does.
    """
    if not os.path.isdir(path):
        raise RegistryError(f"--register_path: folder '{path}' does not exist; pass the folder that holds your "
                            "Python modules")
    folder = os.path.realpath(path)
    os.environ["REGISTER_PATH"] = folder
    if folder not in sys.path:
        sys.path.append(folder)
    names = []
    for entry in sorted(os.listdir(folder)):
        full = os.path.join(folder, entry)
        if entry.endswith(".py") and os.path.isfile(full):
            names.append((entry[:-3], full))
        elif os.path.isfile(os.path.join(full, "__init__.py")) and entry.isidentifier():
            names.append((entry, os.path.join(full, "__init__.py")))
    for module, file in names:
        _import_file(module, file, folder)
    return [m for m, _ in names]


def _import_file(module: str, file: str, folder: str) -> None:
    loaded = sys.modules.get(module)
    if loaded is not None:
        if os.path.realpath(getattr(loaded, "__file__", "") or "") == os.path.realpath(file):
            return
        raise RegistryError(f"--register_path: module '{module}' ({file}) has the name of an installed module "
                            f"({getattr(loaded, '__file__', 'built in')}); rename the file")
    spec = importlib.util.spec_from_file_location(
        module, file, submodule_search_locations=[os.path.dirname(file)] if file.endswith("__init__.py") else None)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[module] = mod
    try:
        spec.loader.exec_module(mod)
    except UserError:
        raise
    except Exception as err:  # the user's code: one line naming the file and the error
        del sys.modules[module]
        rel = os.path.relpath(file, folder)
        raise RegistryError(f"--register_path: importing {rel} failed: {type(err).__name__}: {err}") from None


def _qualname(obj: object) -> str:
    return f"{getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', repr(obj))}"
