"""A tiny config trained by ``run_mindformer.py`` as one process and as 2 msrun workers at
once, with extra overrides: the metrics rows of both, for tests that compare a feature's
figures across the two. By default the tiny DeepSeek-V3 (two layers, 32 tokens, eager,
ZeRO-3, no save: :data:`BASE`); a test may give its own config and base overrides."""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys

import numpy as np

from mindtrain.trainer.quickstart import free_port, prepare_data, worker_env

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
ENTRY = os.path.join(ROOT, "run_mindformer.py")
TINY = os.path.join(ROOT, "configs", "pynative_ds3_tiny.yaml")
FIGURES = ("loss", "load_balancing_loss", "mtp_loss", "grad_norm")


BASE = ("training.steps=4", "model.seq_length=32", "train_dataset.dataloader.config.seq_length=32",
        "model.num_hidden_layers=2", "parallelism.data_parallel_shard_strategy=optim_grads_params",
        "compile.enable=false")


def _start(tmp: str, name: str, workers: int, prefix: str, extra, port: int | None, config: str = TINY,
           base=BASE) -> subprocess.Popen:
    items = [*base, f"train_dataset.dataloader.config.data_path=['1', '{prefix}']",
             "checkpoint.enable_save=false", f"monitor.metrics_dir={os.path.join(tmp, name)}", *extra]
    args = ["--config", config, "--mode", "1"] + [a for item in items for a in ("--override", item)]
    if port is not None and "MINDTRAIN_TEST_PORT" in os.environ:  # a run beside other suites: their own range
        port = int(os.environ["MINDTRAIN_TEST_PORT"]) + port % 10
    cmd = [sys.executable, ENTRY, *args] if workers == 1 else [
        "msrun", f"--worker_num={workers}", f"--local_worker_num={workers}", f"--master_port={free_port(port)}",
        "--join=True", f"--log_dir={os.path.join(tmp, name, 'log')}", ENTRY, *args]
    out = open(os.path.join(tmp, f"{name}.log"), "w")
    return subprocess.Popen(cmd, cwd=tmp, env=worker_env(), stdout=out, stderr=subprocess.STDOUT)


def _rows(tmp: str, name: str, proc: subprocess.Popen) -> list[dict]:
    assert proc.wait(timeout=900) == 0, open(os.path.join(tmp, f"{name}.log"), errors="replace").read()[-5000:]
    (metrics,) = glob.glob(os.path.join(tmp, name, "run_*", "metrics.jsonl"))
    return [json.loads(line) for line in open(metrics)]


def one_and_two(tmp: str, extra, port: int, two_extra=(), config: str = TINY,
                base=BASE) -> tuple[list[dict], list[dict]]:
    """The metrics rows of one process and of 2 workers (rank 0's), both with ``base`` and
    ``extra`` on ``config``; the workers also with ``two_extra`` (their layout, e.g. tensor
    parallelism)."""
    one, twos = one_and_twos(tmp, extra, {"two": (port, two_extra)}, config, base)
    return one, twos["two"]


def one_and_twos(tmp: str, extra, layouts: dict, config: str = TINY,
                 base=BASE) -> tuple[list[dict], dict]:
    """:func:`one_and_two` for several 2-worker layouts against one single-process run, all
    started at once: ``layouts`` maps a name to ``(port, two_extra)``; returns the one
    process's rows and each layout's (rank 0's), by name."""
    prefix = prepare_data(os.path.join(tmp, "data", "pydoc"))
    runs = {"one": (1, None, ())} | {name: (2, port, tuple(more)) for name, (port, more) in layouts.items()}
    jobs = {name: _start(tmp, name, workers, prefix, [*extra, *more], port, config, base)
            for name, (workers, port, more) in runs.items()}
    rows = {name: _rows(tmp, name, proc) for name, proc in jobs.items()}
    return rows.pop("one"), rows


def max_rel_diff(rows: list[dict], ref: list[dict]) -> float:
    """The largest relative difference of :data:`FIGURES` over the steps."""
    a = np.array([[r[k] for k in FIGURES] for r in rows])
    b = np.array([[r[k] for k in FIGURES] for r in ref])
    return float((np.abs(a - b) / np.maximum(np.abs(b), 1e-30)).max())
