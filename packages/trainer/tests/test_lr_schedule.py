"""LR schedules: values at chosen steps, computed by hand from the documented formulas."""

import math

import pytest

from mindtrain.config import parse_config
from mindtrain.trainer.lr_schedule import LRSchedule


def sched(kind, **kw):
    base = dict(kind=kind, peak=1.0, total=10, warmup=2, lr_end=0.1)
    base.update(kw)
    return LRSchedule(**base)


def test_warmup_rises_linearly_to_peak_at_last_warmup_step():
    s = sched("ConstantWarmUpLR", warmup=4, warmup_lr_init=0.2)
    assert [s(t) for t in (1, 2, 4, 5, 10, 11)] == pytest.approx([0.4, 0.6, 1.0, 1.0, 1.0, 1.0])


def test_no_warmup_trains_at_peak_from_step_one():
    assert sched("ConstantWarmUpLR", warmup=0)(1) == 1.0


def test_linear_cosine_polynomial_reach_lr_end():
    lin, cos, poly = sched("LinearWithWarmUpLR"), sched("CosineWithWarmUpLR"), sched("PolynomialWithWarmUpLR", power=2.0)
    assert lin(6) == pytest.approx(1.0 - 0.9 * 0.5)
    assert cos(6) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert poly(6) == pytest.approx(0.1 + 0.9 * 0.25)
    for s in (lin, cos, poly):
        assert s(10) == pytest.approx(0.1)
        assert s(3) < 1.0


def test_stable_then_decay_in_the_last_fraction():
    wsd = sched("WarmUpStableDecayLR", decay_ratio=0.4)
    cool = sched("ConstantWithCoolDownLR", decay_ratio=0.4)
    assert [wsd(t) for t in (3, 6)] == [1.0, 1.0]
    assert wsd(8) == pytest.approx(1.0 - 0.9 * 0.5)
    assert cool(8) == pytest.approx(0.1 + 0.9 * (1 - math.sqrt(0.5)))
    assert wsd(10) == pytest.approx(0.1) and cool(10) == pytest.approx(0.1)


def test_from_config_uses_warmup_ratio_and_training_steps():
    cfg = parse_config({"training": {"steps": 20}, "lr_scheduler": {"type": "LinearWithWarmUpLR",
                        "learning_rate": 2e-3, "warmup_ratio": 0.25}}, validate=False)
    s = LRSchedule.from_config(cfg)
    assert (s.total, s.warmup, s.peak) == (20, 5, 2e-3)
    assert s(5) == pytest.approx(2e-3)
