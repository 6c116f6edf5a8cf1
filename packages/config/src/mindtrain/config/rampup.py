"""``training.rampup_batch_size``: the global batch grows with the samples consumed.

``[start, increment, rampup_samples]`` as MindFormers' PyNative trainer and Megatron read it:
the global batch starts at ``start`` and grows by ``increment`` every
``rampup_samples / n`` consumed samples, ``n = (global_batch_size - start) / increment``
levels, until it reaches ``training.global_batch_size``, which it keeps once more than
``rampup_samples`` samples are consumed. Each step's global batch follows from the samples
consumed before it, so a resumed run (its consumed_samples saved) continues the ramp exactly.
Every level must split into whole micro-batches of local_batch_size x data-parallel size.
"""

from __future__ import annotations

from typing import Optional, Sequence

from mindtrain.config.errors import ConfigError

FIELD = "training.rampup_batch_size"


class BatchRamp:
    """The global batch size at every point of a ramp (see the module doc)."""

    def __init__(self, rampup: Sequence[int], global_batch_size: int):
        if not isinstance(rampup, (list, tuple)) or len(rampup) != 3 or not all(
                isinstance(x, int) and not isinstance(x, bool) for x in rampup):
            raise ConfigError(FIELD, f"must be three integers [start_global_batch_size, batch_size_increment, "
                                     f"rampup_samples], got {rampup!r}")
        self.start, self.increment, self.rampup_samples = (int(x) for x in rampup)
        self.max = int(global_batch_size)
        if self.start <= 0:
            raise ConfigError(FIELD, f"start_global_batch_size (first entry) must be > 0, got {self.start}")
        if self.increment <= 0:
            raise ConfigError(FIELD, f"batch_size_increment (second entry) must be > 0, got {self.increment}")
        if self.rampup_samples < 0:
            raise ConfigError(FIELD, f"rampup_samples (third entry) must be >= 0, got {self.rampup_samples}")
        if self.start > self.max:
            raise ConfigError(FIELD, f"start_global_batch_size {self.start} exceeds training.global_batch_size "
                                     f"{self.max}")
        if (self.max - self.start) % self.increment:
            raise ConfigError(FIELD, f"training.global_batch_size - start_global_batch_size = {self.max - self.start} "
                                     f"must be a multiple of batch_size_increment {self.increment}")
        self.levels = (self.max - self.start) // self.increment
        self.samples_per_level = self.rampup_samples / self.levels if self.levels and self.rampup_samples else 0.0

    @classmethod
    def from_config(cls, training) -> Optional["BatchRamp"]:
        """The ramp ``training.rampup_batch_size`` asks for, or None."""
        if training.rampup_batch_size is None:
            return None
        return cls(training.rampup_batch_size, training.global_batch_size)

    def global_batch_at(self, consumed_samples: int) -> int:
        """The global batch of the step that starts after ``consumed_samples`` samples."""
        if consumed_samples > self.rampup_samples or self.samples_per_level <= 0:
            return self.max
        return min(self.start + int(consumed_samples / self.samples_per_level) * self.increment, self.max)

    def sizes(self) -> list[int]:
        """Every global batch size the ramp takes, smallest first."""
        return [self.start + k * self.increment for k in range(self.levels + 1)]

    def check_units(self, per_micro_step: int, detail: str) -> None:
        """Every level splits into micro-batches of ``per_micro_step`` samples (local_batch_size
        x data-parallel size, named in ``detail``); else one line naming the first that does not."""
        for size in self.sizes():
            if size % per_micro_step:
                raise ConfigError(FIELD, f"the ramp's global batch {size} is not a multiple of {detail} = "
                                         f"{per_micro_step}; choose start and increment as multiples of it")
