"""monitor.health_checkpoint: a step over the global-norm threshold leaves weights and
optimizer state alone, the next one trains; global_norm_skip_time skips in a row stop the run."""

import numpy as np
import pytest

from mindtrain.trainer.health import GlobalNormSkipError
from mindtrain.trainer.runtime import Runtime
from mindtrain.trainer.trainer import Trainer


def _weights(trainer):
    return {n: p.asnumpy().copy() for n, p in trainer.params}


def test_step_over_the_norm_threshold_is_skipped_and_the_run_stops_after_skip_time(tiny_config):
    lines = []
    cfg = tiny_config("monitor.health_checkpoint.global_norm_skip_threshold=1e-6",
                      "monitor.health_checkpoint.global_norm_skip_time=2",
                      "monitor.health_checkpoint.embedding_local_norm_threshold=1e-6")
    trainer = Trainer(cfg, Runtime(device="CPU"), out=lines.append)
    before = _weights(trainer)
    rec = trainer.train_step()
    assert rec["skipped"] and rec["grad_norm"] > 1e-6 and trainer.step == 1
    after = _weights(trainer)
    for name, value in before.items():
        np.testing.assert_array_equal(after[name], value, err_msg=name)
    assert trainer.optimizer.step_count == 0
    assert all(not np.any(m.asnumpy()) for m in trainer.optimizer.exp_avg)
    skip_line = [x for x in lines if "update skipped" in x]
    assert len(skip_line) == 1 and skip_line[0].startswith("mindtrain: step 1: global norm ")
    assert "global_norm_skip_threshold 1e-06" in skip_line[0]
    emb = [x for x in lines if "embedding_local_norm" in x]
    assert len(emb) == 1 and "step 1" in emb[0] and "(rank 0)" in emb[0]

    trainer.skips.skip_threshold = 1e9  # the next step is under the threshold
    rec2 = trainer.train_step()
    assert not rec2["skipped"] and trainer.optimizer.step_count == 1
    moved = _weights(trainer)
    assert any(not np.array_equal(moved[n], before[n]) for n in before)

    # skips count from the last step under the threshold; the second in a row stops the run
    trainer.skips.skip_threshold = 1e-6
    assert trainer.train_step()["skipped"]
    with pytest.raises(GlobalNormSkipError) as err:
        trainer.train_step()
    msg = str(err.value)
    assert msg.startswith("monitor.health_checkpoint.global_norm_skip_time: ") and "2 consecutive steps" in msg
    assert "(the last: step 4, " in msg and "\n" not in msg
    assert len([x for x in lines if "update skipped" in x]) == 2
