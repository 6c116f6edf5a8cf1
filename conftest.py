"""Every test leaves MS_NODE_TIMEOUT as it found it; the msrun tests run on one pytest-xdist
worker, in order, while the other worker takes the one-process tests.

The pipeline schedule raises it in the process environment (``relax_receive_timeout``) for
its receives; built in the pytest process (the estimate's and the schedule's one-process
tests simulate several ranks), the raised value would reach every msrun started afterwards,
whose scheduler then waits 900 s for a failed rank's heartbeat before the job can end.
"""

import os

import pytest


@pytest.fixture(autouse=True)
def _restore_node_timeout():
    before = os.environ.get("MS_NODE_TIMEOUT")
    yield
    if before is None:
        os.environ.pop("MS_NODE_TIMEOUT", None)
    else:
        os.environ["MS_NODE_TIMEOUT"] = before


# msrun tests that measure no time (exact figures or byte counts, their own ports) and run
# beside the one-process tests, on the other pytest-xdist worker: the msrun group is the
# longer of the two workers' shares (in a fresh-clone run at 93a03b3: 1,310 s of msrun
# tests against 1,107 s of the others), and these even them out
BESIDE = ("integration_tests/test_mtp_scale_follows.py",
          "integration_tests/test_qwen3_layouts.py", "integration_tests/test_rampup_msrun.py",
          "integration_tests/test_muon_msrun.py")


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads the group marks
def pytest_collection_modifyitems(config, items):
    """The msrun tests (they launch jobs with fixed ports, and some share session jobs) form
    one xdist group and come first: under ``--dist loadgroup`` one worker starts them at
    once and runs them all in order, while the other worker runs the one-process tests and
    the msrun tests of :data:`BESIDE` (a group of their own, so one worker runs them all)."""
    msrun = [item for item in items if item.get_closest_marker("msrun") is not None]
    for item in msrun:
        beside = item.nodeid.split("::")[0].endswith(BESIDE)
        item.add_marker(pytest.mark.xdist_group("msrun_beside" if beside else "msrun"))
    chosen = set(map(id, msrun))
    items[:] = msrun + [item for item in items if id(item) not in chosen]
