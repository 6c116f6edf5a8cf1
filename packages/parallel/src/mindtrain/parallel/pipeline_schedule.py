"""Pipeline schedules as plain data: the ordered forward/backward work of each stage."""

from __future__ import annotations

from mindtrain.config import ConfigError

SCHEDULES = ("1f1b", "gpipe")


def stage_ops(schedule: str, stages: int, stage: int, micro_batches: int) -> list[tuple[str, int]]:
    """``[("F", i) | ("B", i), ...]`` for ``stage`` of ``stages`` over ``micro_batches``.

    GPipe: every forward, then every backward. 1F1B: ``stages - stage - 1`` warm-up
    forwards, then one forward and one backward in turn, then the remaining backwards, so
    at most ``stages - stage`` micro-batches are in flight on a stage. Both run backwards
    in micro-batch order, so neighbours always exchange tensors in the same order.
    """
    kind = schedule.lower()
    if kind not in SCHEDULES:
        raise ConfigError("parallelism.pipeline_schedule", f"{schedule!r} is not one of {', '.join(SCHEDULES)}")
    m = micro_batches
    if kind == "gpipe":
        return [("F", i) for i in range(m)] + [("B", i) for i in range(m)]
    warmup = min(stages - stage - 1, m)
    ops = [("F", i) for i in range(warmup)]
    for i in range(m - warmup):
        ops += [("F", warmup + i), ("B", i)]
    ops += [("B", i) for i in range(m - warmup, m)]
    return ops


def bubble_fraction(stages: int, micro_batches: int) -> float:
    """The idle share of a 1F1B (or GPipe) step with equal stage times: (P-1)/(M+P-1)."""
    return (stages - 1) / (micro_batches + stages - 1)
