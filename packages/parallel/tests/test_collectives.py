"""Every collective and differentiable collective under real msrun, against numpy.

The three jobs (2 and 4 workers over same-host shared memory, 2 over MindSpore's mccl) are
independent: they start together, on their own ports, and each test waits for its own (a
job's ranks spend much of their time starting up and waiting on each other); so does
test_failure.py's job (conftest's ``failure_job``), which mostly waits.
"""

import os
import signal

import pytest

pytestmark = pytest.mark.msrun

JOBS = [(2, 8201, "shm"), (4, 8202, "shm"), (2, 8203, "mccl")]


@pytest.fixture(scope="module")
def jobs(msrun, tmp_path_factory, failure_job):  # test_failure's job starts beside these
    started = {}
    for workers, port, transport in JOBS:
        out = tmp_path_factory.mktemp(f"collectives_{workers}_{transport}")
        env = {"MINDTRAIN_CPU_TRANSPORT": transport, "EXPECT_TRANSPORT": transport}
        proc, logs = msrun.start("collectives_worker.py", workers, port, out, str(out), env_extra=env)
        started[port] = (proc, logs, out)
    yield started
    for proc, _, _ in started.values():
        if proc.poll() is None:  # msrun's workers outlive msrun: end the whole session
            os.killpg(proc.pid, signal.SIGKILL)


@pytest.mark.parametrize("workers,port,transport", JOBS)
def test_collectives_match_numpy(msrun, jobs, workers, port, transport):
    """Through same-host shared memory (the CPU default) and through MindSpore's mccl."""
    proc, logs, out = jobs[port]
    proc.wait(timeout=900)  # a hang guard, not a timing check
    assert proc.returncode == 0, msrun.logs(logs)
    results = msrun.results(out, "collectives", workers)
    expected_groups = 1 if workers == 2 else 3
    for rank, errors in enumerate(results):
        assert len(errors) == 23 * expected_groups, sorted(errors)
        bad = {k: v for k, v in errors.items() if not v <= 1e-5}
        assert not bad, f"rank {rank}: {bad}"
