"""The quick start end to end: preprocess -> msrun 2 workers -> checkpoint -> kill -> resume.

One uninterrupted 10-step run (A) is the reference. Run B loses a worker after step 6:
the job must end within 60 s naming the rank, with the step-5 checkpoint intact. Run C
resumes from that checkpoint and must print A's lines for steps 6-10 exactly.

B starts beside A (a watcher thread kills B's rank 1 once B has printed step 6, then starts
C), so the three runs take little more than A alone; the comparisons wait for all three.
"""

from __future__ import annotations

import math
import os
import re
import signal
import subprocess
import threading
import time

import pytest

from mindtrain.trainer.quickstart import free_port, worker_env
from mindtrain.trainer.log_line import read_step_lines, without_timing
from mindtrain.trainer.runtime import worker_pid

pytestmark = pytest.mark.msrun

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


def _msrun(tmp, name: str, extra=(), port: int = 8300) -> tuple[list[str], str]:
    log_dir = os.path.join(tmp, name, "log")
    cmd = ["msrun", "--worker_num=2", "--local_worker_num=2", f"--master_port={free_port(port)}", "--join=True",
           f"--log_dir={log_dir}", ENTRY, "--config", TINY, "--mode", "1", *_overrides(tmp, name, extra)]
    return cmd, log_dir


def _steps(log_dir: str) -> list[str]:
    return read_step_lines(os.path.join(log_dir, "worker_0.log"))


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    from mindtrain.trainer.quickstart import prepare_data

    tmp = str(tmp_path_factory.mktemp("e2e"))
    prepare_data(os.path.join(tmp, "data", "pydoc"))
    return tmp


def _start(tmp, name: str, extra=(), port: int = 8300) -> tuple[subprocess.Popen, str, str]:
    """Start an msrun job in its own session, its console output in <name>/console.log."""
    cmd, log_dir = _msrun(tmp, name, extra, port)
    os.makedirs(os.path.join(tmp, name), exist_ok=True)
    console = os.path.join(tmp, name, "console.log")
    with open(console, "w") as out:  # a file: a full pipe would stall msrun while nobody reads it
        proc = subprocess.Popen(cmd, cwd=tmp, env=worker_env(), stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    return proc, log_dir, console


def _kill_b_then_resume(work: str, b: dict) -> None:
    """Watch run B: kill its rank 1 once it has printed step 6, time how long the job takes
    to end, then start run C from B's checkpoint."""
    proc, log_dir = b["proc"], b["log_dir"]
    try:
        deadline = time.time() + 1500
        while time.time() < deadline and proc.poll() is None:
            if os.path.exists(os.path.join(log_dir, "worker_0.log")) and len(_steps(log_dir)) >= 6:
                break
            time.sleep(0.2)
        b["ended_early"] = proc.poll() is not None
        if b["ended_early"]:
            return
        victim = worker_pid(proc.pid, rank=1)
        os.kill(victim, signal.SIGKILL)
        killed = time.time()
        proc.wait(timeout=120)
        b["took"] = time.time() - killed
        ckpt = os.path.join(work, "b", "ckpt")
        b["c"] = _start(work, "c", [f"checkpoint.load_path={ckpt}"], port=8510)
    except BaseException as err:  # reported by the test
        b["error"] = err


@pytest.fixture(scope="module")
def runs(work):
    """Run A, and run B beside it (watched, killed, then resumed as run C)."""
    a = _start(work, "a")
    proc, log_dir, console = _start(work, "b", port=8510)
    b = {"proc": proc, "log_dir": log_dir, "console": console}
    watcher = threading.Thread(target=_kill_b_then_resume, args=(work, b), daemon=True)
    watcher.start()
    yield a, b, watcher
    for p in [a[0], b["proc"]] + ([b["c"][0]] if "c" in b else []):
        if p.poll() is None:  # msrun's workers outlive msrun: end the whole session
            os.killpg(p.pid, signal.SIGKILL)


@pytest.fixture(scope="module")
def run_a(runs):
    proc, log_dir, console = runs[0]
    proc.wait(timeout=1800)
    assert proc.returncode == 0, open(console, errors="replace").read()[-6000:]
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
    # sharded: each worker's pieces of the weights and AdamW moments (ZeRO shards); replicas once
    assert files == ["config.json", "metadata.json", "model-0000000-0000002.safetensors",
                     "model-0000001-0000002.safetensors", "opt-0000000-0000002.safetensors",
                     "opt-0000001-0000002.safetensors", "rank_00000.json", "rank_00001.json",
                     "trainer_state.json"]


def test_worker_killed_mid_run_then_resume_matches(work, runs, run_a):
    _, b, watcher = runs
    proc, log_dir = b["proc"], b["log_dir"]
    watcher.join(timeout=1800)
    assert not watcher.is_alive(), "run B's watcher did not finish"
    if "error" in b:
        raise b["error"]
    assert not b["ended_early"], "run B ended before step 6"
    took = b["took"]
    out = open(b["console"], errors="replace").read()
    assert proc.returncode != 0
    assert took < 60, f"job took {took:.0f} s to end after a worker died"
    logs = out + "".join(open(os.path.join(log_dir, f)).read() for f in os.listdir(log_dir))
    assert re.search(r"rank 1\b", logs), out[-2000:]
    ckpt = os.path.join(work, "b", "ckpt")
    assert open(os.path.join(ckpt, "latest_checkpointed_iteration.txt")).read().strip() == "5"

    # resume from B's step-5 checkpoint: steps 6-10 are A's, bit for bit
    c, log_c, console_c = b["c"]
    c.wait(timeout=1800)
    assert c.returncode == 0, open(console_c, errors="replace").read()[-6000:]
    resumed = _steps(log_c)
    assert [int(LINE.match(x).group(1)) for x in resumed] == [6, 7, 8, 9, 10]
    assert [without_timing(x) for x in resumed] == [without_timing(x) for x in _steps(run_a)[5:]]
    assert [without_timing(x) for x in _steps(log_dir)[:6]] == [without_timing(x) for x in _steps(run_a)[:6]]
