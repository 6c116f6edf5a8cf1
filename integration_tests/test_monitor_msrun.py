"""monitor.train_state and TensorBoard across 2 msrun workers (FSDP): each worker logs its
own micro-batch losses and gradient-shard norms, rank 0 the gathered figures, and only
rank 0 writes event files. One short launch (2 steps, tiny sizes)."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess

import pytest

from mindtrain.trainer.quickstart import free_port, prepare_data, worker_env

pytestmark = pytest.mark.msrun

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
ENTRY = os.path.join(ROOT, "run_mindformer.py")
TINY = os.path.join(ROOT, "configs", "pynative_ds3_tiny.yaml")
NORM = re.compile(r'^\{ "(local_norm|device_norm)": (\S+):\s+(\S+) \}$')
EMBED = "model.embed_tokens.weight"


def _records(log: str) -> tuple[list[dict], dict[str, list[float]]]:
    records, norms = [], {"local_norm": [], "device_norm": []}
    with open(log, encoding="utf-8", errors="replace") as f:
        for line in f:
            line = line.rstrip("\n")
            if line.startswith('{"step"'):
                records.append(json.loads(line))
            m = NORM.match(line)
            if m and m.group(2) == EMBED:
                norms[m.group(1)].append(float(m.group(3)))
    return records, norms


def test_train_state_per_rank_and_tensorboard_on_rank0(tmp_path):
    prefix = prepare_data(str(tmp_path / "data" / "pydoc"))
    tb = tmp_path / "tb"
    items = ["model.seq_length=32", "train_dataset.dataloader.config.seq_length=32", "model.num_hidden_layers=2",
             "training.steps=2", f"train_dataset.dataloader.config.data_path=['1', '{prefix}']",
             f"monitor.metrics_dir={tmp_path / 'metrics'}", "monitor.train_state.local_loss=true",
             f"monitor.train_state.local_norm={EMBED}", f"monitor.train_state.device_norm={EMBED}",
             "monitor.train_state.device_loss=true", f"monitor.tensorboard.tensorboard_dir={tb}",
             "compile.enable=false"]
    log_dir = tmp_path / "log"
    cmd = ["msrun", "--worker_num=2", "--local_worker_num=2", f"--master_port={free_port(8350)}", "--join=True",
           f"--log_dir={log_dir}", ENTRY, "--config", TINY, "--mode", "1",
           *[a for item in items for a in ("--override", item)]]
    r = subprocess.run(cmd, cwd=str(tmp_path), env=worker_env(), capture_output=True, text=True, timeout=1500)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    rec0, norms0 = _records(str(log_dir / "worker_0.log"))
    rec1, norms1 = _records(str(log_dir / "worker_1.log"))
    # each worker: its own micro-batch losses (global batch 2 over 2 ranks: one each per step)
    local0 = [r["local_loss"] for r in rec0 if "local_loss" in r]
    local1 = [r["local_loss"] for r in rec1 if "local_loss" in r]
    assert len(local0) == len(local1) == 2 and local0 != local1
    # rank 0 alone: every rank's loss and their mean
    dev = [r for r in rec0 if "device_loss" in r]
    assert not any("device_loss" in r for r in rec1) and len(dev) == 2
    for step, d in enumerate(dev):
        assert d["ranks"] == pytest.approx([local0[step], local1[step]], rel=1e-6)
        assert d["device_loss"] == pytest.approx((local0[step] + local1[step]) / 2, rel=1e-6)
    # FSDP shards the embedding gradient over the 2 ranks: the shards' norms make up the
    # whole gradient's norm, which rank 0 prints
    assert len(norms0["local_norm"]) == len(norms1["local_norm"]) == 2 and not norms1["device_norm"]
    for step in range(2):
        whole = math.hypot(norms0["local_norm"][step], norms1["local_norm"][step])
        assert norms0["device_norm"][step] == pytest.approx(whole, rel=1e-5), step
    # TensorBoard from rank 0 only: one event file
    assert len([f for f in os.listdir(tb) if f.startswith("events.out.tfevents.")]) == 1
