"""--register_path: a folder of user modules is imported and their classes are found by name."""

import os
import subprocess
import sys

import pytest

from mindtrain.trainer.registry import RegisterPathError, RegistryError, load_register_path, lookup, register, registered

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
TINY = os.path.join(ROOT, "configs", "pynative_ds3_tiny.yaml")

MODULE = '''
from mindtrain.trainer.registry import register
from helper_for_{tag} import SCALE  # modules of the folder may import each other


@register("callback", "ScaledPrinter{tag}")
class ScaledPrinter:
    scale = SCALE
'''


def _folder(tmp_path, tag: str):
    folder = tmp_path / f"user_{tag}"
    folder.mkdir()
    (folder / f"cb_{tag}.py").write_text(MODULE.format(tag=tag))
    (folder / f"helper_for_{tag}.py").write_text("SCALE = 3\n")
    (folder / "notes.txt").write_text("not a module\n")
    return folder


def test_folder_modules_register_their_classes(tmp_path):
    folder = _folder(tmp_path, "a")
    assert load_register_path(str(folder)) == ["cb_a", "helper_for_a"]
    cls = lookup("callback", "ScaledPrintera")
    assert cls.scale == 3 and "ScaledPrintera" in registered("callback")
    assert os.environ["REGISTER_PATH"] == os.path.realpath(folder)
    assert load_register_path(str(folder)) == ["cb_a", "helper_for_a"]  # a second load is harmless


def test_lookup_and_register_mistakes_are_one_line(tmp_path):
    @register("callback", "EveryStep")
    class EveryStep:
        pass

    with pytest.raises(RegistryError, match=r"callback 'EveryStp' is not registered \(did you mean 'EveryStep'\?\)"):
        lookup("callback", "EveryStp")
    with pytest.raises(RegistryError, match="registered twice"):
        register("callback", "EveryStep")(type("Other", (), {}))
    with pytest.raises(RegisterPathError, match=r"--register_path: folder '.*missing' does not exist"):
        load_register_path(str(tmp_path / "missing"))
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "broken_mod.py").write_text("raise ValueError('boom')\n")
    with pytest.raises(RegisterPathError, match=r"importing broken_mod.py failed: ValueError: boom"):
        load_register_path(str(bad))
    clash = tmp_path / "clash"
    clash.mkdir()
    (clash / "json.py").write_text("X = 1\n")
    with pytest.raises(RegisterPathError, match="module 'json' .* has the name of an installed module"):
        load_register_path(str(clash))


def test_run_mindformer_imports_the_folder_at_start_up(tmp_path):
    # the folder's module runs before the config is read: its output shows, then the
    # config mistake ends the run (no MindSpore start-up needed)
    folder = tmp_path / "reg"
    folder.mkdir()
    (folder / "announce.py").write_text("print('user module imported', flush=True)\n")
    r = subprocess.run([sys.executable, os.path.join(ROOT, "run_mindformer.py"), "--config", TINY, "--mode", "1",
                        "--register_path", str(folder), "--override", "training.stepz=1"],
                       capture_output=True, text=True, timeout=120, cwd=str(tmp_path))
    assert r.returncode == 2 and r.stdout == "user module imported\n", (r.stdout, r.stderr)
    assert "training.stepz: unknown key" in r.stderr
