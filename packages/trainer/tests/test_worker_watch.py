"""msrun's scheduler names the rank whose worker died first, even when msrun has killed the
other workers by the time the scheduler reports (real processes, a launcher like msrun's)."""

import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.msrun  # several processes

SCHEDULER = textwrap.dedent("""
    import time
    from mindtrain.trainer.runtime import WorkerWatch, scheduler_message
    w = WorkerWatch(expected=3)
    print("ready" if w.wait_watching(60) else "not watching", flush=True)
    time.sleep(1.0)
    # by now every worker is gone: only what the watch saw can name the first
    text = "worker 0 is the first one timed out, please check its log."
    print(scheduler_message(text, w.first_gone(timeout=30)), flush=True)
""")

LAUNCHER = textwrap.dedent("""
    import os, subprocess, sys, time
    # like msrun: the workers and the scheduler are children of one launcher process
    workers = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                                env=dict(os.environ, MS_ROLE="MS_WORKER", RANK_ID=str(r))) for r in range(3)]
    sched = subprocess.Popen([sys.executable, "-c", sys.argv[1]], stdout=subprocess.PIPE, text=True)
    assert sched.stdout.readline().strip() == "ready"
    workers[1].kill()
    workers[1].wait()
    time.sleep(0.1)       # msrun kills the rest well under a second later
    for p in (workers[0], workers[2]):
        p.kill()
        p.wait()
    print(sched.communicate(timeout=60)[0].strip())
""")


def test_first_vanished_worker_is_named():
    r = subprocess.run([sys.executable, "-c", LAUNCHER, SCHEDULER], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == ("msrun scheduler: worker rank 1 stopped responding (it died or hung), so the "
                                "job is ending; see its log worker_1.log"), r.stdout + r.stderr
