"""A layout's run against its one-process reference: the comparison every layout parity test
makes (test_tp_ep_parity.py, test_v4_layouts.py, test_v4_context_parallel.py).

A run is a dict of arrays: ``losses`` per step and every final weight at full shape as
``p:<name>``."""

from __future__ import annotations

import numpy as np

LOSS_RTOL = 1e-5
MODEL_RTOL = 1e-5      # ||all params - ref|| / ||ref||
TENSOR_RTOL = 1e-4     # per tensor; AdamW turns float noise in near-zero gradients into
                       # updates of about lr that differ between two summation orders


def assert_same_training(ref: dict, got: dict, case: str) -> None:
    """Per-step losses within :data:`LOSS_RTOL`, the same weights, each within
    :data:`TENSOR_RTOL` of its norm and all of them within :data:`MODEL_RTOL`."""
    np.testing.assert_allclose(got["losses"], ref["losses"], rtol=LOSS_RTOL, err_msg=case)
    names = sorted(k for k in ref if k.startswith("p:"))
    assert sorted(k for k in got if k.startswith("p:")) == names, case
    num = den = 0.0
    for k in names:
        a, b = got[k].astype(np.float64), ref[k].astype(np.float64)
        assert a.shape == b.shape, (case, k)
        diff, norm = float(np.linalg.norm(a - b)), float(np.linalg.norm(b))
        num, den = num + diff ** 2, den + norm ** 2
        assert diff <= TENSOR_RTOL * max(norm, 1e-12), f"{case} {k}: relative error {diff / max(norm, 1e-30):.2e}"
    assert np.sqrt(num / den) <= MODEL_RTOL, f"{case}: model relative error {np.sqrt(num / den):.2e}"
