"""The per-run JSON-lines metrics file (one object per logged step)."""

from __future__ import annotations

import json
import math
import os
import time
from typing import Any, Optional

METRICS_FILE = "metrics.jsonl"


def new_run_dir(metrics_dir: str, now: Optional[float] = None) -> str:
    """A fresh ``<metrics_dir>/run_YYYYmmdd-HHMMSS[_N]`` folder."""
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime(now if now is not None else time.time()))
    base = os.path.join(metrics_dir, f"run_{stamp}")
    path, n = base, 1
    while os.path.exists(path):
        n += 1
        path = f"{base}_{n}"
    os.makedirs(path)
    return path


def _jsonable(value: Any) -> Any:
    # JSON has no NaN/inf; keep the information as a string rather than write invalid JSON.
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


class MetricsWriter:
    """Appends one JSON object per call to ``<run_dir>/metrics.jsonl``, flushed each line."""

    def __init__(self, run_dir: str):
        self.run_dir = run_dir
        self.path = os.path.join(run_dir, METRICS_FILE)
        self._file = open(self.path, "a", encoding="utf-8")

    def write(self, record: dict[str, Any]) -> None:
        self._file.write(json.dumps({k: _jsonable(v) for k, v in record.items()}) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def read_metrics(path: str) -> list[dict[str, Any]]:
    """Records of a metrics file, or of the newest run under a folder."""
    if os.path.isdir(path):
        direct = os.path.join(path, METRICS_FILE)
        if os.path.isfile(direct):
            path = direct
        else:
            runs = sorted(d for d in os.listdir(path) if os.path.isfile(os.path.join(path, d, METRICS_FILE)))
            if not runs:
                raise FileNotFoundError(f"no {METRICS_FILE} in '{path}' or its run_* folders")
            path = os.path.join(path, runs[-1], METRICS_FILE)
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]
