"""Learning-rate schedules: a warm-up followed by one of six shapes."""

from __future__ import annotations

import math
from dataclasses import dataclass

from mindtrain.config import LRSchedulerConfig, MindTrainConfig, total_lr_steps, warmup_steps

SCHEDULES = ("ConstantWarmUpLR", "LinearWithWarmUpLR", "CosineWithWarmUpLR",
             "PolynomialWithWarmUpLR", "WarmUpStableDecayLR", "ConstantWithCoolDownLR")


@dataclass(frozen=True)
class LRSchedule:
    """lr(step) for optimizer steps 1..total_steps (held at the last value beyond).

    Warm-up rises linearly from ``warmup_lr_init`` and reaches ``learning_rate`` at step
    ``warmup``, so warm-up 0 trains at the peak from step 1. After warm-up, with progress
    p in (0, 1] over the remaining steps:
    Constant: peak. Linear: peak -> lr_end. Cosine: lr_end + (peak - lr_end) *
    (1 + cos(2 pi num_cycles p)) / 2. Polynomial: lr_end + (peak - lr_end) (1 - p)^power.
    WarmUpStableDecay: peak, then the last decay_ratio of total_steps linear to lr_end.
    ConstantWithCoolDown: peak, then the last decay_ratio of total_steps falling as
    1 - sqrt(q) to lr_end (the cool-down of Hägele et al., 2024).
    """

    kind: str
    peak: float
    total: int
    warmup: int
    warmup_lr_init: float = 0.0
    lr_end: float = 0.0
    power: float = 1.0
    num_cycles: float = 0.5
    decay_ratio: float = 0.1

    @classmethod
    def from_config(cls, cfg: MindTrainConfig) -> "LRSchedule":
        lr: LRSchedulerConfig = cfg.lr_scheduler
        total = total_lr_steps(cfg)
        return cls(kind=lr.type, peak=lr.learning_rate, total=total, warmup=warmup_steps(lr, total),
                   warmup_lr_init=lr.warmup_lr_init, lr_end=lr.lr_end, power=lr.power,
                   num_cycles=lr.num_cycles, decay_ratio=lr.decay_ratio)

    def __post_init__(self) -> None:
        if self.kind not in SCHEDULES:
            raise ValueError(f"unknown schedule {self.kind!r}; known: {', '.join(SCHEDULES)}")

    def __call__(self, step: int) -> float:
        t = min(max(step, 1), self.total)
        if t <= self.warmup:
            return self.warmup_lr_init + (self.peak - self.warmup_lr_init) * t / self.warmup
        span = self.peak - self.lr_end
        if self.kind == "ConstantWarmUpLR":
            return self.peak
        if self.kind in ("WarmUpStableDecayLR", "ConstantWithCoolDownLR"):
            decay = max(1, round(self.decay_ratio * self.total))
            start = max(self.total - decay, self.warmup)
            if t <= start:
                return self.peak
            q = (t - start) / (self.total - start)
            if self.kind == "WarmUpStableDecayLR":
                return self.peak - span * q
            return self.lr_end + span * (1.0 - math.sqrt(q))
        p = (t - self.warmup) / (self.total - self.warmup)
        if self.kind == "LinearWithWarmUpLR":
            return self.peak - span * p
        if self.kind == "CosineWithWarmUpLR":
            return self.lr_end + span * 0.5 * (1.0 + math.cos(2.0 * math.pi * self.num_cycles * p))
        return self.lr_end + span * (1.0 - p) ** self.power
