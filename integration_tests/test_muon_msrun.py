"""optimizer.type: Muon under msrun: 2 workers with ZeRO-3 (every weight a dim-0 shard, padded
where the rows do not split evenly) give the figures of one process, step after step: each
rank gathers the Newton-Schulz inputs whole, orthogonalises and keeps its own rows. Muon's
arithmetic against torch.optim.Muon and its resume are in packages/trainer/tests/test_muon*.py."""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from mindtrain.trainer.quickstart import free_port, prepare_data, worker_env

pytestmark = pytest.mark.msrun

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
ENTRY = os.path.join(ROOT, "run_mindformer.py")
TINY = os.path.join(ROOT, "configs", "pynative_ds3_tiny.yaml")
FIGURES = ("loss", "load_balancing_loss", "mtp_loss", "grad_norm")


def _start(tmp: str, name: str, workers: int, prefix: str) -> subprocess.Popen:
    items = ["training.steps=4", "training.global_batch_size=4", "optimizer.type=Muon",
             "optimizer.weight_decay=0.1", "lr_scheduler.learning_rate=0.01",
             "optimizer.ns_coefficients=[[[3.4445, -4.7750, 2.0315], 4], [[2.0, -1.5, 0.5], 1]]",
             "model.seq_length=32", "train_dataset.dataloader.config.seq_length=32", "model.num_hidden_layers=2",
             f"train_dataset.dataloader.config.data_path=['1', '{prefix}']", "checkpoint.enable_save=false",
             "parallelism.data_parallel_shard_strategy=optim_grads_params", "compile.enable=false",
             f"monitor.metrics_dir={os.path.join(tmp, name)}"]
    args = ["--config", TINY, "--mode", "1"] + [a for item in items for a in ("--override", item)]
    cmd = [sys.executable, ENTRY, *args] if workers == 1 else [
        "msrun", f"--worker_num={workers}", f"--local_worker_num={workers}", f"--master_port={free_port(8730)}",
        "--join=True", f"--log_dir={os.path.join(tmp, name, 'log')}", ENTRY, *args]
    out = open(os.path.join(tmp, f"{name}.log"), "w")
    return subprocess.Popen(cmd, cwd=tmp, env=worker_env(), stdout=out, stderr=subprocess.STDOUT)


def _rows(tmp: str, name: str, proc: subprocess.Popen) -> list[dict]:
    assert proc.wait(timeout=900) == 0, open(os.path.join(tmp, f"{name}.log"), errors="replace").read()[-5000:]
    (metrics,) = glob.glob(os.path.join(tmp, name, "run_*", "metrics.jsonl"))
    return [json.loads(line) for line in open(metrics)]


def test_two_zero3_workers_equal_one_process(tmp_path):
    tmp = str(tmp_path)
    prefix = prepare_data(os.path.join(tmp, "data", "pydoc"))
    jobs = {name: _start(tmp, name, workers, prefix) for name, workers in (("one", 1), ("two", 2))}
    one, two = (_rows(tmp, name, proc) for name, proc in jobs.items())
    assert [r["step"] for r in one] == [r["step"] for r in two] == [1, 2, 3, 4]
    a = np.array([[r[k] for k in FIGURES] for r in two])
    b = np.array([[r[k] for k in FIGURES] for r in one])
    err = (np.abs(a - b) / np.maximum(np.abs(b), 1e-30)).max()
    print(f"Muon ZeRO-3 2 workers vs 1 process: max relative difference of {FIGURES} over 4 steps: {err:.2e}")
    assert err < 1e-5, (a, b)
    assert one[-1]["loss"] < one[0]["loss"]
