"""Per-rank memory against world size: one process, then 2 and 4 msrun workers (ZeRO-3).

    hatch run python benchmarks/bench_scale.py [--workers 1,2,4] [--steps 2] [--config ...]

Each run trains ``benchmarks/configs/ds3_375m.yaml`` (375M parameters) for ``--steps`` steps
on the bundled corpus through ``run_mindformer.py`` and saves once at the end. Every worker's
peak RSS (``VmHWM``) is sampled every 0.1 s. "train" is its peak when every worker has
printed its last step line; then the bench resets each worker's peak (``/proc/PID/clear_refs``
"5" sets VmHWM to the current RSS) and "save" is the peak from there to the worker's exit:
the sharded save (which starts right after the step line, so its first 0.1 s may come before
the reset; the RSS it had then is still counted). Beside them, mindtrain-estimate's per-device
training peak (``total``) and save peak (``save_peak``) for the same layout, and their
errors. The ratio column is a rank's training peak over the one-process one.
"""

from __future__ import annotations

import argparse
import glob
import os
import shutil
import re
import subprocess
import sys
import tempfile
import time

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
ENTRY = os.path.join(ROOT, "run_mindformer.py")
CONFIG = os.path.join(ROOT, "benchmarks", "configs", "ds3_375m.yaml")
LAST = re.compile(r"\{ step:\[\s*(\d+)/\s*(\d+)\]")


def _hwm(pid: int) -> int:
    """Peak RSS of ``pid`` in bytes (0 once it is gone)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _reset_peak(pid: int) -> None:
    """Set ``pid``'s VmHWM to its current RSS (Linux: clear_refs 5)."""
    try:
        with open(f"/proc/{pid}/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def _workers(root_pid: int) -> list[int]:
    """The run_mindformer.py processes under ``root_pid`` (itself included)."""
    out = []
    for status in glob.glob("/proc/[0-9]*/cmdline"):
        pid = int(status.split("/")[2])
        try:
            cmd = open(status, "rb").read().split(b"\0")
        except OSError:
            continue
        if any(c.endswith(b"run_mindformer.py") for c in cmd) and not any(c.endswith(b"msrun") for c in cmd):
            if _descends(pid, root_pid) and _role(pid) in (None, b"MS_WORKER"):
                out.append(pid)
    return sorted(out)


def _role(pid: int):
    """MS_ROLE of ``pid`` (msrun's scheduler runs the same script as MS_SCHED); None outside msrun."""
    try:
        env = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
    except OSError:
        return b"gone"
    return next((e[len(b"MS_ROLE="):] for e in env if e.startswith(b"MS_ROLE=")), None)


def _descends(pid: int, root: int) -> bool:
    while pid > 1:
        if pid == root:
            return True
        try:
            with open(f"/proc/{pid}/stat") as f:
                pid = int(f.read().rsplit(")", 1)[1].split()[1])
        except OSError:
            return False
    return False


def run(workers: int, steps: int, config: str, work: str, data: str) -> dict:
    name = f"w{workers}"
    out_dir = os.path.join(work, name)
    os.makedirs(out_dir, exist_ok=True)
    args = ["--config", config, "--mode", "1",
            "--options", f"training.steps={steps}", f"checkpoint.save_path={os.path.join(out_dir, 'ckpt')}",
            f"train_dataset.dataloader.config.data_path=['1', '{data}']",
            f"monitor.metrics_dir={os.path.join(out_dir, 'metrics')}"]
    from mindtrain.trainer.quickstart import free_port, worker_env

    console = os.path.join(out_dir, "console.log")
    if workers == 1:
        cmd = [sys.executable, ENTRY, *args]
        logs = lambda: [console]  # noqa: E731
    else:
        log_dir = os.path.join(out_dir, "log")
        cmd = ["msrun", f"--worker_num={workers}", f"--local_worker_num={workers}",
               f"--master_port={free_port(8740)}", "--join=True", f"--log_dir={log_dir}", ENTRY, *args]
        logs = lambda: sorted(glob.glob(os.path.join(log_dir, "worker_*.log")))  # noqa: E731
    t0 = time.time()
    with open(console, "w") as f:
        proc = subprocess.Popen(cmd, cwd=work, env=worker_env(), stdout=f, stderr=subprocess.STDOUT,
                                start_new_session=True)
    peak: dict[int, int] = {}  # VmHWM: the training peak, then (after the reset) the save's
    at_last_step: dict[int, int] = {}
    pids: list[int] = []
    while proc.poll() is None:
        if len(pids) < workers:
            pids = sorted(set(pids) | set(_workers(proc.pid)))
        for pid in pids:
            hwm = _hwm(pid)
            if hwm:
                peak[pid] = hwm if pid in at_last_step else max(peak.get(pid, 0), hwm)
        if len(at_last_step) < workers and len(pids) == workers:
            done = sum(1 for path in logs() if _finished(path, steps))
            if done == workers:
                for pid in pids:
                    at_last_step[pid] = max(peak.get(pid, 0), _hwm(pid))
                    _reset_peak(pid)
                    peak[pid] = _hwm(pid)
        time.sleep(0.1)
    if proc.returncode != 0:
        raise SystemExit(f"{name} failed (rc {proc.returncode}); see {console}")
    return {"workers": workers, "train": max(at_last_step.values(), default=0),
            "save": max((peak[p] for p in at_last_step), default=0), "seconds": time.time() - t0}


def _finished(path: str, steps: int) -> bool:
    try:
        text = open(path, errors="replace").read()
    except OSError:
        return False
    return any(int(m.group(1)) == steps for m in LAST.finditer(text))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", default="1,2,4")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--config", default=CONFIG)
    ap.add_argument("--workdir", default=None, help="keep the runs here (default: a temporary folder, "
                                                    "removed at the end: each run saves ~4 GB)")
    a = ap.parse_args()
    from mindtrain.config import load_config
    from mindtrain.trainer.estimate import estimate
    from mindtrain.trainer.quickstart import prepare_data

    work = a.workdir or tempfile.mkdtemp(prefix="bench_scale_")
    data = prepare_data(os.path.join(work, "data", "pydoc"))
    gb = 2 ** 30
    print(f"bench_scale: {os.path.relpath(a.config, ROOT)}, {a.steps} steps and a save, ZeRO-3; work {work}")
    print(f"{'workers':>7} {'train peak/rank':>16} {'estimate':>9} {'error':>6} {'save peak/rank':>15} "
          f"{'estimate':>9} {'error':>6} {'vs 1 process':>12} {'save/train':>10} {'time':>6}")
    one = None
    for n in [int(x) for x in a.workers.split(",")]:
        r = run(n, a.steps, a.config, work, data)
        cfg = load_config(a.config, [f"training.steps={a.steps}"], validate=False)
        est = estimate(cfg, n, device="CPU")
        train, save = est.worst.total, est.worst_save.save_peak
        one = one or r["train"]
        print(f"{n:>7} {r['train'] / gb:>14.2f}GB {train / gb:>7.2f}GB {train / r['train'] - 1:>+6.0%} "
              f"{r['save'] / gb:>13.2f}GB {save / gb:>7.2f}GB {save / r['save'] - 1:>+6.0%} "
              f"{r['train'] / one:>11.2f}x {r['save'] / max(r['train'], 1):>9.2f}x {r['seconds']:>5.0f}s", flush=True)
        if not a.workdir:
            shutil.rmtree(os.path.join(work, f"w{n}", "ckpt"), ignore_errors=True)  # ~4 GB
    if not a.workdir:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
