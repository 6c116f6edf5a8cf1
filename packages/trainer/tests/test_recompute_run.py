"""recompute acts in a real run: run_mindformer.py with a YAML `recompute` section prints the
same step lines (loss, grad norm, load balancing loss) as the run without it, and says
nothing about recompute having no effect."""

from __future__ import annotations

import os
import subprocess
import sys

import yaml

from mindtrain.trainer.log_line import without_timing

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
ENTRY = os.path.join(ROOT, "run_mindformer.py")
TINY = os.path.join(ROOT, "configs", "pynative_ds3_tiny.yaml")


def _start(tmp, name: str, recompute) -> tuple[subprocess.Popen, str]:
    raw = yaml.safe_load(open(TINY))
    if recompute is not None:
        raw["recompute"] = recompute
    path = os.path.join(tmp, f"{name}.yaml")
    with open(path, "w") as f:
        yaml.safe_dump(raw, f)
    prefix = os.path.join(tmp, "data", "pydoc_text_document")
    overrides = ["training.steps=2", "training.global_batch_size=2", "model.seq_length=32",
                 "train_dataset.dataloader.config.seq_length=32", "model.num_hidden_layers=2",
                 f"train_dataset.dataloader.config.data_path=['1', '{prefix}']",
                 "parallelism.data_parallel_shard=1", f"monitor.metrics_dir={os.path.join(tmp, name)}"]
    args = [a for o in overrides for a in ("--override", o)]
    console = os.path.join(tmp, name)
    # files, not pipes: nobody reads them while the runs go on
    with open(f"{console}.out", "w") as out, open(f"{console}.err", "w") as err:
        proc = subprocess.Popen([sys.executable, ENTRY, "--config", path, "--mode", "1", *args], cwd=tmp,
                                stdout=out, stderr=err)
    return proc, console


def _finish(job) -> str:
    proc, console = job
    proc.wait(timeout=900)
    out, err = open(f"{console}.out").read(), open(f"{console}.err").read()
    assert proc.returncode == 0, out[-3000:] + err[-3000:]
    assert "recompute" not in "\n".join(l for l in out.splitlines() if l.startswith("mindtrain: "))
    return out


def _steps(stdout: str) -> list[str]:
    return [without_timing(line) for line in stdout.splitlines() if line.startswith("{ step:")]


def test_recompute_sections_change_no_step_line(tmp_path):
    from mindtrain.trainer.quickstart import prepare_data

    tmp = str(tmp_path)
    prepare_data(os.path.join(tmp, "data", "pydoc"))
    # the three one-process runs (each mostly compiling its layers) run side by side
    jobs = [_start(tmp, "off", None),
            _start(tmp, "full", {"mode": "full", "full_recompute_layer": ["0-2"]}),
            _start(tmp, "select", {"mode": "select",
                                   "select_module": {"self_attention.core_attention": ["0-1"], "mlp.experts": ["1"]}})]
    try:
        off, full, select = (_steps(_finish(job)) for job in jobs)
    finally:
        for proc, _ in jobs:
            if proc.poll() is None:
                proc.kill()
    assert len(off) == 2 and off == full == select, (off, full, select)
