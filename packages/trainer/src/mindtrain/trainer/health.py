"""monitor.health_checkpoint: the embedding-gradient alarm and global-norm step skipping.

MindFormers' PyNative trainer declares these fields but does not act on them; the
behaviour here follows its static-graph trainer (``use_skip_data_by_global_norm`` in
mindformers/core/callback/callback.py), which the fields come from:

- a step whose global gradient norm is >= ``global_norm_skip_threshold`` does not update
  the weights or the optimizer state, and the log says so;
- after ``global_norm_skip_time`` such steps in a row, training stops with an error;
  a step under the threshold resets the count;
- the local norm of the embedding's gradient on this rank is compared with
  ``embedding_local_norm_threshold`` each step; the rank says so when it is >= it.

A threshold <= 0 turns its check off.
"""

from __future__ import annotations

import math
from typing import Callable, Optional, Sequence

import numpy as np

from mindtrain.config import ConfigError, UserError

EMBEDDING_SUFFIX = "embed_tokens.weight"


class GlobalNormSkipError(UserError):
    """Too many consecutive steps had a global gradient norm over the skip threshold."""


class HealthCheck:
    """Decides per step whether the update is skipped, and says why on ``log``."""

    def __init__(self, embedding_local_norm_threshold: float = 100.0, global_norm_skip_threshold: float = 100.0,
                 global_norm_skip_time: int = 10, log: Callable[[str], None] = print, rank: int = 0):
        if global_norm_skip_threshold > 0 and global_norm_skip_time < 1:
            raise ConfigError("monitor.health_checkpoint.global_norm_skip_time",
                              f"is {global_norm_skip_time}; give the number (>= 1) of consecutive skipped steps "
                              "that stops training")
        self.embedding_threshold = float(embedding_local_norm_threshold)
        self.skip_threshold = float(global_norm_skip_threshold)
        self.skip_time = int(global_norm_skip_time)
        self.log = log
        self.rank = rank
        self.skipped_in_row = 0

    @classmethod
    def from_config(cls, hc, log: Callable[[str], None], rank: int) -> "HealthCheck":
        if hc is None:  # the section is absent: no checks
            return cls(0.0, 0.0, 1, log=log, rank=rank)
        return cls(hc.embedding_local_norm_threshold, hc.global_norm_skip_threshold, hc.global_norm_skip_time,
                   log=log, rank=rank)

    def check_embedding(self, step: int, named_grads: Sequence[tuple[str, object]]) -> Optional[float]:
        """The local norm of the main embedding's gradient on this rank (None where this
        rank holds none, e.g. a later pipeline stage); logged when over the threshold."""
        if self.embedding_threshold <= 0:
            return None
        grad = next((g for n, g in named_grads if n.endswith(EMBEDDING_SUFFIX) and ".layers." not in n), None)
        if grad is None:
            return None
        norm = float(np.sqrt(np.sum(np.square(grad.asnumpy(), dtype=np.float64))))
        if norm >= self.embedding_threshold:
            self.log(f"mindtrain: step {step}: embedding_local_norm {norm:.6f} >= "
                     f"monitor.health_checkpoint.embedding_local_norm_threshold {self.embedding_threshold:g} "
                     f"(rank {self.rank})")
        return norm

    def skip(self, step: int, global_norm: float) -> bool:
        """True when ``step``'s update must be skipped for its global norm; raises on the
        ``global_norm_skip_time``-th skip in a row. A non-finite norm is left to
        ``training.max_skipped_steps`` and does not count here."""
        if self.skip_threshold <= 0 or not math.isfinite(global_norm):
            return False
        if global_norm < self.skip_threshold:
            self.skipped_in_row = 0
            return False
        self.skipped_in_row += 1
        if self.skipped_in_row >= self.skip_time:
            raise GlobalNormSkipError(
                f"monitor.health_checkpoint.global_norm_skip_time: the global norm was >= global_norm_skip_threshold "
                f"{self.skip_threshold:g} for {self.skipped_in_row} consecutive steps (the last: step {step}, "
                f"{global_norm:.6f}); training stopped. Lower lr_scheduler.learning_rate, check the data, or raise "
                "the threshold")
        self.log(f"mindtrain: step {step}: global norm {global_norm:.6f} >= "
                 f"monitor.health_checkpoint.global_norm_skip_threshold {self.skip_threshold:g}, update skipped "
                 f"({self.skipped_in_row} in a row; training stops at {self.skip_time})")
        return True
