"""Every collective and differentiable collective under real msrun, against numpy."""

import pytest

pytestmark = pytest.mark.msrun


@pytest.mark.parametrize("workers,port,transport", [(2, 8201, "shm"), (4, 8202, "shm"), (2, 8203, "mccl")])
def test_collectives_match_numpy(msrun, tmp_path, workers, port, transport):
    """Through same-host shared memory (the CPU default) and through MindSpore's mccl."""
    env = {"MINDTRAIN_CPU_TRANSPORT": transport, "EXPECT_TRANSPORT": transport}
    proc, logs = msrun.run("collectives_worker.py", workers, port, tmp_path, str(tmp_path), env_extra=env)
    assert proc.returncode == 0, msrun.logs(logs)
    results = msrun.results(tmp_path, "collectives", workers)
    expected_groups = 1 if workers == 2 else 3
    for rank, errors in enumerate(results):
        assert len(errors) == 23 * expected_groups, sorted(errors)
        bad = {k: v for k, v in errors.items() if not v <= 1e-5}
        assert not bad, f"rank {rank}: {bad}"
