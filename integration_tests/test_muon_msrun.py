"""optimizer.type: Muon under msrun: 2 workers with ZeRO-3 (every weight a dim-0 shard, padded
where the rows do not split evenly) give the figures of one process, step after step: each
rank gathers the Newton-Schulz inputs whole (a bounded batch at a time), orthogonalises and keeps its own rows. Muon's
arithmetic against torch.optim.Muon and its resume are in packages/trainer/tests/test_muon*.py."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from one_vs_two import max_rel_diff, one_and_two  # noqa: E402

pytestmark = pytest.mark.msrun


def test_two_zero3_workers_equal_one_process(tmp_path):
    one, two = one_and_two(str(tmp_path), [
        "training.global_batch_size=4", "optimizer.type=Muon", "optimizer.weight_decay=0.1",
        "lr_scheduler.learning_rate=0.01",
        "optimizer.ns_coefficients=[[[3.4445, -4.7750, 2.0315], 4], [[2.0, -1.5, 0.5], 1]]"], 8730)
    assert [r["step"] for r in one] == [r["step"] for r in two] == [1, 2, 3, 4]
    err = max_rel_diff(two, one)
    print(f"Muon ZeRO-3 2 workers vs 1 process: max relative difference over 4 steps: {err:.2e}")
    assert err < 1e-5
    assert one[-1]["loss"] < one[0]["loss"]
