"""Whether a step updates: ``training.max_skipped_steps`` (non-finite steps) and
``monitor.health_checkpoint`` (global-norm step skipping, the embedding-gradient alarm).

:class:`SkipDecision` takes the one per-step decision and keeps both counters; the trainer
saves and restores them with a checkpoint.

- a step whose loss or gradient is not finite does not update; ``max_skipped_steps`` of
  them in a row stop training (after that step's line) with :class:`NonFiniteError`.

MindFormers' PyNative trainer declares the health_checkpoint fields but does not act on
them; the behaviour here follows its static-graph trainer (``use_skip_data_by_global_norm``
in mindformers/core/callback/callback.py), which the fields come from:

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


class NonFiniteError(UserError):
    """Too many consecutive steps had a non-finite loss or gradient."""


class GlobalNormSkipError(UserError):
    """Too many consecutive steps had a global gradient norm over the skip threshold."""


class HealthCheck:
    """The embedding-gradient alarm: says on ``log`` when the embedding's local gradient
    norm reaches its threshold (it never skips a step)."""

    def __init__(self, embedding_local_norm_threshold: float = 100.0, log: Callable[[str], None] = print,
                 rank: int = 0):
        self.embedding_threshold = float(embedding_local_norm_threshold)
        self.log = log
        self.rank = rank

    @classmethod
    def from_config(cls, hc, log: Callable[[str], None], rank: int) -> "HealthCheck":
        if hc is None:  # the section is absent: no checks
            return cls(0.0, log=log, rank=rank)
        return cls(hc.embedding_local_norm_threshold, log=log, rank=rank)

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


class SkipDecision:
    """Per step: update, or skip (a global norm over the threshold, or a non-finite loss or
    gradient), and the two stop rules. Every rank decides alike (the figures it reads are
    global). ``skipped_total`` counts both kinds; ``skipped_in_row`` counts non-finite
    steps in a row, ``norm_skipped_in_row`` global-norm skips in a row."""

    def __init__(self, max_skipped_steps: int = 5, global_norm_skip_threshold: float = 0.0,
                 global_norm_skip_time: int = 1, log: Callable[[str], None] = print):
        if global_norm_skip_threshold > 0 and global_norm_skip_time < 1:
            raise ConfigError("monitor.health_checkpoint.global_norm_skip_time",
                              f"is {global_norm_skip_time}; give the number (>= 1) of consecutive skipped steps "
                              "that stops training")
        self.max_skipped_steps = int(max_skipped_steps)
        self.skip_threshold = float(global_norm_skip_threshold)
        self.skip_time = int(global_norm_skip_time)
        self.log = log
        self.skipped_total = 0
        self.skipped_in_row = 0
        self.norm_skipped_in_row = 0

    @classmethod
    def from_config(cls, cfg, log: Callable[[str], None]) -> "SkipDecision":
        hc = cfg.monitor.health_checkpoint
        if hc is None:  # the section is absent: no global-norm skipping
            return cls(cfg.training.max_skipped_steps, log=log)
        return cls(cfg.training.max_skipped_steps, hc.global_norm_skip_threshold, hc.global_norm_skip_time, log=log)

    def decide(self, step: int, global_norm: float, finite: bool) -> bool:
        """True when ``step``'s update is skipped. A finite norm >= the threshold skips
        (raising on the ``global_norm_skip_time``-th in a row, a norm under it resets that
        count); otherwise a non-finite loss or gradient skips. A non-finite norm never
        counts as a global-norm skip."""
        if self._over_norm(step, global_norm):
            self.skipped_total += 1
            self.skipped_in_row = 0
            return True
        if finite:
            self.skipped_in_row = 0
            return False
        self.skipped_total += 1
        self.skipped_in_row += 1
        return True

    def check_non_finite(self, step: int) -> None:
        """After the step's line: stop once ``max_skipped_steps`` non-finite steps came in a row."""
        if self.skipped_in_row >= self.max_skipped_steps:
            raise NonFiniteError(
                f"training.max_skipped_steps: {self.skipped_in_row} steps in a row had a non-finite loss or "
                f"gradient (last at step {step}); lower lr_scheduler.learning_rate, enable "
                "training.max_norm, or check the data")

    def state_dict(self) -> dict:
        """What a checkpoint keeps (the global-norm run restarts at 0 on resume, as before)."""
        return {"skipped_total": self.skipped_total, "skipped_in_row": self.skipped_in_row}

    def load_state_dict(self, state: dict) -> None:
        self.skipped_total = int(state["skipped_total"])
        self.skipped_in_row = int(state["skipped_in_row"])

    def _over_norm(self, step: int, global_norm: float) -> bool:
        if self.skip_threshold <= 0 or not math.isfinite(global_norm):
            return False
        if global_norm < self.skip_threshold:
            self.norm_skipped_in_row = 0
            return False
        self.norm_skipped_in_row += 1
        if self.norm_skipped_in_row >= self.skip_time:
            raise GlobalNormSkipError(
                f"monitor.health_checkpoint.global_norm_skip_time: the global norm was >= global_norm_skip_threshold "
                f"{self.skip_threshold:g} for {self.norm_skipped_in_row} consecutive steps (the last: step {step}, "
                f"{global_norm:.6f}); training stopped. Lower lr_scheduler.learning_rate, check the data, or raise "
                "the threshold")
        self.log(f"mindtrain: step {step}: global norm {global_norm:.6f} >= "
                 f"monitor.health_checkpoint.global_norm_skip_threshold {self.skip_threshold:g}, update skipped "
                 f"({self.norm_skipped_in_row} in a row; training stops at {self.skip_time})")
        return True
