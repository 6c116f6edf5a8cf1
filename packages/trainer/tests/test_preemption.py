"""Preemption's vote and its signal handlers, in this process (the multi-rank behaviour under
msrun: integration_tests/test_reliability.py)."""

from __future__ import annotations

import os
import signal

import numpy as np

from mindtrain.trainer.preemption import REASONS, Preemption


def test_votes_summed_over_ranks_name_the_first_reason_and_close_restores_the_handlers():
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    p = Preemption()
    try:
        assert signal.getsignal(signal.SIGTERM) == p._on_signal  # pylint: disable=comparison-with-callable
        assert p.flags().tolist() == [0.0, 0.0, 0.0] and p.decide(p.flags()) is None and not p.stopping
        os.kill(os.getpid(), signal.SIGTERM)  # caught: this rank votes for SIGTERM
        assert p.reason == "SIGTERM" and p.flags().tolist() == [1.0, 0.0, 0.0]
        # another rank's vote (its launcher ended) added in: every rank names the same reason
        other = np.array([float(r == "msrun ended") for r in REASONS], np.float32)
        assert p.decide(p.flags() + other) == "SIGTERM" and p.stopping
        q = Preemption()  # a rank that received nothing itself
        assert q.decide(np.zeros(len(REASONS)) + other) == "msrun ended" and q.stopping
        q.close()
        assert signal.getsignal(signal.SIGTERM) == p._on_signal  # pylint: disable=comparison-with-callable
    finally:
        p.close()
    assert {sig: signal.getsignal(sig) for sig in before} == before
