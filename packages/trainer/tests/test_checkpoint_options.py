"""MindFormers' checkpoint options in one process: async_save overlaps training and gives the
synchronous figures, the MindFormers layout resumes exactly, save_max keeps this run's newest,
no_save_optim writes weights only, no_load_optim loads weights only."""

import os
import threading

import numpy as np
from safetensors.numpy import load_file

from mindtrain.trainer import checkpoint as ckpt
from mindtrain.trainer.runtime import Runtime
from mindtrain.trainer.trainer import Trainer

FIGURES = ("loss", "grad_norm", "load_balancing_loss", "mtp_loss", "lr", "total_loss")


def test_async_mindformers_layout_and_weights_only(tiny_config, tmp_path, monkeypatch):
    # A: synchronous, mindtrain layout, weights only, a save every step, newest 2 kept
    a_dir = tmp_path / "a"
    sync = Trainer(tiny_config("checkpoint.enable_save=true", f"checkpoint.save_path={a_dir}",
                               "checkpoint.save_interleaved_steps=1", "checkpoint.save_max=2",
                               "checkpoint.no_save_optim=true"), Runtime(device="CPU"), out=lambda _: None).train()
    assert sorted(os.listdir(a_dir)) == ["iter_0000002", "iter_0000003", ckpt.TRACKER]
    assert sorted(os.listdir(a_dir / "iter_0000003")) == ["config.json", "metadata.json",
                                                          "model-0000000-0000001.safetensors", ckpt.STATE_FILE]

    # B: async_save in MindFormers' layout; step 1's files are written by a deliberately slow
    # writer that finishes only once step 2 has started
    b_dir = tmp_path / "b"
    order: list[str] = []
    step2_started = threading.Event()
    real_save = ckpt.save_tensors

    def slow_save(path, tensors):
        if ".tmp_iteration_00000001" in path:
            step2_started.wait(timeout=300)
            order.append("step 1 file written")
        real_save(path, tensors)

    monkeypatch.setattr(ckpt, "save_tensors", slow_save)
    lines: list[str] = []
    t = Trainer(tiny_config("checkpoint.enable_save=true", f"checkpoint.save_path={b_dir}",
                            "checkpoint.save_interleaved_steps=1", "checkpoint.save_max=2",
                            "checkpoint.async_save=true", "checkpoint.layout=mindformers", "checkpoint.prefix=ds3"),
                Runtime(device="CPU"), out=lines.append)
    real_step = t.train_step

    def step():
        if t.step == 1:
            order.append("step 2 started")
            step2_started.set()
        return real_step()

    t.train_step = step
    overlapped = t.train()
    monkeypatch.setattr(ckpt, "save_tensors", real_save)
    assert order[:2] == ["step 2 started", "step 1 file written"]
    for x, y in zip(sync, overlapped):
        for key in FIGURES:
            assert x[key] == y[key], (x["step"], key)
    assert sorted(os.listdir(b_dir)) == ["iteration_00000002", "iteration_00000003", ckpt.TRACKER]
    assert (b_dir / ckpt.TRACKER).read_text() == "3"
    files = sorted(os.listdir(b_dir / "iteration_00000002"))
    assert {"ds3-model-0000000-0000001.safetensors", "ds3-opt-0000000-0000001.safetensors",
            "common.json", "metadata.json"} <= set(files), files
    opt = load_file(str(b_dir / "iteration_00000002" / "ds3-opt-0000000-0000001.safetensors"))
    assert opt["global_step"].tolist() == [2] and any(k.startswith("adam_m.") for k in opt)

    # C: resume from the MindFormers-layout folder: step 3 as in the uninterrupted run
    resumed = Trainer(tiny_config(f"checkpoint.load_path={b_dir / 'iteration_00000002'}"),
                      Runtime(device="CPU"), out=lines.append).train()
    assert [r["step"] for r in resumed] == [3]
    for key in FIGURES:
        assert resumed[0][key] == sync[2][key], key

    # D: a weights-only checkpoint resumes weights only, saying so in one line
    notes: list[str] = []
    w = Trainer(tiny_config(f"checkpoint.load_path={a_dir}"), Runtime(device="CPU"), out=notes.append)
    said = [x for x in notes if "weights only" in x]
    assert w.step == 0 and len(said) == 1 and "checkpoint.no_save_optim" in said[0], notes
    saved = load_file(str(a_dir / "iter_0000003" / "model-0000000-0000001.safetensors"))  # one rank: whole tensors
    got = {p.name: p.asnumpy() for p in w.model.get_parameters()}
    np.testing.assert_array_equal(got["model.norm.weight"], saved["model.norm.weight"])

    # E: no_load_optim on a full checkpoint: weights only, fresh optimizer, step 0
    notes.clear()
    e = Trainer(tiny_config(f"checkpoint.load_path={b_dir}", "checkpoint.no_load_optim=true"),
                Runtime(device="CPU"), out=notes.append)
    assert e.step == 0 and e.optimizer.step_count == 0
    assert any("checkpoint.no_load_optim is true" in x for x in notes), notes
