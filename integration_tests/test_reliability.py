"""Real faults under msrun (issue 17): preemption by SIGTERM, a hung rank, a second signal.

``run_mindformer.py`` trains the tiny DeepSeek-V3 (two decoder layers, MTP, 4 sequences of 32
tokens per step) on 2 workers for 6 steps, saving every 3:

- ``ref``: uninterrupted.
- ``pre``: rank 1's worker gets SIGTERM once step 2 is printed. Every rank must stop after
  the same step, save it (off-interval), say so in one line and exit 0; ``resume`` then
  continues from that checkpoint and must print ``ref``'s lines for the remaining steps.
- ``hang``: rank 1 sleeps before step 3 (``MINDTRAIN_FAULT=hang:1:3``) with
  ``monitor.hang_timeout=30``: the job must end soon after, naming rank 1 and step 3, and
  leave no process behind.
- ``pre_msrun``: msrun itself gets SIGTERM once step 2 is printed; it dies without passing
  the signal on, and its workers must stop after a saved step on their own.
- ``double``: one process saving every 2 steps with a slow save window
  (``MINDTRAIN_FAULT=slow_save:8``) gets SIGTERM after step 3, then a second SIGTERM while
  step 3's save has written its files but not renamed them: it exits at once with 143 and
  the step-2 checkpoint stays the newest and whole.

ref, pre, pre_msrun, hang and double start together; resume starts when pre has ended.
"""

from __future__ import annotations

import glob
import json
import os
import re
import signal
import subprocess
import sys
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
STEPS = 6
HANG_TIMEOUT = 30


def _args(tmp: str, name: str, extra=()) -> list[str]:
    prefix = os.path.join(tmp, "data", "pydoc_text_document")
    # eager layers: six steps cost less than compiling them in each of the nine processes
    items = [f"training.steps={STEPS}", "training.global_batch_size=4", "model.seq_length=32", "compile.enable=false",
             "train_dataset.dataloader.config.seq_length=32", "model.num_hidden_layers=2",
             f"train_dataset.dataloader.config.data_path=['1', '{prefix}']",
             "checkpoint.enable_save=true", "checkpoint.save_interleaved_steps=3",
             f"checkpoint.save_path={os.path.join(tmp, name, 'ckpt')}",
             f"monitor.metrics_dir={os.path.join(tmp, name, 'metrics')}", *extra]
    return ["--config", TINY, "--mode", "1"] + [a for item in items for a in ("--override", item)]


