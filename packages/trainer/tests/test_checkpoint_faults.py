"""Checkpoint faults (issue 17). Damaged checkpoints are refused before any training starts:
one line naming the file and what to do, exit 2. A save_path that cannot be written, or has
no room, is said before step 1; a save that fails mid-run is one line and training goes on.

A real checkpoint comes from one run of run_mindformer.py (2 steps of the tiny model, saved
at each step); each case damages a copy and loads it with the trainer's Checkpointer, and
one case goes through the command line to show the exit status and that no step ran.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from mindtrain.config import UserError, load_config
from mindtrain.trainer import checkpoint as ck

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
ENTRY = os.path.join(ROOT, "run_mindformer.py")
TINY = os.path.join(ROOT, "configs", "pynative_ds3_tiny.yaml")
FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures")


def _overrides(tmp: str, extra=()) -> list[str]:
    prefix = os.path.join(tmp, "data", "pydoc_text_document")
    return ["training.steps=2", "training.global_batch_size=2", "model.seq_length=32", "compile.enable=false",
            "train_dataset.dataloader.config.seq_length=32", "model.num_hidden_layers=2",
            f"train_dataset.dataloader.config.data_path=['1', '{prefix}']", "parallelism.data_parallel_shard=1",
            f"monitor.metrics_dir={os.path.join(tmp, 'metrics')}", *extra]


def _cli(tmp: str, extra=(), env=None, preexec_fn=None) -> subprocess.CompletedProcess:
    args = [a for item in _overrides(tmp, extra) for a in ("--override", item)]
    return subprocess.run([sys.executable, ENTRY, "--config", TINY, "--mode", "1", *args], cwd=tmp,
                          capture_output=True, text=True, timeout=900, env=env, preexec_fn=preexec_fn)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """save_path with iter_0000001 and iter_0000002 of a real run."""
    from mindtrain.trainer.quickstart import prepare_data

    tmp = str(tmp_path_factory.mktemp("damaged"))
    prepare_data(os.path.join(tmp, "data", "pydoc"))
    save = os.path.join(tmp, "ckpt")
    r = _cli(tmp, ["checkpoint.enable_save=true", "checkpoint.save_interleaved_steps=1", f"checkpoint.save_path={save}"])
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert ck.saved_steps(save) == [1, 2]
    return tmp, save


def _load(tmp: str, load_path: str) -> None:
    from mindtrain.models import build_model

    cfg = load_config(TINY, _overrides(tmp, [f"checkpoint.load_path={load_path}"]))
    ck.Checkpointer(cfg, 0, 1, 1).load_weights(build_model(cfg.model))


def _copy(saved, name: str) -> str:
    tmp, save = saved
    dst = os.path.join(tmp, name)
    shutil.copytree(save, dst)
    return dst


def _refused(tmp: str, load_path: str) -> str:
    with pytest.raises(UserError) as err:
        _load(tmp, load_path)
    message = str(err.value)
    assert "\n" not in message
    return message


MODEL = "model-0000000-0000001.safetensors"  # the one rank's pieces of the weights
OPT = "opt-0000000-0000001.safetensors"


def test_truncated_model_file(saved):
    folder = _copy(saved, "truncated")
    path = os.path.join(folder, "iter_0000002", MODEL)
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)
    msg = _refused(saved[0], folder)
    assert f"'{path}' is damaged (truncated or corrupted" in msg and "earlier iteration" in msg


def test_corrupted_header_and_json(saved):
    folder = _copy(saved, "corrupted")
    path = os.path.join(folder, "iter_0000002", OPT)
    with open(path, "r+b") as f:
        f.seek(8)
        f.write(b"#garbage#")
    msg = _refused(saved[0], folder)  # every file's header is read before the layout is built
    assert f"'{path}' is damaged" in msg, msg
    state = os.path.join(folder, "iter_0000001", "trainer_state.json")
    with open(state, "w") as f:
        f.write('{"step": 1, ')
    assert f"'{state}' is damaged" in _refused(saved[0], os.path.join(folder, "iter_0000001"))


def test_tensor_of_the_wrong_shape_or_dtype(saved):
    from safetensors.numpy import load_file, save_file

    for name, change in (("shape", lambda a: a[:-1]), ("dtype", lambda a: a.astype(np.int32))):
        folder = _copy(saved, f"wrong_{name}")
        path = os.path.join(folder, "iter_0000002", MODEL)
        tensors = load_file(path)
        tensors["model.norm.weight"] = np.ascontiguousarray(change(tensors["model.norm.weight"]))
        save_file(tensors, path)
        msg = _refused(saved[0], folder)
        assert "model.norm.weight" in msg, msg
        if name == "dtype":
            assert "int32" in msg and "floating point" in msg


def test_tracker_naming_a_missing_iteration_offers_the_previous_one(saved):
    folder = _copy(saved, "missing_iteration")
    shutil.rmtree(os.path.join(folder, "iter_0000002"))
    msg = _refused(saved[0], folder)
    previous = os.path.join(folder, "iter_0000001")
    assert "names iteration 2, which is not a complete checkpoint" in msg
    assert f"set checkpoint.load_path={previous}" in msg
    _load(saved[0], previous)  # chosen explicitly, it loads


def test_missing_shard_of_a_sharded_mindformers_checkpoint(tmp_path):
    src = os.path.join(FIXTURES, "mindformers_ckpt", "iteration_00000002")
    folder = str(tmp_path / "iteration_00000002")
    shutil.copytree(src, folder)
    files = sorted(f for f in os.listdir(folder) if f.endswith(".safetensors"))
    meta = {"state_dict_metadata": {}, "storage_data": {}}
    # metadata.json names a rank-1 file that is not there
    from safetensors.numpy import load_file

    from mindtrain.trainer import mindformers_checkpoint as mf
    from mindtrain.trainer import sharded

    arrays = load_file(os.path.join(folder, files[0]))
    name = sorted(arrays)[0]
    shape = list(arrays[name].shape)
    meta["state_dict_metadata"][name] = {"global_shape": shape, "chunk": [{"global_offset": [0] * len(shape),
                                                                             "local_shape": shape}]}
    missing = files[0].replace("0000000-", "0000001-")
    meta["storage_data"][sharded.shard_id(name, (0,) * len(shape))] = [{"file_name": missing}]
    with open(os.path.join(folder, "metadata.json"), "w") as f:
        json.dump(meta, f)
    with pytest.raises(UserError, match=f"'{name}' is stored in '.*{missing}', which is missing"):
        mf.read_checkpoint(folder)


def test_command_line_refuses_before_step_one(saved):
    tmp, _ = saved
    folder = _copy(saved, "cli_truncated")
    path = os.path.join(folder, "iter_0000002", MODEL)
    with open(path, "r+b") as f:
        f.truncate(100)
    r = _cli(tmp, [f"checkpoint.load_path={folder}"])
    assert r.returncode == 2, r.stdout[-2000:] + r.stderr[-2000:]
    errors = [line for line in r.stderr.splitlines() if "error" in line]
    assert len(errors) == 1 and f"'{path}' is damaged" in errors[0], r.stderr[-2000:]
    assert "Traceback" not in r.stderr
    assert "{ step:" not in r.stdout


def _one_error_before_step_one(r: subprocess.CompletedProcess, needle: str) -> None:
    assert r.returncode == 2, r.stdout[-2000:] + r.stderr[-2000:]
    errors = [line for line in r.stderr.splitlines() if "error" in line]
    assert len(errors) == 1 and needle in errors[0], r.stderr[-2000:]
    assert "Traceback" not in r.stderr and "{ step:" not in r.stdout


def test_unwritable_save_path_is_said_before_step_one(saved):
    tmp, _ = saved
    blocker = os.path.join(tmp, "a_file")
    with open(blocker, "w") as f:
        f.write("not a folder")
    r = _cli(tmp, ["checkpoint.enable_save=true", f"checkpoint.save_path={os.path.join(blocker, 'ckpt')}"])
    _one_error_before_step_one(r, f"checkpoint.save_path: '{os.path.join(blocker, 'ckpt')}' cannot be written")


def test_no_room_for_a_checkpoint_is_said_before_step_one(saved):
    import resource

    tmp, _ = saved

    def small_files():  # the largest file this process may write: 256 KiB (a real limit, ulimit -f)
        resource.setrlimit(resource.RLIMIT_FSIZE, (256 << 10, resource.RLIM_INFINITY))

    r = _cli(tmp, ["checkpoint.enable_save=true", f"checkpoint.save_path={os.path.join(tmp, 'limited')}"],
             preexec_fn=small_files)
    _one_error_before_step_one(r, "may write files of at most 0.2 MiB (ulimit -f)")


def test_a_failed_save_mid_run_is_one_line_and_training_goes_on(saved):
    tmp, _ = saved
    save = os.path.join(tmp, "disk_full")
    env = dict(os.environ, MINDTRAIN_FAULT="save_error:2")
    r = _cli(tmp, ["training.steps=4", "checkpoint.enable_save=true", "checkpoint.save_interleaved_steps=2",
                   f"checkpoint.save_path={save}"], env=env)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert ("mindtrain: checkpoint of step 2 not saved (OSError: [Errno 28] No space left on device: "
            "'MINDTRAIN_FAULT'); training goes on, the next save is at step 4") in r.stdout
    assert len([x for x in r.stdout.splitlines() if x.startswith("{ step:")]) == 4
    assert sorted(os.listdir(save)) == ["iter_0000004", ck.TRACKER]  # nothing half-written left
    _load(tmp, save)  # the next interval's checkpoint is whole
