"""A rank that raises ends the msrun job promptly, and the error names the rank."""

import time

import pytest

pytestmark = pytest.mark.msrun


def test_raising_rank_ends_job(msrun, tmp_path):
    # msrun kills the peer blocked in all_reduce at once, but its scheduler only exits when
    # the dead nodes time out: MS_NODE_TIMEOUT, 30 s by default. 15 s still leaves the one
    # receive before the failure (the barrier) far more than the ranks' start-up skew.
    proc, logs = msrun.run("failure_worker.py", 2, 8203, tmp_path, str(tmp_path), timeout=200,
                           env_extra={"MS_NODE_TIMEOUT": "15"})
    ended = time.time()
    raised = float((tmp_path / "raised_at").read_text())
    out = proc.stdout + proc.stderr + msrun.logs(logs)
    assert proc.returncode != 0
    assert "mindtrain: rank 1 failed: RuntimeError: deliberate failure before all_reduce" in out
    # the 15 s node timeout plus msrun's polling and kill, with room for a loaded machine
    assert ended - raised < 45, f"job ended {ended - raised:.0f} s after the failure"
