"""Every test leaves MS_NODE_TIMEOUT as it found it.

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
