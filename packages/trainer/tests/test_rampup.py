"""training.rampup_batch_size: the global batch grows as MindFormers' BatchSizeScheduler (and
Megatron's ramp-up calculator) says; each step equals a fixed-batch run of its size from the
same weights and data position, and a resume in the middle of the ramp is exact."""

import pytest

from mindtrain.config import ConfigError
from mindtrain.config.rampup import BatchRamp
from mindtrain.trainer.runtime import Runtime
from mindtrain.trainer.trainer import Trainer

FIGURES = ("loss", "grad_norm", "load_balancing_loss", "mtp_loss", "lr")
# every run pins the learning-rate schedule's length, so only the batch differs between them
PINNED = ("lr_scheduler.total_steps=5", "lr_scheduler.warmup_ratio=0.4")


def _ramp_sizes(start, increment, rampup_samples, max_gbs, steps):
    """Megatron's RampupBatchsizeNumMicroBatchesCalculator, step by step: levels of
    ``increment`` every rampup_samples / ((max - start) / increment) consumed samples."""
    per_level = rampup_samples / ((max_gbs - start) // increment)
    consumed, out = 0, []
    for _ in range(steps):
        size = max_gbs if consumed > rampup_samples else min(start + int(consumed / per_level) * increment, max_gbs)
        out.append(size)
        consumed += size
    return out


def test_the_ramp_grows_the_batch_and_each_step_equals_a_fixed_batch_run(tiny_config, tmp_path):
    ck = tmp_path / "ck"
    ramp = tiny_config(*PINNED, "training.rampup_batch_size=[2, 2, 8]", "training.global_batch_size=6",
                       "training.steps=5", "checkpoint.enable_save=true", f"checkpoint.save_path={ck}",
                       "checkpoint.save_interval=1")
    run = Trainer(ramp, Runtime(device="CPU"), out=lambda _: None).train()
    sizes = [r["global_batch_size"] for r in run]
    assert sizes == _ramp_sizes(2, 2, 8, 6, 5) == [2, 2, 4, 6, 6]
    assert [r["consumed_samples"] for r in run] == [2, 4, 8, 14, 20]

    # step k + 1 of the ramp = one step at that fixed batch size from the ramp's step-k checkpoint
    for k in (2, 3):
        fixed = tiny_config(*PINNED, f"training.global_batch_size={sizes[k]}", f"training.steps={k + 1}",
                            f"checkpoint.load_path={ck}/iter_{k:07d}")
        (rec,) = Trainer(fixed, Runtime(device="CPU"), out=lambda _: None).train()
        for key in FIGURES:
            assert rec[key] == run[k][key], (k, key, rec[key], run[k][key])
    first = Trainer(tiny_config(*PINNED, "training.global_batch_size=2", "training.steps=1"),
                    Runtime(device="CPU"), out=lambda _: None).train()
    assert [first[0][key] for key in FIGURES] == [run[0][key] for key in FIGURES]

    # resumed in the middle of the ramp (after step 2: 4 samples consumed): steps 3-5 as before
    resumed = Trainer(tiny_config(*PINNED, "training.rampup_batch_size=[2, 2, 8]", "training.global_batch_size=6",
                                  "training.steps=5", f"checkpoint.load_path={ck}/iter_0000002"),
                      Runtime(device="CPU"), out=lambda _: None).train()
    assert [r["global_batch_size"] for r in resumed] == [4, 6, 6]
    for key in FIGURES:
        assert [r[key] for r in resumed] == [r[key] for r in run[2:]], key


def test_the_ramp_matches_mindformers_scheduler_arithmetic():
    ramp = BatchRamp([16, 8, 1000], 64)  # 6 levels of 8 every 1000/6 samples
    assert ramp.sizes() == [16, 24, 32, 40, 48, 56, 64]
    assert [ramp.global_batch_at(c) for c in (0, 166, 167, 333, 334, 999, 1000, 1001)] == [16, 16, 24, 24, 32, 56, 64, 64]
    assert BatchRamp([8, 8, 0], 32).global_batch_at(0) == 32  # no ramp samples: the full batch at once
    assert BatchRamp([32, 8, 100], 32).global_batch_at(0) == 32  # start = max: nothing to ramp


@pytest.mark.parametrize("value, start", [
    ("[2, 2]", "training.rampup_batch_size: must be three integers"),
    ("[0, 2, 8]", "training.rampup_batch_size: start_global_batch_size (first entry) must be > 0"),
    ("[2, 0, 8]", "training.rampup_batch_size: batch_size_increment (second entry) must be > 0"),
    ("[8, 2, 8]", "training.rampup_batch_size: start_global_batch_size 8 exceeds training.global_batch_size 6"),
    ("[2, 3, 8]", "training.rampup_batch_size: training.global_batch_size - start_global_batch_size = 4 must be"),
])
def test_bad_ramps_are_one_line(tiny_config, value, start):
    with pytest.raises(ConfigError) as err:
        tiny_config(f"training.rampup_batch_size={value}", "training.global_batch_size=6")
    assert str(err.value).startswith(start) and "\n" not in str(err.value), str(err.value)


def test_a_ramp_level_that_does_not_split_into_micro_batches_is_one_line(tiny_config):
    cfg = tiny_config("training.rampup_batch_size=[3, 3, 8]", "training.global_batch_size=6",
                      "training.local_batch_size=2")
    with pytest.raises(ConfigError, match=r"^training\.rampup_batch_size: the ramp's global batch 3 is not a multiple"):
        Trainer(cfg, Runtime(device="CPU"), out=lambda _: None)
