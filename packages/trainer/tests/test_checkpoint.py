"""Checkpoint folders: round trip, tracker, keep-last, atomicity against a crash mid-save,
async saves, MindFormers' layout (written, and read full or sharded)."""

import json
import os
from types import SimpleNamespace

import numpy as np
import pytest

from mindtrain.config import UserError
from mindtrain.trainer import checkpoint as ck
from mindtrain.trainer import mindformers_checkpoint as mf


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


_KILLED_ASYNC_SAVE = r"""
import os, signal, sys
import numpy as np
from mindtrain.trainer import checkpoint as ck

w = ck.CheckpointWriter(sys.argv[1], async_save=True)
arrays = {"model.norm.weight": np.arange(3, dtype=np.float32)}
w.save(1, {"model.safetensors": arrays}, {"trainer_state.json": {"step": 1}})
w.wait()


def dying(path, tensors):  # the process is killed half-way through step 2's files
    with open(path, "wb") as f:
        f.write(b"partial")
    os.kill(os.getpid(), signal.SIGKILL)


ck.save_tensors = dying
w.save(2, {"model.safetensors": {"model.norm.weight": arrays["model.norm.weight"] + 1}},
       {"trainer_state.json": {"step": 2}})
w.wait()
"""


def test_killed_async_save_leaves_previous_checkpoint(tmp_path):
    import signal
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", _KILLED_ASYNC_SAVE, str(tmp_path)], capture_output=True, text=True)
    assert done.returncode == -signal.SIGKILL, done.stderr
    assert (tmp_path / ".tmp_iter_0000002").is_dir()  # the killed save's leftovers, never published
    assert ck.saved_steps(str(tmp_path)) == [1]
    kind, folder = ck.resolve_checkpoint(str(tmp_path))
    assert (kind, folder) == ("checkpoint", str(tmp_path / "iter_0000001"))
    np.testing.assert_array_equal(ck.load_tensors(folder, "model.safetensors")["model.norm.weight"],
                                  np.arange(3, dtype=np.float32))


def test_async_save_publishes_at_wait_and_keeps_earlier_runs(tmp_path):
    ck.CheckpointWriter(str(tmp_path)).save(1, {"model.safetensors": _arrays(1)}, {"trainer_state.json": {}})
    w = ck.CheckpointWriter(str(tmp_path), keep_last=1, async_save=True)
    arrays = _arrays(2)
    w.save(2, {"model.safetensors": arrays}, {"trainer_state.json": {"step": 2}})
    arrays["model.norm.weight"][:] = 0  # training overwrites its buffers: the save holds a copy
    w.save(3, {"model.safetensors": _arrays(3)}, {"trainer_state.json": {"step": 3}})  # waits for step 2
    assert (tmp_path / ck.TRACKER).read_text().strip() == "2"
    w.wait()
    assert (tmp_path / ck.TRACKER).read_text().strip() == "3"
    # save_max counts this run's saves only (MindFormers' rule): step 1 of the earlier run stays
    assert ck.saved_steps(str(tmp_path)) == [1, 3]


def _mf_files(world=1, prefix="checkpoint"):
    weights = _arrays(7)
    state = {"step": np.array(4, np.int64), "exp_avg.model.norm.weight": np.ones(3, np.float32),
             "exp_avg_sq.model.norm.weight": np.full(3, 2, np.float32),
             "exp_avg.model.embed_tokens.weight": np.ones((4, 3), np.float32),
             "exp_avg_sq.model.embed_tokens.weight": np.ones((4, 3), np.float32)}
    return weights, state, mf.checkpoint_files(weights, state, prefix, world, mf.common_info(4, 10, 8, 32))


