"""``--register_path``: the one loader of user code, as MindFormers' ``run_mindformer.py``
defines it. Used by the trainer (import every module of the folder, so that their
``@register`` decorators run) and by data's ``--tokenizer-type AutoRegister`` (one class,
``--auto_register module.ClassName``).

Only files inside the named folder are imported, never an installed module by name. The
folder goes on ``sys.path`` (its modules may import each other) and into the
``REGISTER_PATH`` environment variable; each module is imported under its own name, once.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from types import ModuleType

from mindtrain.config.errors import UserError


class RegisterPathError(UserError):
    """The --register_path folder, or a module or class in it, cannot be loaded."""


def register_folder(path: str) -> str:
    """The folder's real path, put on ``sys.path`` and into ``REGISTER_PATH``."""
    if not path or not os.path.isdir(path):
        raise RegisterPathError(f"--register_path: folder '{path}' does not exist; pass the folder that holds "
                                "your Python modules")
    folder = os.path.realpath(path)
    os.environ["REGISTER_PATH"] = folder
    if folder not in sys.path:
        sys.path.append(folder)
    return folder


def load_register_path(path: str) -> list[str]:
    """Import every module of folder ``path`` (``*.py`` files and packages, in name order);
    returns the module names."""
    folder = register_folder(path)
    names = []
    for entry in sorted(os.listdir(folder)):
        full = os.path.join(folder, entry)
        if entry.endswith(".py") and os.path.isfile(full):
            names.append((entry[:-3], full))
        elif os.path.isfile(os.path.join(full, "__init__.py")) and entry.isidentifier():
            names.append((entry, os.path.join(full, "__init__.py")))
    for module, file in names:
        import_module_file(module, file, folder)
    return [m for m, _ in names]


def load_register_class(path: str, qualified: str) -> type:
    """The class ``qualified`` ("module.ClassName", dots for sub-modules) defined in a
    module of folder ``path``; the messages name ``--auto_register``, the flag that gives it."""
    module_name, _, class_name = qualified.rpartition(".")
    if not module_name or not class_name:
        raise RegisterPathError(f"--auto_register: expected module.ClassName, got {qualified!r}")
    folder = register_folder(path)
    base = os.path.join(folder, *module_name.split("."))
    file = base + ".py" if os.path.isfile(base + ".py") else os.path.join(base, "__init__.py")
    if not os.path.isfile(file):
        raise RegisterPathError(f"{base}.py: not found: --auto_register {qualified} names a module inside "
                                "--register_path")
    module = import_module_file(module_name, file, folder)
    cls = getattr(module, class_name, None)
    if not isinstance(cls, type):
        raise RegisterPathError(f"--auto_register: {file} defines no class {class_name!r}")
    return cls


def import_module_file(module: str, file: str, folder: str) -> ModuleType:
    """Import ``file`` (inside ``folder``) as ``module``, once; a module of that name
    loaded from elsewhere, or an error in the user's code, is a one-line error."""
    loaded = sys.modules.get(module)
    if loaded is not None:
        if os.path.realpath(getattr(loaded, "__file__", "") or "") == os.path.realpath(file):
            return loaded
        raise RegisterPathError(f"--register_path: module '{module}' ({file}) has the name of an installed module "
                                f"({getattr(loaded, '__file__', 'built in')}); rename the file")
    spec = importlib.util.spec_from_file_location(
        module, file, submodule_search_locations=[os.path.dirname(file)] if file.endswith("__init__.py") else None)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[module] = mod
    try:
        spec.loader.exec_module(mod)
    except UserError:
        del sys.modules[module]
        raise
    except Exception as err:  # the user's code: one line naming the file and the error
        del sys.modules[module]
        rel = os.path.relpath(file, folder)
        raise RegisterPathError(f"--register_path: importing {rel} failed: {type(err).__name__}: {err}") from None
    return mod
