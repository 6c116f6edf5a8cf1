"""Metrics JSON lines, the plot command, and the train_state lines."""

import json
import math
import subprocess
import sys

from mindtrain.trainer.metrics import MetricsWriter, new_run_dir, read_metrics
from mindtrain.trainer.monitor import format_train_state, parameter_norms
from mindtrain.trainer.plot import main as plot_main

import numpy as np


def test_metrics_lines_and_plot_png(tmp_path):
    run = new_run_dir(str(tmp_path))
    w = MetricsWriter(run)
    for step in range(1, 6):
        w.write({"step": step, "loss": 5.0 / step, "grad_norm": float("nan") if step == 3 else 1.0,
                 "lr": 1e-3, "load_balancing_loss": 0.1})
    w.close()
    lines = open(f"{run}/metrics.jsonl").read().splitlines()
    assert len(lines) == 5 and json.loads(lines[2])["grad_norm"] == "nan"
    assert [r["step"] for r in read_metrics(str(tmp_path))] == [1, 2, 3, 4, 5]
    assert plot_main([run]) == 0
    png = open(f"{run}/curves.png", "rb").read()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000


def test_plot_console_script_reports_missing_run(tmp_path):
    r = subprocess.run([sys.executable, "-m", "mindtrain.trainer.plot", str(tmp_path / "missing")],
                       capture_output=True, text=True)
    assert r.returncode == 2 and "does not exist" in r.stderr


def test_train_state_lines():
    norms = parameter_norms([("a.weight", np.array([3.0, 4.0], np.float32)), ("b", np.ones((2, 2), np.float32))])
    assert norms == {"a.weight": 5.0, "b": 2.0}
    lines = format_train_state(2, 10, [1.5, 1.25], [1.375, 1.5], norms)
    assert lines[0] == "{ step:[    2/   10], train_state, local_loss: [1.500000, 1.250000] }"
    assert lines[1] == "{ step:[    2/   10], train_state, device_loss: [rank0: 1.375000, rank1: 1.500000] }"
    assert lines[2] == "{ step:[    2/   10], train_state, param_norm: a.weight: 5.000000e+00 }"
    assert math.isclose(float(lines[3].split(": ")[-1].rstrip(" }")), 2.0)
