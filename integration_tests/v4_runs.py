"""The tiny DeepSeek-V4 trained by ``workers/v4_layouts.py``: layout cases in one 2-worker
msrun launch beside their one-process references, and the comparison of a case with its
reference (test_v4_layouts.py, test_v4_context_parallel.py).

Both test modules' cases run in one launch (:data:`CASES`, beside one process training
:data:`REFS`: integration_tests/conftest.py's session fixture ``v4_results``): a second
launch cost a second msrun, scheduler and two workers starting MindSpore, and a second
reference process."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np

from mindtrain.trainer.quickstart import free_port
from parity import LOSS_RTOL, assert_same_training

WORKER = Path(__file__).parent / "workers" / "v4_layouts.py"
# test_v4_layouts.py's cases (against ``ref``, a ``*_plain`` one against ``ref_plain``) and
# test_v4_context_parallel.py's (each against ``ref_<case without _ulysses>``)
LAYOUT_CASES = ("tp2", "ep2_zero3", "pp2", "pp2_plain")
CP_REFS = ("cp2", "cp2_mla")
CP_CASES = CP_REFS + tuple(c + "_ulysses" for c in CP_REFS)
REFS = ("ref", "ref_plain") + tuple("ref_" + c for c in CP_REFS)
CASES = LAYOUT_CASES + CP_CASES


def layout_ref(case: str) -> str:
    """The one-process reference of layout case ``case``: ``ref``, or ``ref_plain`` for the
    model without hyper-connections and q/k norms (``*_plain``)."""
    return "ref_plain" if case.endswith("_plain") else "ref"


def _env():
    env = dict(os.environ)
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    env.setdefault("GLOG_v", "3")
    return env


def run_cases(d: Path, refs, cases, port: int) -> dict:
    """Train ``refs`` in one process (beside the msrun job) and ``cases`` in one 2-worker
    msrun launch; returns each one's ``.npz`` as a dict, by name."""
    with open(d / "ref.log", "w") as log:
        ref = subprocess.Popen([sys.executable, str(WORKER), str(d), ",".join(refs)], env=_env(), cwd=d,
                               stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    cmd = ["msrun", "--worker_num=2", "--local_worker_num=2", f"--master_port={free_port(port)}",
           f"--log_dir={d / 'log'}", "--join=True", str(WORKER), str(d), ",".join(cases)]
    proc = subprocess.Popen(cmd, env=_env(), cwd=d, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        proc.communicate(timeout=1800)  # a hang guard, not a timing check
        ref.wait(timeout=1800)
    except subprocess.TimeoutExpired:
        for p in (proc, ref):
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
        raise
    logs = "\n".join(p.read_text(errors="replace")[-3000:] for p in sorted((d / "log").glob("worker_*.log")))
    assert proc.returncode == 0, logs
    assert ref.returncode == 0, (d / "ref.log").read_text()[-3000:]
    return {name: dict(np.load(d / f"{name}.npz")) for name in (*refs, *cases)}


def max_differences(got: dict, ref: dict) -> dict:
    """The largest relative differences of ``got`` from ``ref``: per-step losses and grad
    norms, the worst tensor (``||a - b|| / ||b||``) and the whole model."""
    names = sorted(k for k in ref if k.startswith("p:"))
    num = den = worst = 0.0
    for k in names:
        a, b = got[k].astype(np.float64), ref[k].astype(np.float64)
        diff, norm = float(np.linalg.norm(a - b)), float(np.linalg.norm(b))
        num, den = num + diff ** 2, den + norm ** 2
        worst = max(worst, diff / max(norm, 1e-12))
    rel = {key: float(np.max(np.abs(got[key] - ref[key]) / np.abs(ref[key]))) for key in ("losses", "grad_norms")}
    return dict(rel, tensor=worst, model=float(np.sqrt(num / den)))


def assert_equals_one_process(got: dict, ref: dict, case: str) -> None:
    """Both compiled, per-step grad norms within ``parity.LOSS_RTOL`` and the same training
    (:func:`parity.assert_same_training`: losses, every final weight at full shape, the
    correction biases too)."""
    assert bool(got["compiled"]) and bool(ref["compiled"])
    np.testing.assert_allclose(got["grad_norms"], ref["grad_norms"], rtol=LOSS_RTOL, err_msg=case)
    assert_same_training(ref, got, case)
