"""Checkpoint folders: round trip, tracker, keep-last, atomicity against a crash mid-save."""

import json
import os

import numpy as np
import pytest

from mindtrain.config import UserError
from mindtrain.trainer import checkpoint as ck


def _arrays(seed):
    rng = np.random.default_rng(seed)
    return {"model.embed_tokens.weight": rng.standard_normal((4, 3)).astype(np.float32),
            "model.norm.weight": rng.standard_normal(3).astype(np.float32)}


def test_round_trip_and_tracker(tmp_path):
    w = ck.CheckpointWriter(str(tmp_path))
    folder = w.save(5, {"model.safetensors": _arrays(0)}, {"trainer_state.json": {"step": 5, "consumed": 10}})
    assert os.path.basename(folder) == "iter_0000005"
    assert (tmp_path / ck.TRACKER).read_text().strip() == "5"
    kind, found = ck.resolve_checkpoint(str(tmp_path))
    assert (kind, found) == ("checkpoint", folder)
    back = ck.load_tensors(found, "model.safetensors")
    for k, v in _arrays(0).items():
        np.testing.assert_array_equal(back[k], v)
    assert ck.load_json(found) == {"step": 5, "consumed": 10}
    assert ck.resolve_checkpoint(folder) == ("checkpoint", folder)
    # nothing pickled: the model file is a plain safetensors header + data
    with open(os.path.join(folder, "model.safetensors"), "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        assert "model.norm.weight" in json.loads(f.read(n))


def test_keep_last_prunes_oldest(tmp_path):
    w = ck.CheckpointWriter(str(tmp_path), keep_last=2)
    for step in (2, 4, 6, 8):
        w.save(step, {"model.safetensors": _arrays(step)}, {"trainer_state.json": {"step": step}})
    assert ck.saved_steps(str(tmp_path)) == [6, 8]


def test_resave_same_step_replaces_folder(tmp_path):
    w = ck.CheckpointWriter(str(tmp_path))
    w.save(3, {"model.safetensors": _arrays(1)}, {"trainer_state.json": {"step": 3}})
    w.save(3, {"model.safetensors": _arrays(2)}, {"trainer_state.json": {"step": 3, "again": True}})
    assert ck.load_json(str(tmp_path / "iter_0000003"))["again"] is True
    assert sorted(os.listdir(tmp_path)) == ["iter_0000003", ck.TRACKER]


def test_crash_while_saving_leaves_previous_checkpoint(tmp_path):
    w = ck.CheckpointWriter(str(tmp_path))
    w.save(1, {"model.safetensors": _arrays(1)}, {"trainer_state.json": {"step": 1}})

    class Unserialisable:
        pass

    with pytest.raises(TypeError):  # dies while writing step 2's files
        w.save(2, {"model.safetensors": _arrays(2)}, {"trainer_state.json": {"bad": Unserialisable()}})
    assert ck.saved_steps(str(tmp_path)) == [1]
    assert ck.resolve_checkpoint(str(tmp_path)) == ("checkpoint", str(tmp_path / "iter_0000001"))
    np.testing.assert_array_equal(ck.load_tensors(str(tmp_path / "iter_0000001"), "model.safetensors")["model.norm.weight"],
                                  _arrays(1)["model.norm.weight"])
    w.save(2, {"model.safetensors": _arrays(2)}, {"trainer_state.json": {"step": 2}})  # the leftover is cleaned
    assert ck.saved_steps(str(tmp_path)) == [1, 2]


def test_load_path_errors_are_user_errors(tmp_path):
    with pytest.raises(UserError, match="is not a folder"):
        ck.resolve_checkpoint(str(tmp_path / "nope"))
    with pytest.raises(UserError, match="no trainer_state.json"):
        ck.resolve_checkpoint(str(tmp_path))
    (tmp_path / ck.TRACKER).write_text("7\n")
    with pytest.raises(UserError, match="not a complete checkpoint"):
        ck.resolve_checkpoint(str(tmp_path))
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    assert ck.resolve_checkpoint(str(hf)) == ("hf", str(hf))
