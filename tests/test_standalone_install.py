"""`pip install packages/config` (and config + data) into a clean venv, without MindSpore."""

import os
import subprocess
import sys
import venv

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))


def _venv(path):
    venv.EnvBuilder(with_pip=True).create(path)
    return os.path.join(path, "bin", "python")


def _pip(python, *args):
    proc = subprocess.run([python, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", *args],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]


def test_config_alone(tmp_path):
    py = _venv(str(tmp_path / "v"))
    _pip(py, os.path.join(ROOT, "packages", "config"))
    code = ("import sys, mindtrain.config as c; cfg = c.load_config(sys.argv[1], world_size=2); "
            "assert 'numpy' not in sys.modules and 'mindspore' not in sys.modules; "
            "print(cfg.model.hidden_size)")
    out = subprocess.run([py, "-c", code, os.path.join(ROOT, "configs", "pynative_ds3.yaml")],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "7168"
    listed = subprocess.run([py, "-m", "pip", "list", "--format=freeze"], capture_output=True, text=True).stdout
    assert "numpy" not in listed and "mindspore" not in listed
