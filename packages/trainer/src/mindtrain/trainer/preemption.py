"""Preemption: SIGTERM or SIGINT (to any worker), or msrun itself going away, stops training
after the current step on every rank, with a checkpoint when saving is enabled.

Megatron-LM's ``--exit-signal-handler`` behaviour. A signal reaches one process, or all of
them at different moments, so the ranks agree on it: each rank's :meth:`Preemption.flags`
ride on the all-reduce of the step's figures that the trainer does anyway (no collective of
their own), and every rank passes the same sums to :meth:`Preemption.decide` at the step's
end, so the step they stop after is the same everywhere. A signal that arrives after that
all-reduce is agreed on in the next step's. msrun does not pass SIGTERM on to its workers
(it dies and they run on), so a worker whose launcher is gone acts as if signalled.

A second signal once the stop is under way (during the save, say) ends the process at once
with ``128 + signal``; the save writes into a hidden folder that only a finished save
renames into place, so the previous checkpoint stays whole.
"""

from __future__ import annotations

import os
import signal
import threading
from typing import Optional

import numpy as np

SIGNALS = (signal.SIGTERM, signal.SIGINT)
REASONS = ("SIGTERM", "SIGINT", "msrun ended")
"""What stops a run, as every rank names it (the first one some rank received)."""


class Preemption:
    """``watch_parent``: treat the launcher's exit as a signal (under msrun)."""

    def __init__(self, watch_parent: bool = False):
        self.reason: Optional[str] = None  # what this process received
        self.stopping = False
        self._previous = {}  # the handlers close() puts back (training over: a signal acts as before)
        if threading.current_thread() is threading.main_thread():
            self._previous = {sig: signal.signal(sig, self._on_signal) for sig in SIGNALS}
        self._stop = threading.Event()
        self._thread = None
        if watch_parent:
            parent = os.getppid()
            self._thread = threading.Thread(target=self._watch_parent, args=(parent,), daemon=True,
                                            name="mindtrain-launcher-watch")
            self._thread.start()

    def close(self) -> None:
        """End the launcher watch and put the previous signal handlers back (training is over)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}

    def _on_signal(self, signum, _frame) -> None:
        if self.reason is not None or self.stopping:
            # the second signal: leave now; an unfinished save never replaces the last checkpoint
            os._exit(128 + signum)
        self.reason = signal.Signals(signum).name

    def _watch_parent(self, parent: int) -> None:
        while not self._stop.wait(1.0):
            if os.getppid() != parent:  # msrun ended (it does not forward SIGTERM)
                if self.reason is None:
                    self.reason = "msrun ended"
                return

    def flags(self) -> np.ndarray:
        """This rank's vote, one float per :data:`REASONS` entry (1 for what it received)."""
        return np.array([float(self.reason == r) for r in REASONS], np.float32)

    def decide(self, votes: np.ndarray) -> Optional[str]:
        """``votes``: :meth:`flags` summed over all ranks (the same on every rank; in one
        process, its own flags). Why training stops after this step (what some rank
        received, in :data:`REASONS` order), or None."""
        for reason, count in zip(REASONS, votes):
            if count > 0:
                self.stopping = True
                return reason
        return None
