"""Runs shared by several test modules of the msrun group (one pytest-xdist worker runs them
all, in order: the root conftest.py)."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="session")
def v4_results(tmp_path_factory):
    """The tiny DeepSeek-V4's layout and context-parallel cases in one 2-worker msrun launch,
    their one-process references beside it (test_v4_layouts.py, test_v4_context_parallel.py);
    every run's ``.npz`` as a dict, by name."""
    from v4_runs import CASES, REFS, run_cases

    port = int(os.environ.get("MINDTRAIN_TEST_PORT", 8840))
    return run_cases(tmp_path_factory.mktemp("v4_runs"), REFS, CASES, port)
