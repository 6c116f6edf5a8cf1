"""profiler: MindSpore's profiler records the configured steps into output_path/rank_<R>."""

import csv
import glob
import os

import pytest

from mindtrain.config import ConfigError
from mindtrain.config.schema import ProfilerConfig
from mindtrain.trainer.profiler import StepProfiler
from mindtrain.trainer.runtime import Runtime
from mindtrain.trainer.trainer import Trainer


def test_profiler_records_the_configured_step(tiny_config, tmp_path):
    out = tmp_path / "prof"
    cfg = tiny_config("profiler.enable_profiling=true", "profiler.start_step=2", "profiler.end_step=2",
                      f"profiler.output_path={out}", "profiler.with_stack=false")
    Trainer(cfg, Runtime(device="CPU"), out=lambda _: None).train()
    assert os.listdir(out) == ["rank_0"]
    runs = glob.glob(str(out / "rank_0" / "*_ascend_ms"))
    assert len(runs) == 1, os.listdir(out / "rank_0")  # one profiling session
    ops = os.path.join(runs[0], "FRAMEWORK", "cpu_op_type_info_0.csv")
    with open(ops) as f:
        rows = list(csv.DictReader(f))
    assert any(r["op_type"] == "MatMul" for r in rows), rows[:3]  # the step's host kernels
    assert os.path.getsize(os.path.join(runs[0], "ASCEND_PROFILER_OUTPUT", "trace_view.json")) > 0


def test_profiler_settings():
    on = ProfilerConfig(enable_profiling=True, start_step=2, end_step=3, output_path="p", profiler_rank=[1])
    assert not StepProfiler(on, rank=0, device="CPU").active  # not a profiled rank
    assert StepProfiler(on, rank=1, device="CPU").output_dir == os.path.join("p", "rank_1")
    assert not StepProfiler(ProfilerConfig(), rank=0, device="CPU").active
    with pytest.raises(ConfigError, match=r"^profiler.start_step: is 3 and end_step 2"):
        StepProfiler(ProfilerConfig(enable_profiling=True, start_step=3, end_step=2), rank=0, device="CPU")
