"""A MindFormers user's config and launch line, unchanged but for data path and sizes.

``configs/mindformers_ds3_tiny.yaml`` uses every section and field that MindFormers' own
PyNative DeepSeek-V3 YAMLs use, in MindFormers' names. A copy with only the data path, the
sequence length and the step count changed trains 3 steps under msrun with 2 workers,
launched with the real ``run_mindformer.py`` flags ``--run_mode train --use_parallel True
--output_dir D``. Every worker's log shows the step lines; start-up notes come once, from
rank 0.
"""

from __future__ import annotations

import math
import os
import re
import subprocess

import pytest
import yaml

from mindtrain.trainer.quickstart import free_port, prepare_data, worker_env

pytestmark = pytest.mark.msrun

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
ENTRY = os.path.join(ROOT, "run_mindformer.py")
CONFIG = os.path.join(ROOT, "configs", "mindformers_ds3_tiny.yaml")
STEP = re.compile(r"^\{ step:\[ {0,4}(\d+)/ {0,4}3\], loss: +(\d+\.\d{6}), per_step_time: +\d+ms, "
                  r"load_balancing_loss: +\d+\.\d{6}, mtp_1_loss: +\d+\.\d{6}, lr: \d\.\d{6}e[-+]\d\d, "
                  r"grad_norm: +(\d+\.\d{6}), throughput: +\d+\.\d+T \}$")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("mf"))
    prefix = prepare_data(os.path.join(tmp, "data", "pydoc"))
    with open(CONFIG, encoding="utf-8") as f:
        raw = yaml.safe_load(f)
    # only the data path and the sizes change
    raw["train_dataset"]["dataloader"]["config"]["data_path"] = ["1", prefix]
    raw["train_dataset"]["dataloader"]["config"]["seq_length"] = 64
    raw["model"]["seq_length"] = 64
    raw["training"]["steps"] = 3
    config = os.path.join(tmp, "my_ds3.yaml")
    with open(config, "w", encoding="utf-8") as f:
        yaml.safe_dump(raw, f, sort_keys=False)
    out = os.path.join(tmp, "out")
    log_dir = os.path.join(tmp, "log")
    cmd = ["msrun", "--worker_num=2", "--local_worker_num=2", f"--master_port={free_port(8550)}", "--join=True",
           f"--log_dir={log_dir}", ENTRY, "--config", config, "--mode", "1", "--run_mode", "train",
           "--use_parallel", "True", "--output_dir", out]
    r = subprocess.run(cmd, cwd=tmp, env=worker_env(), capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    logs = {}
    for rank in (0, 1):
        with open(os.path.join(log_dir, f"worker_{rank}.log"), encoding="utf-8", errors="replace") as f:
            logs[rank] = f.read().splitlines()
    return logs


def test_every_worker_prints_three_seed_format_steps(run):
    for rank, lines in run.items():
        steps = [STEP.match(line) for line in lines if line.startswith("{ step:")]
        assert len(steps) == 3 and all(steps), (rank, lines[-20:])
        assert [int(m.group(1)) for m in steps] == [1, 2, 3]
        assert all(math.isfinite(float(m.group(2))) and math.isfinite(float(m.group(3))) for m in steps)


def test_startup_notes_once_from_rank_zero(run):
    flash = [line for line in run[0] if line.startswith("mindtrain: ") and "use_flash_attention" in line]
    assert len(flash) == 1, run[0][:40]
    assert not [line for line in run[1] if line.startswith("mindtrain: ") and "use_flash_attention" in line]
    # the config's recompute section acts (#16): no start-up note about it
    assert not [line for line in run[0] if line.startswith("mindtrain: ") and "recompute" in line]
