"""training.rampup_batch_size under msrun: 2 workers with ZeRO-3 follow the same ramp as one
process (global batches 2, 2, 4, 6 of MindFormers' scheduler for [2, 2, 8] up to 6), with
the same figures; each data-parallel rank runs half of every step's micro-batches. The ramp's
arithmetic, its equality with fixed-batch runs and its resume are in
packages/trainer/tests/test_rampup.py."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from one_vs_two import max_rel_diff, one_and_two  # noqa: E402

pytestmark = pytest.mark.msrun


def test_two_workers_follow_the_ramp_of_one_process(tmp_path):
    one, two = one_and_two(str(tmp_path), ["training.global_batch_size=6", "training.rampup_batch_size=[2, 2, 8]"],
                           8740)
    assert [r["global_batch_size"] for r in one] == [r["global_batch_size"] for r in two] == [2, 2, 4, 6]
    assert max_rel_diff(two, one) < 1e-5
