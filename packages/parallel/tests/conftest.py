"""Launch a worker script under real msrun and collect its per-rank JSON results."""

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

WORKERS = Path(__file__).parent / "workers"


def _msrun_command(script: str, workers: int, port: int, tmp_path: Path, args, env_extra: dict | None):
    env = dict(os.environ, **(env_extra or {}))
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    env.setdefault("GLOG_v", "3")
    log_dir = tmp_path / f"msrun_{script.split('.')[0]}_{workers}"
    cmd = ["msrun", f"--worker_num={workers}", f"--local_worker_num={workers}", f"--master_port={port}",
           f"--log_dir={log_dir}", "--join=True", str(WORKERS / script), *args]
    return cmd, env, log_dir


def run_msrun(script: str, workers: int, port: int, tmp_path: Path, *args: str, timeout: float = 900,
              env_extra: dict | None = None):
    """Run ``workers/<script>`` on ``workers`` msrun ranks; returns (CompletedProcess, log dir)."""
    cmd, env, log_dir = _msrun_command(script, workers, port, tmp_path, args, env_extra)
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, cwd=tmp_path)
    return proc, log_dir


def start_msrun(script: str, workers: int, port: int, tmp_path: Path, *args: str, env_extra: dict | None = None):
    """Start ``workers/<script>`` on ``workers`` msrun ranks in the background (its own session,
    output to ``<log dir>.out``); returns (Popen, log dir). End it with ``os.killpg``."""
    cmd, env, log_dir = _msrun_command(script, workers, port, tmp_path, args, env_extra)
    with open(f"{log_dir}.out", "w") as out:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, cwd=tmp_path,
                                start_new_session=True)
    return proc, log_dir


def worker_logs(log_dir: Path) -> str:
    return "\n".join(p.read_text(errors="replace")[-4000:] for p in sorted(log_dir.glob("worker_*.log")))


def load_results(tmp_path: Path, prefix: str, workers: int) -> list[dict]:
    return [json.loads((tmp_path / f"{prefix}_{r}.json").read_text()) for r in range(workers)]


class _Msrun:
    run = staticmethod(run_msrun)
    start = staticmethod(start_msrun)
    logs = staticmethod(worker_logs)
    results = staticmethod(load_results)


@pytest.fixture(scope="session")
def msrun():
    """Helpers: ``msrun.run(script, n, port, tmp_path, *args)``, ``.logs(dir)``, ``.results(...)``."""
    return _Msrun


@pytest.fixture(scope="session")
def failure_job(tmp_path_factory):
    """test_failure.py's job (a rank raises; MS_NODE_TIMEOUT 15 s), started at first use:
    test_collectives.py starts it beside its own jobs, since it spends most of its time
    waiting for the failure to be detected. Yields (Popen, log dir, output dir, a dict that
    gets the wall-clock time the job ended, set by a watcher thread)."""
    out = tmp_path_factory.mktemp("failure")
    proc, logs = start_msrun("failure_worker.py", 2, 8204, out, str(out), env_extra={"MS_NODE_TIMEOUT": "15"})
    ended: dict = {}

    def watch():
        proc.wait()
        ended["at"] = time.time()

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    yield proc, logs, out, ended, watcher
    if proc.poll() is None:  # msrun's workers outlive msrun: end the whole session
        os.killpg(proc.pid, signal.SIGKILL)
