"""Launch a worker script under real msrun and collect its per-rank JSON results."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

WORKERS = Path(__file__).parent / "workers"


def run_msrun(script: str, workers: int, port: int, tmp_path: Path, *args: str, timeout: float = 900,
              env_extra: dict | None = None):
    """Run ``workers/<script>`` on ``workers`` msrun ranks; returns (CompletedProcess, log dir)."""
    env = dict(os.environ, **(env_extra or {}))
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    env.setdefault("GLOG_v", "3")
    log_dir = tmp_path / f"msrun_{script.split('.')[0]}_{workers}"
    cmd = ["msrun", f"--worker_num={workers}", f"--local_worker_num={workers}", f"--master_port={port}",
           f"--log_dir={log_dir}", "--join=True", str(WORKERS / script), *args]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, cwd=tmp_path)
    return proc, log_dir


def worker_logs(log_dir: Path) -> str:
    return "\n".join(p.read_text(errors="replace")[-4000:] for p in sorted(log_dir.glob("worker_*.log")))


def load_results(tmp_path: Path, prefix: str, workers: int) -> list[dict]:
    return [json.loads((tmp_path / f"{prefix}_{r}.json").read_text()) for r in range(workers)]


class _Msrun:
    run = staticmethod(run_msrun)
    logs = staticmethod(worker_logs)
    results = staticmethod(load_results)


@pytest.fixture
def msrun():
    """Helpers: ``msrun.run(script, n, port, tmp_path, *args)``, ``.logs(dir)``, ``.results(...)``."""
    return _Msrun
