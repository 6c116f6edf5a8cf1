"""DeepSeek-V4 under context parallelism equals one process (issue 32).

``run_mindformer.py`` trains configs/pynative_ds4_tiny.yaml (a sliding-window, a compressed
sparse (ratio 4, lightning indexer keeping 16 entries) and a heavily compressed (ratio 16)
layer; hash then learned routing) for 2 steps at 128 tokens, compiled, as one process and as
2 msrun workers with context_parallel=2 (load-balanced chunks of 32 tokens; the sliding
halo, the ratio-4 boundary windows and the compressed entries all-gathered), both at once, the
same global batch (2 sequences in one micro-batch). Each step's loss and gradient norm must
agree within DeepSeek-V3's layout tolerance (1e-5 relative); step 2's figures carry step
1's update, so the weights are compared through them. The simulated-ranks test
(packages/models/tests/test_deepseek_v4_context_parallel.py) checks the scheme in one process.
"""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from one_vs_two import ROOT, one_and_two  # noqa: E402

pytestmark = pytest.mark.msrun

TINY = os.path.join(ROOT, "configs", "pynative_ds4_tiny.yaml")
BASE = ("training.steps=2", "model.seq_length=128", "train_dataset.dataloader.config.seq_length=128",
        "training.local_batch_size=2", "training.global_batch_size=2")
TOL = 1e-5


def test_cp2_equals_one_process(tmp_path):
    one, cp2 = one_and_two(str(tmp_path), [], 9152, ["parallelism.context_parallel=2",
                                                      "parallelism.data_parallel_shard=1"], TINY, BASE)
    assert [r["step"] for r in cp2] == [1, 2] == [r["step"] for r in one]
    for key in ("loss", "grad_norm"):
        a, b = np.array([r[key] for r in cp2]), np.array([r[key] for r in one])
        np.testing.assert_allclose(a, b, rtol=TOL, atol=0, err_msg=key)
    assert one[1]["loss"] < one[0]["loss"] - 0.2  # it learns: step 1's update is in step 2's figures
    for row in cp2:  # both CP ranks report the same (whole-batch) loss
        assert np.ptp(row["device_losses"]) <= TOL * abs(row["loss"])