def test_mindformers_layout_round_trip(tmp_path):
    weights, state, (tensors, files) = _mf_files(world=2, prefix="ds3")
    w = ck.CheckpointWriter(str(tmp_path), keep_last=2, layout="mindformers", world_size=1)
    for step in (2, 4, 6):
        folder = w.save(step, tensors, files)
    assert os.path.basename(folder) == "iteration_00000006"
    assert sorted(os.listdir(tmp_path)) == ["iteration_00000004", "iteration_00000006", ck.TRACKER]
    assert (tmp_path / ck.TRACKER).read_text() == "6"
    assert ck.resolve_checkpoint(str(tmp_path)) == ("mindformers", folder)
    assert sorted(os.listdir(folder)) == ["common.json", "ds3-model-0000000-0000002.safetensors",
                                          "ds3-opt-0000000-0000002.safetensors", "metadata.json"]
    model, opt, common = mf.read_checkpoint(folder, workers=2)
    for k, v in weights.items():
        np.testing.assert_array_equal(model[k], v)
    assert opt["global_step"].tolist() == [4] and set(opt) == {
        "global_step", "adam_m.model.norm.weight", "adam_v.model.norm.weight",
        "adam_m.model.embed_tokens.weight", "adam_v.model.embed_tokens.weight"}
    assert mf.state_from_common(common, 8) == {"step": 4, "consumed_samples": 32, "skipped_total": 0,
                                                "skipped_in_row": 0}
    # read back box by box under the network's names, moments and step included
    cfg = SimpleNamespace(num_hidden_layers=1, num_nextn_predict_layers=0)
    boxes = mf.MindFormersBoxes(folder, cfg, {n: a.shape for n, a in weights.items()})
    boxes.check_moments(list(weights))
    assert int(boxes.read_full("step")) == 4
    np.testing.assert_array_equal(boxes.read_full("exp_avg_sq.model.norm.weight"), state["exp_avg_sq.model.norm.weight"])
    np.testing.assert_array_equal(boxes.read("model.embed_tokens.weight", (1, 1), (2, 2)),
                                  weights["model.embed_tokens.weight"][1:3, 1:3])
    # an optimizer file without a parameter's moments is one line naming the first lacking
    del state["exp_avg.model.embed_tokens.weight"]
    tensors, files = mf.checkpoint_files(weights, state, "ds3", 1, mf.common_info(4, 10, 8, 32))
    folder = w.save(8, tensors, files)
    with pytest.raises(UserError, match="no 'adam_m.model.embed_tokens.weight'.*no_load_optim"):
        mf.MindFormersBoxes(folder, cfg, {n: a.shape for n, a in weights.items()}).check_moments(list(weights))


def _write_safetensors(path, tensors):
    """The safetensors format by hand (8-byte header length, JSON header, data), so BF16
    can be written without a bfloat16 numpy type."""
    header, offset = {}, 0
    for name, t in tensors.items():
        header[name] = {"dtype": t["dtype"], "shape": t["shape"], "data_offsets": [offset, offset + len(t["data"])]}
        offset += len(t["data"])
    raw = json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little") + raw + b"".join(t["data"] for t in tensors.values()))


def _bf16(a):
    return (a.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)