def _start(tmp: str, name: str, workers: int = 2, extra=(), port: int = 8620, fault: str = ""):
    os.makedirs(os.path.join(tmp, name), exist_ok=True)
    log_dir = os.path.join(tmp, name, "log")
    if workers == 1:
        cmd = [sys.executable, ENTRY, *_args(tmp, name, extra)]
    else:
        cmd = ["msrun", f"--worker_num={workers}", f"--local_worker_num={workers}",
               f"--master_port={free_port(port)}", "--join=True", f"--log_dir={log_dir}", ENTRY,
               *_args(tmp, name, extra)]
    env = worker_env()
    if fault:
        env["MINDTRAIN_FAULT"] = fault
    console = os.path.join(tmp, name, "console.log")
    with open(console, "w") as out:
        proc = subprocess.Popen(cmd, cwd=tmp, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    return {"proc": proc, "console": console, "log_dir": log_dir, "name": name}


def _text(job) -> str:
    parts = [open(job["console"], errors="replace").read()]
    parts += [open(f, errors="replace").read() for f in sorted(glob.glob(os.path.join(job["log_dir"], "*.log")))]
    return "\n".join(parts)


def _step_lines(job, worker: int = 0) -> list[str]:
    path = os.path.join(job["log_dir"], f"worker_{worker}.log") if os.path.isdir(job["log_dir"]) else job["console"]
    return read_step_lines(path)


def _wait_for(cond, job, timeout: float = 900) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if cond():
            return
        if job["proc"].poll() is not None:
            raise AssertionError(f"{job['name']} ended early:\n{_text(job)[-4000:]}")
        time.sleep(0.1)
    raise AssertionError(f"{job['name']}: timed out waiting")


def _finish(job, timeout: float = 1500) -> int:
    try:
        return job["proc"].wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(job["proc"].pid, signal.SIGKILL)
        raise


def _job_processes(tmp: str, kind: str = "python") -> list[int]:
    """Live processes (not zombies) whose command line names this job's folder: the job's own
    (``kind="python"``: scheduler and workers), or msrun's ``tail -f`` log followers
    (``kind="tail"``), which msrun leaves behind when it is killed itself."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().decode(errors="replace")
            with open(f"/proc/{pid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
            with open(f"/proc/{pid}/comm") as f:
                is_tail = f.read().strip() == "tail"
        except OSError:
            continue
        if tmp in cmd and state != "Z" and is_tail == (kind == "tail"):
            found.append(int(pid))
    return found


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    from mindtrain.trainer.quickstart import prepare_data

    tmp = str(tmp_path_factory.mktemp("faults"))
    prepare_data(os.path.join(tmp, "data", "pydoc"))
    return tmp


def _in_thread(fn, *args) -> threading.Thread:
    """Run a watcher beside the jobs; an exception is kept for the test that joins it."""
    box: dict = {}

    def run():
        try:
            box["result"] = fn(*args)
        except BaseException as err:  # reported by the test
            box["error"] = err

    t = threading.Thread(target=run, daemon=True)
    t.box = box
    t.start()
    return t


def _joined(t: threading.Thread, timeout: float = 1800):
    t.join(timeout)
    assert not t.is_alive(), "watcher did not finish"
    if "error" in t.box:
        raise t.box["error"]
    return t.box["result"]


def _preempt_then_resume(work: str, pre: dict) -> dict:
    """SIGTERM to rank 1's worker once step 2 is printed; when the job has ended, resume it."""
    _wait_for(lambda: len(_step_lines(pre)) >= 2, pre)
    os.kill(worker_pid(pre["proc"].pid, rank=1), signal.SIGTERM)
    rc = _finish(pre)
    resume = _start(work, "resume", port=8623, extra=[f"checkpoint.load_path={os.path.join(work, 'pre', 'ckpt')}"])
    return {"rc": rc, "resume": resume}


def _preempt_msrun(work: str, job: dict) -> dict:
    """SIGTERM to msrun itself once step 2 is printed: msrun dies without passing it on; its
    workers must notice and stop as if signalled. Waits until no process of the job is left."""
    _wait_for(lambda: len(_step_lines(job)) >= 2, job)
    job["proc"].send_signal(signal.SIGTERM)
    job["proc"].wait(timeout=60)
    folder = os.path.join(work, job["name"])
    deadline = time.time() + 600
    while _job_processes(folder) and time.time() < deadline:
        time.sleep(0.5)
    for pid in _job_processes(folder, kind="tail"):  # msrun's, orphaned by its death
        os.kill(pid, signal.SIGKILL)
    return {"left": _job_processes(folder)}


def _watch_hang(hang: dict) -> dict:
    _wait_for(lambda: len(_step_lines(hang)) >= 2, hang)
    second = time.time()
    rc = _finish(hang, timeout=HANG_TIMEOUT + 600)
    return {"rc": rc, "took": time.time() - second}


def _double_signal(work: str, job: dict) -> dict:
    _wait_for(lambda: len(_step_lines(job)) >= 3, job)
    job["proc"].send_signal(signal.SIGTERM)
    ckpt = os.path.join(work, "double", "ckpt")
    # the stop's save (after step 3, or 4 if the signal came after step 3's check) has written
    # its files and not yet renamed the folder into place (an 8 s window)
    pending = lambda: glob.glob(os.path.join(ckpt, ".tmp_iter_000000[34]", "trainer_state.json"))  # noqa: E731
    _wait_for(pending, job, timeout=300)
    job["proc"].send_signal(signal.SIGTERM)
    sent = time.time()
    rc = _finish(job, timeout=60)
    return {"rc": rc, "took": time.time() - sent}


@pytest.fixture(scope="module")
def jobs(work):
    started = {
        "ref": _start(work, "ref", port=8620),
        "pre": _start(work, "pre", port=8621),
        "hang": _start(work, "hang", port=8622, fault="hang:1:3", extra=[f"monitor.hang_timeout={HANG_TIMEOUT}"]),
        "double": _start(work, "double", workers=1, fault="slow_save:8",
                         extra=["checkpoint.save_interleaved_steps=2"]),
        "pre_msrun": _start(work, "pre_msrun", port=8624),
    }
    watchers = {"pre": _in_thread(_preempt_then_resume, work, started["pre"]),
                "hang": _in_thread(_watch_hang, started["hang"]),
                "double": _in_thread(_double_signal, work, started["double"]),
                "pre_msrun": _in_thread(_preempt_msrun, work, started["pre_msrun"])}
    yield started, watchers
    for t in watchers.values():
        if "result" in t.box and "resume" in t.box["result"]:
            started["resume"] = t.box["result"]["resume"]
    for job in started.values():
        if job["proc"].poll() is None:
            os.killpg(job["proc"].pid, signal.SIGKILL)


@pytest.fixture(scope="module")
def reference(jobs):
    started, _ = jobs
    assert _finish(started["ref"]) == 0, _text(started["ref"])[-4000:]
    return _step_lines(started["ref"])


@pytest.fixture(scope="module")
def preempted(jobs):
    started, watchers = jobs
    out = _joined(watchers["pre"])
    pre = started["pre"]
    text = _text(pre)
    assert out["rc"] == 0, text[-4000:]
    m = re.search(r"mindtrain: SIGTERM received: stopped after step (\d+) of 6; checkpoint saved to (\S+);", text)
    assert m, text[-4000:]
    return int(m.group(1)), text, out["resume"]


def test_sigterm_to_one_worker_stops_every_rank_after_a_saved_step(work, jobs, preempted, reference):
    stopped, text, _ = preempted
    pre = jobs[0]["pre"]
    assert 2 <= stopped < STEPS
    # both ranks printed exactly the steps up to the one they stopped after
    for worker in (0, 1):
        lines = _step_lines(pre, worker)
        assert [int(re.match(r"\{ step:\[ *(\d+)/", x).group(1)) for x in lines] == list(range(1, stopped + 1))
    assert [without_timing(x) for x in _step_lines(pre)] == [without_timing(x) for x in reference[:stopped]]
    ckpt = os.path.join(work, "pre", "ckpt")
    assert open(os.path.join(ckpt, "latest_checkpointed_iteration.txt")).read().strip() == str(stopped)
    assert os.path.isdir(os.path.join(ckpt, f"iter_{stopped:07d}"))
    said = [open(os.path.join(pre["log_dir"], f"worker_{w}.log"), errors="replace").read().count("SIGTERM received")
            for w in (0, 1)]
    assert said == [1, 0]  # one line, from rank 0


def test_resume_after_preemption_prints_the_uninterrupted_lines(preempted, reference):
    stopped, _, resume = preempted
    assert _finish(resume) == 0, _text(resume)[-4000:]
    lines = _step_lines(resume)
    assert [without_timing(x) for x in lines] == [without_timing(x) for x in reference[stopped:]]


def test_hung_rank_ends_the_job_naming_rank_and_step(work, jobs):
    started, watchers = jobs
    out = _joined(watchers["hang"])
    text = _text(started["hang"])
    assert out["rc"] != 0
    assert (f"mindtrain: rank 1 hung: no step finished for {HANG_TIMEOUT} s (monitor.hang_timeout) and it never "
            "reached step 3") in text, text[-4000:]
    assert out["took"] < HANG_TIMEOUT + 90, out["took"]
    time.sleep(2)
    assert _job_processes(os.path.join(work, "hang")) == []


def test_second_signal_during_a_save_exits_at_once_keeping_the_last_checkpoint(work, jobs):
    started, watchers = jobs
    out = _joined(watchers["double"])
    assert out["rc"] == 128 + signal.SIGTERM, _text(started["double"])[-3000:]
    assert out["took"] < 5
    ckpt = os.path.join(work, "double", "ckpt")
    assert open(os.path.join(ckpt, "latest_checkpointed_iteration.txt")).read().strip() == "2"
    assert sorted(d for d in os.listdir(ckpt) if d.startswith("iter_")) == ["iter_0000002"]
    from mindtrain.trainer.sharded import ShardedReader

    reader = ShardedReader(os.path.join(ckpt, "iter_0000002"))
    reader.check_files()  # every piece metadata.json names is whole in its file
    assert len(reader.names()) > 10
    assert json.load(open(os.path.join(ckpt, "iter_0000002", "trainer_state.json")))["step"] == 2


def test_sigterm_to_msrun_stops_its_workers_the_same_way(work, jobs, reference):
    started, watchers = jobs
    out = _joined(watchers["pre_msrun"])
    job = started["pre_msrun"]
    assert out["left"] == [], "workers outlived msrun"
    log0 = open(os.path.join(job["log_dir"], "worker_0.log"), errors="replace").read()
    m = re.search(r"mindtrain: msrun ended: stopped after step (\d+) of 6; checkpoint saved to", log0)
    assert m, log0[-3000:]
    stopped = int(m.group(1))
    ckpt = os.path.join(work, "pre_msrun", "ckpt")
    assert open(os.path.join(ckpt, "latest_checkpointed_iteration.txt")).read().strip() == str(stopped)
    assert [without_timing(x) for x in _step_lines(job)] == [without_timing(x) for x in reference[:stopped]]
