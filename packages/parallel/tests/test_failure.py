"""A rank that raises ends the msrun job promptly, and the error names the rank.

The job is the session fixture ``failure_job`` (conftest.py), which test_collectives.py
starts beside its own jobs; the time the job ended is taken when it ends, not when this
test runs.
"""

import pytest

pytestmark = pytest.mark.msrun


def test_raising_rank_ends_job(msrun, failure_job):
    proc, logs, out, ended, watcher = failure_job
    watcher.join(timeout=200)  # a hang guard, not a timing check
    assert "at" in ended, "the job did not end within 200 s"
    raised = float((out / "raised_at").read_text())
    text = open(f"{logs}.out", errors="replace").read() + msrun.logs(logs)
    assert proc.returncode != 0
    assert "mindtrain: rank 1 failed: RuntimeError: deliberate failure before all_reduce" in text
    assert ended["at"] - raised < 45, f"job ended {ended['at'] - raised:.0f} s after the failure"