def test_sharded_mindformers_checkpoint_is_assembled(tmp_path):
    """Two ranks' files as MindFormers writes them with a sharded layout: each holds its
    row half of the embedding (BF16, MindFormers' usual params_dtype) under the full name,
    the replicated norm stored by rank 0; metadata.json says where each chunk lives."""
    emb = np.arange(24, dtype=np.float32).reshape(4, 6)  # exact in BF16
    folder = tmp_path / "iteration_00000003"
    folder.mkdir()
    for rank in (0, 1):
        tensors = {"model.embed_tokens.weight": {"dtype": "BF16", "shape": [2, 6],
                                                 "data": _bf16(emb[2 * rank:2 * rank + 2]).tobytes()}}
        if rank == 0:
            tensors["model.norm.weight"] = {"dtype": "F32", "shape": [6], "data": np.ones(6, np.float32).tobytes()}
        _write_safetensors(folder / f"checkpoint-model-{rank:07d}-0000002.safetensors", tensors)
    meta = {"state_dict_metadata": {
        "model.embed_tokens.weight": {"properties": {"dtype": "BFloat16", "replica_id": 0}, "global_shape": [4, 6],
                                      "axis_fragmentations": [2, 1], "layout": None,
                                      "chunk": [{"global_offset": [0, 0], "local_shape": [2, 6]},
                                                {"global_offset": [2, 0], "local_shape": [2, 6]}]},
        "model.norm.weight": {"properties": {"dtype": "Float32", "replica_id": 0}, "global_shape": [6],
                              "axis_fragmentations": [1], "layout": None,
                              "chunk": [{"global_offset": [0], "local_shape": [6]}]}},
        "storage_data": {
            "('model.embed_tokens.weight', (0, 0))": [{"file_name": "checkpoint-model-0000000-0000002.safetensors",
                                                       "storage_rank": 0, "rank_group": [0]}],
            "('model.embed_tokens.weight', (2, 0))": [{"file_name": "checkpoint-model-0000001-0000002.safetensors",
                                                       "storage_rank": 1, "rank_group": [1]}],
            "('model.norm.weight', (0,))": [{"file_name": "checkpoint-model-0000000-0000002.safetensors",
                                             "storage_rank": 0, "rank_group": [0, 1]}]}}
    (folder / "metadata.json").write_text(json.dumps(meta))
    (folder / "common.json").write_text(json.dumps(mf.common_info(3, 10, 4, 12)))
    (tmp_path / ck.TRACKER).write_text("3")
    kind, found = ck.resolve_checkpoint(str(tmp_path))
    assert (kind, found) == ("mindformers", str(folder))
    model, opt, common = mf.read_checkpoint(found)
    np.testing.assert_array_equal(model["model.embed_tokens.weight"], emb)
    np.testing.assert_array_equal(model["model.norm.weight"], np.ones(6, np.float32))
    assert opt == {} and common["global_step"] == 3
    # a lost rank file is named
    os.remove(folder / "checkpoint-model-0000001-0000002.safetensors")
    with pytest.raises(UserError, match=r"'model.embed_tokens.weight' is stored in '.*checkpoint-model-0000001-0000002"
                                        r"\.safetensors', which is missing"):
        mf.read_checkpoint(found)


def test_resume_checks_seed_and_schedule_against_the_run(tmp_path):
    from mindtrain.config import load_config
    from mindtrain.trainer.lr_schedule import LRSchedule

    root = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
    cfg = load_config(os.path.join(root, "configs", "pynative_ds3_tiny.yaml"), ["training.seed=7", "training.steps=10"])
    lines = []
    c = ck.Checkpointer(cfg, rank=0, world_size=1, dp=1, out=lines.append)
    schedule = LRSchedule.from_config(cfg)
    state = {"step": 4, "seed": 7, "lr_schedule": ck.schedule_state(schedule)}
    c.check_resume(state, schedule, "f")
    assert lines == []
    # Megatron's --override-opt_param-scheduler: the config's schedule goes on, said in one line
    longer = LRSchedule.from_config(load_config(os.path.join(root, "configs", "pynative_ds3_tiny.yaml"),
                                                ["training.seed=7", "training.steps=20"]))
    c.check_resume(state, longer, "f")
    assert len(lines) == 1 and lines[0].startswith("mindtrain: warning: the learning-rate schedule differs")
    assert "total 10 -> 20" in lines[0] and "\n" not in lines[0]
    with pytest.raises(ck.CheckpointError, match=r"^training.seed: 7 differs from the checkpoint's 3 \(f\); "
                                                 r"resume with training.seed: 3"):
        c.check_resume(dict(state, seed=3), schedule, "f")
    c.check_resume({"step": 4}, longer, "f")  # a MindFormers-written checkpoint records neither
    assert len(lines) == 1
