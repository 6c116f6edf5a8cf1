"""An msrun worker on CPU binds itself (every thread, and the threads it starts later) to
one core: rank r (msrun's RANK_ID, else its DEVICE_ID) to the r-th allowed core, round robin."""

import os
import subprocess
import sys

import pytest

PROBE = r"""
import os, sys, threading
from mindtrain.trainer.runtime import bind_cpu_worker
before = threading.Thread(target=lambda: threading.Event().wait(5), daemon=True)
before.start()  # a thread that already runs when the worker binds
core = bind_cpu_worker()
seen = {}
after = threading.Thread(target=lambda: seen.setdefault("after", os.sched_getaffinity(0)))
after.start(); after.join()
print(core, sorted(os.sched_getaffinity(0)), sorted(os.sched_getaffinity(before.native_id)), sorted(seen["after"]))
"""


def _probe(**env):
    full = dict(os.environ)
    full.pop("DEVICE_ID", None)
    full.pop("RANK_ID", None)
    full.update(env)
    out = subprocess.run([sys.executable, "-c", PROBE], env=full, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout.split(maxsplit=1)


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 cores to bind to one of them")
def test_each_local_rank_gets_its_core_for_every_thread():
    cpus = sorted(os.sched_getaffinity(0))
    for local in range(len(cpus) + 1):  # one more than there are cores: round robin
        core, rest = _probe(**{"RANK_ID" if local % 2 else "DEVICE_ID": str(local)})
        want = cpus[local % len(cpus)]
        assert int(core) == want
        assert rest.strip() == f"[{want}] [{want}] [{want}]"  # main thread, earlier thread, later thread


def test_unbound_outside_msrun_or_when_switched_off():
    everything = str(sorted(os.sched_getaffinity(0)))
    for env in ({}, {"DEVICE_ID": "1", "MINDTRAIN_CPU_BIND": "0"}):
        core, rest = _probe(**env)
        assert core == "None"
        assert rest.strip() == f"{everything} {everything} {everything}"
