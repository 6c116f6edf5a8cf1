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


def pytest_collection_modifyitems(config, items):
    """Under pytest-xdist (``-n 2 --dist loadgroup``): every ``msrun`` test in one group, so
    one worker runs them one after another in their usual order (never two multi-process
    jobs at once: their ports and cores stay theirs), first, while the other worker runs the
    one-process tests, a module at a time (a module's fixtures are built once)."""
    if not getattr(config.option, "numprocesses", None):
        return
    for item in items:
        msrun = item.get_closest_marker("msrun") is not None
        item.add_marker(pytest.mark.xdist_group("msrun" if msrun else item.nodeid.split("::")[0]))
    items.sort(key=lambda item: item.get_closest_marker("msrun") is None)  # stable: msrun first
