"""DeepSeek-V4 under context parallelism equals one process (issue 32).

``run_mindformer.py`` trains configs/pynative_ds4_tiny.yaml (a sliding-window, a compressed
sparse (ratio 4, lightning indexer keeping 16 entries) and a heavily compressed (ratio 16)
layer; hash then learned routing) for 2 steps at 128 tokens, compiled, as one process and as
2 msrun workers with context_parallel=2 (load-balanced chunks of 32 tokens; the sliding
halo, the ratio-4 boundary windows and the compressed entries all-gathered), both at once, the
same global batch (2 sequences in one micro-batch). Each step's loss and gradient norm must
agree within DeepSeek-V3's layout tolerance (1e-5 relative); step 2's figures carry step
1's update, so the weights are compared through them. The simulated-ranks test
(packages/models/tests/test_deepseek_v4_context_parallel.py) checks the scheme in one process.
"""

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
TINY = os.path.join(ROOT, "configs", "pynative_ds4_tiny.yaml")
TOL = 1e-5


def _start(tmp: str, name: str, workers: int, prefix: str, extra) -> subprocess.Popen:
    items = ["training.steps=2", "model.seq_length=128", "train_dataset.dataloader.config.seq_length=128",
             "training.local_batch_size=2", "training.global_batch_size=2",
             f"train_dataset.dataloader.config.data_path=['1', '{prefix}']", "checkpoint.enable_save=false",
             f"monitor.metrics_dir={os.path.join(tmp, name)}", *extra]
    args = ["--config", TINY, "--mode", "1"] + [a for item in items for a in ("--override", item)]
    cmd = [sys.executable, ENTRY, *args] if workers == 1 else [
        "msrun", f"--worker_num={workers}", f"--local_worker_num={workers}", f"--master_port={free_port(9152)}",
        "--join=True", f"--log_dir={os.path.join(tmp, name, 'log')}", ENTRY, *args]
    out = open(os.path.join(tmp, f"{name}.log"), "w")
    return subprocess.Popen(cmd, cwd=tmp, env=worker_env(), stdout=out, stderr=subprocess.STDOUT)


def _rows(tmp: str, name: str, proc: subprocess.Popen) -> list[dict]:
    assert proc.wait(timeout=900) == 0, open(os.path.join(tmp, f"{name}.log"), errors="replace").read()[-5000:]
    (metrics,) = glob.glob(os.path.join(tmp, name, "run_*", "metrics.jsonl"))
    return [json.loads(line) for line in open(metrics)]


def test_cp2_equals_one_process(tmp_path):
    tmp = str(tmp_path)
    prefix = prepare_data(os.path.join(tmp, "data", "pydoc"))
    jobs = {"one": _start(tmp, "one", 1, prefix, []),
            "cp2": _start(tmp, "cp2", 2, prefix, ["parallelism.context_parallel=2",
                                                   "parallelism.data_parallel_shard=1"])}
    one, cp2 = (_rows(tmp, name, proc) for name, proc in jobs.items())
    assert [r["step"] for r in cp2] == [1, 2] == [r["step"] for r in one]
    for key in ("loss", "grad_norm"):
        a, b = np.array([r[key] for r in cp2]), np.array([r[key] for r in one])
        np.testing.assert_allclose(a, b, rtol=TOL, atol=0, err_msg=key)
    assert one[1]["loss"] < one[0]["loss"] - 0.2  # it learns: step 1's update is in step 2's figures
    for row in cp2:  # both CP ranks report the same (whole-batch) loss
        assert np.ptp(row["device_losses"]) <= TOL * abs(row["loss"])
