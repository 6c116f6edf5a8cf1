"""The quick start end to end: preprocess -> msrun 2 workers -> checkpoint -> kill -> resume.

One uninterrupted 10-step run (A) is the reference. Run B loses a worker after step 6:
the job must end within 60 s naming the rank, with the step-5 checkpoint intact. Run C
resumes from that checkpoint and must print A's lines for steps 6-10 exactly.
"""

from __future__ import annotations

import math
import os
import re
import signal
import subprocess
import time

import pytest

from mindtrain.trainer.quickstart import free_port, worker_env

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
ENTRY = os.path.join(ROOT, "run_mindformer.py")
TINY = os.path.join(ROOT, "configs", "pynative_ds3_tiny.yaml")
LINE = re.compile(
    r"^\{ step:\[ {0,4}(\d+)/ {0,4}(\d+)\], loss: +(-?\d+\.\d{6}), per_step_time: +(\d+)ms, "
    r"load_balancing_loss: +(\d+\.\d{6}), mtp_1_loss: +(\d+\.\d{6}), lr: (\d\.\d{6}e[-+]\d\d), "
    r"grad_norm: +(\d+\.\d{6}), throughput: +(\d+\.\d+)(T) \}$")


def _overrides(tmp, name: str, extra=()) -> list[str]:
    prefix = os.path.join(tmp, "data", "pydoc_text_document")
    items = ["model.seq_length=128", "train_dataset.dataloader.config.seq_length=128",
             f"train_dataset.dataloader.config.data_path=['1', '{prefix}']",
             "checkpoint.enable_save=true", f"checkpoint.save_path={os.path.join(tmp, name, 'ckpt')}",
             "checkpoint.save_interval=5", f"monitor.metrics_dir={os.path.join(tmp, name, 'metrics')}", *extra]
    return [a for item in items for a in ("--override", item)]


def _msrun(tmp, name: str, extra=()) -> tuple[list[str], str]:
    log_dir = os.path.join(tmp, name, "log")
    cmd = ["msrun", "--worker_num=2", "--local_worker_num=2", f"--master_port={free_port(8300)}", "--join=True",
           f"--log_dir={log_dir}", ENTRY, "--config", TINY, "--mode", "1", *_overrides(tmp, name, extra)]
    return cmd, log_dir


def _steps(log_dir: str) -> list[str]:
    with open(os.path.join(log_dir, "worker_0.log"), encoding="utf-8", errors="replace") as f:
        return [line.rstrip("\n") for line in f if line.startswith("{ step:")]


def _without_time(line: str) -> str:
    return re.sub(r"per_step_time: +\d+ms, ", "", re.sub(r", throughput: .*\}$", "", line))


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    from mindtrain.trainer.quickstart import prepare_data

    tmp = str(tmp_path_factory.mktemp("e2e"))
    prepare_data(os.path.join(tmp, "data", "pydoc"))
    return tmp


@pytest.fixture(scope="module")
def run_a(work):
    cmd, log_dir = _msrun(work, "a")
    r = subprocess.run(cmd, cwd=work, env=worker_env(), capture_output=True, text=True, timeout=1800)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return log_dir


def test_ten_steps_in_the_seed_format(work, run_a):
    lines = _steps(run_a)
    assert len(lines) == 10
    parsed = [LINE.match(line) for line in lines]
    assert all(parsed), lines
    assert [int(m.group(1)) for m in parsed] == list(range(1, 11))
    losses = [float(m.group(3)) for m in parsed]
    norms = [float(m.group(8)) for m in parsed]
    assert all(math.isfinite(v) for v in losses + norms)
    assert losses[-1] < losses[0] - 0.5
    assert all(float(m.group(9)) > 0 for m in parsed)  # throughput never prints 0.00
    ckpt = os.path.join(work, "a", "ckpt")
    assert sorted(os.listdir(ckpt)) == ["iter_0000005", "iter_0000010", "latest_checkpointed_iteration.txt"]
    files = sorted(os.listdir(os.path.join(ckpt, "iter_0000010")))
    assert files == ["config.json", "model.safetensors", "optimizer.safetensors", "rank_00000.json",
                     "rank_00001.json", "trainer_state.json"]


def test_worker_killed_mid_run_then_resume_matches(work, run_a):
    cmd, log_dir = _msrun(work, "b")
    proc = subprocess.Popen(cmd, cwd=work, env=worker_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        deadline = time.time() + 1500
        while time.time() < deadline and proc.poll() is None:
            if os.path.exists(os.path.join(log_dir, "worker_0.log")) and len(_steps(log_dir)) >= 6:
                break
            time.sleep(0.2)
        assert proc.poll() is None, "run B ended before step 6"
        victim = _worker_pid(proc.pid, rank=1)
        os.kill(victim, signal.SIGKILL)
        killed = time.time()
        out, _ = proc.communicate(timeout=120)
        took = time.time() - killed
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode != 0
    assert took < 60, f"job took {took:.0f} s to end after a worker died"
    logs = out + "".join(open(os.path.join(log_dir, f)).read() for f in os.listdir(log_dir))
    assert re.search(r"rank 1\b", logs), out[-2000:]
    ckpt = os.path.join(work, "b", "ckpt")
    assert open(os.path.join(ckpt, "latest_checkpointed_iteration.txt")).read().strip() == "5"

    # resume from B's step-5 checkpoint: steps 6-10 are A's, bit for bit
    cmd, log_c = _msrun(work, "c", [f"checkpoint.load_path={ckpt}"])
    r = subprocess.run(cmd, cwd=work, env=worker_env(), capture_output=True, text=True, timeout=1800)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    resumed = _steps(log_c)
    assert [int(LINE.match(x).group(1)) for x in resumed] == [6, 7, 8, 9, 10]
    assert [_without_time(x) for x in resumed] == [_without_time(x) for x in _steps(run_a)[5:]]
    assert [_without_time(x) for x in _steps(log_dir)[:6]] == [_without_time(x) for x in _steps(run_a)[:6]]


def _worker_pid(msrun_pid: int, rank: int) -> int:
    """The pid of msrun's worker with RANK_ID=rank (found through /proc)."""
    for _ in range(50):
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                with open(f"/proc/{pid}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
                with open(f"/proc/{pid}/comm") as f:
                    if f.read().strip() == "tail":
                        continue  # msrun's `tail -f` of the worker's log has the worker's env too
                with open(f"/proc/{pid}/environ", "rb") as f:
                    env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
            except (OSError, ValueError):
                continue
            if env.get(b"MS_ROLE") == b"MS_WORKER" and env.get(b"RANK_ID") == str(rank).encode() \
                    and _descends(int(pid), msrun_pid):
                return int(pid)
        time.sleep(0.1)
    raise AssertionError(f"no worker with RANK_ID={rank} under msrun {msrun_pid}")


def _descends(pid: int, ancestor: int) -> bool:
    while pid > 1:
        if pid == ancestor:
            return True
        try:
            with open(f"/proc/{pid}/stat") as f:
                pid = int(f.read().rsplit(")", 1)[1].split()[1])
        except OSError:
            return False
    return False
