"""SPEC 2's import rules: checked statically (import-linter) and at run time."""

import os
import subprocess
import sys

import pytest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))


def test_import_linter_contracts_hold():
    lint = os.path.join(os.path.dirname(sys.executable), "lint-imports")
    proc = subprocess.run([lint, "--config", os.path.join(ROOT, ".importlinter"), "--no-cache"],
                          capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "0 broken" in proc.stdout


_LOAD_ALL = """
import importlib, pkgutil, sys
pkg = importlib.import_module(sys.argv[1])
for info in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + "."):
    if info.name.endswith("__main__"):
        continue
    importlib.import_module(info.name)
loaded = sorted(m for m in sys.argv[2:] if m in sys.modules)
assert not loaded, f"{sys.argv[1]} loaded {loaded}"
"""


@pytest.mark.parametrize("package,forbidden", [
    ("mindtrain.config", ["numpy", "mindspore", "mindtrain.data", "mindtrain.models", "mindtrain.parallel", "mindtrain.trainer"]),
    ("mindtrain.data", ["mindspore", "mindtrain.models", "mindtrain.parallel", "mindtrain.trainer"]),
    ("mindtrain.models", ["mindtrain.parallel", "mindtrain.trainer"]),
    ("mindtrain.parallel", ["mindtrain.models", "mindtrain.trainer"]),
])
def test_importing_every_module_loads_nothing_forbidden(package, forbidden):
    proc = subprocess.run([sys.executable, "-c", _LOAD_ALL, package, *forbidden], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
