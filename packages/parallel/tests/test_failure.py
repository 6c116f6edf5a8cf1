"""A rank that raises ends the msrun job promptly, and the error names the rank."""

import time


def test_raising_rank_ends_job(msrun, tmp_path):
    proc, logs = msrun.run("failure_worker.py", 2, 8203, tmp_path, str(tmp_path), timeout=200)
    ended = time.time()
    raised = float((tmp_path / "raised_at").read_text())
    out = proc.stdout + proc.stderr + msrun.logs(logs)
    assert proc.returncode != 0
    assert "mindtrain: rank 1 failed: RuntimeError: deliberate failure before all_reduce" in out
    # msrun kills the peer blocked in all_reduce; its scheduler then waits ~30 s for the
    # dead node's heartbeat before it exits
    assert ended - raised < 60, f"job ended {ended - raised:.0f} s after the failure"
