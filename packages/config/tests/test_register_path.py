"""The one --register_path loader (trainer: every module; data: one class) and StepFigures."""

import os
import sys

import pytest

from mindtrain.config import STEP_FIGURES, StepFigures
from mindtrain.config.register_path import RegisterPathError, load_register_class, load_register_path


def test_a_class_and_the_whole_folder_load_once_under_their_own_names(tmp_path):
    folder = tmp_path / "reg"
    (folder / "mt_cfg_pkg").mkdir(parents=True)
    (folder / "mt_cfg_pkg" / "__init__.py").write_text("")
    (folder / "mt_cfg_pkg" / "tok.py").write_text("class Tok:\n    pass\n")
    (folder / "mt_cfg_mod.py").write_text("import mt_cfg_helper\nclass A:\n    value = mt_cfg_helper.X\n")
    (folder / "mt_cfg_helper.py").write_text("X = 7\n")
    try:
        cls = load_register_class(str(folder), "mt_cfg_pkg.tok.Tok")
        assert cls.__name__ == "Tok" and sys.modules["mt_cfg_pkg.tok"].Tok is cls
        assert os.environ["REGISTER_PATH"] == os.path.realpath(folder)
        assert load_register_path(str(folder)) == ["mt_cfg_helper", "mt_cfg_mod", "mt_cfg_pkg"]
        assert load_register_class(str(folder), "mt_cfg_mod.A").value == 7  # the loaded module, not a copy
        assert load_register_class(str(folder), "mt_cfg_pkg.tok.Tok") is cls
    finally:
        for m in ("mt_cfg_pkg", "mt_cfg_pkg.tok", "mt_cfg_mod", "mt_cfg_helper"):
            sys.modules.pop(m, None)


@pytest.mark.parametrize("name,message", [
    ("noclass", "--auto_register: expected module.ClassName, got 'noclass'"),
    ("json.JSONDecoder", "json.py: not found: --auto_register json.JSONDecoder names a module inside --register_path"),
    ("mt_cfg_empty.Missing", "--auto_register: .*mt_cfg_empty.py defines no class 'Missing'"),
])
def test_mistakes_are_one_line(tmp_path, name, message):
    (tmp_path / "mt_cfg_empty.py").write_text("")
    try:
        with pytest.raises(RegisterPathError, match=message):
            load_register_class(str(tmp_path), name)
    finally:
        sys.modules.pop("mt_cfg_empty", None)
    with pytest.raises(RegisterPathError, match="--register_path: folder '.*nowhere' does not exist"):
        load_register_class(str(tmp_path / "nowhere"), "a.B")


def test_step_figures_are_read_by_name_whatever_order_they_were_packed_in():
    packed = ("loss", "lm_loss", "mtp_loss", "load_balancing_loss")
    f = StepFigures.from_named(packed, [4.0, 1.0, 3.0, 2.0])
    assert f == StepFigures(lm_loss=1.0, load_balancing_loss=2.0, mtp_loss=3.0, loss=4.0)
    assert STEP_FIGURES == ("lm_loss", "load_balancing_loss", "mtp_loss", "loss")
    assert StepFigures.from_model(9.0, {"lm_loss": 8.0, "mtp_loss": 1.0}, 0.0) == StepFigures(8.0, 0.0, 1.0, 9.0)
    with pytest.raises(ValueError, match="StepFigures needs exactly"):
        StepFigures.from_named(("lm_loss", "loss"), [1.0, 2.0])
