"""Metrics JSON lines and the plot command."""

import json
import subprocess
import sys

from mindtrain.trainer.metrics import MetricsWriter, new_run_dir, read_metrics
from mindtrain.trainer.plot import main as plot_main


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
