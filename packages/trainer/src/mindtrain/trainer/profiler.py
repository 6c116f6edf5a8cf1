"""profiler: MindSpore's profiler (``mindspore.profiler.profile``) over training steps
``start_step..end_step``, as MindFormers' PyNative trainer runs it
(mindformers/pynative/tools/profiler.py): one schedule that skips the steps before
``start_step``, records ``end_step - start_step + 1`` steps, and writes through
``tensorboard_trace_handler`` into ``<output_path>/rank_<R>``. On CPU it records host
operator timings (FRAMEWORK/cpu_op_*.csv, ASCEND_PROFILER_OUTPUT/trace_view.json); device
activity is recorded on Ascend only.
"""

from __future__ import annotations

import os
from typing import Optional

from mindtrain.config import ConfigError

DEFAULT_OUTPUT = os.path.join("output", "profile")


class StepProfiler:
    """Call :meth:`start` before the first step, :meth:`step` after each, :meth:`stop` at the
    end (also on errors). Inactive (every call a no-op) unless profiling is on for this rank."""

    def __init__(self, cfg, rank: int, device: str, first_step: int = 0):
        self.cfg = cfg
        self.rank = rank
        self.device = device
        self.first_step = first_step
        self.output_dir: Optional[str] = None
        self._prof = None
        if not cfg.enable_profiling:
            return
        if cfg.start_step < 1 or cfg.end_step < cfg.start_step:
            raise ConfigError("profiler.start_step", f"is {cfg.start_step} and end_step {cfg.end_step}; give "
                              "1 <= start_step <= end_step")
        if cfg.profiler_level not in (None, 0, 1, 2):
            raise ConfigError("profiler.profiler_level", f"is {cfg.profiler_level!r}; give 0, 1 or 2")
        ranks = cfg.profiler_rank
        if ranks is not None and rank not in ranks:
            return
        self.output_dir = os.path.join(cfg.output_path or DEFAULT_OUTPUT, f"rank_{rank}")

    @property
    def active(self) -> bool:
        return self.output_dir is not None

    def start(self) -> None:
        if not self.active or self.cfg.end_step <= self.first_step:
            return
        from mindspore.profiler import (ProfilerActivity, ProfilerLevel, _ExperimentalConfig, profile, schedule,
                                        tensorboard_trace_handler)

        c = self.cfg
        activities = [ProfilerActivity.CPU] if c.profile_cpu else []
        if self.device == "Ascend":
            activities.append(ProfilerActivity.NPU)
        level = ProfilerLevel.LevelNone if c.profiler_level is None else getattr(ProfilerLevel, f"Level{c.profiler_level}")
        # the schedule counts steps from this call: resumed runs start past step 0
        skip = max(c.start_step - self.first_step, 1)
        active = c.end_step - max(c.start_step, self.first_step + 1) + 1
        self._prof = profile(activities=activities, with_stack=c.with_stack, profile_memory=c.profile_memory,
                             schedule=schedule(wait=0, warmup=0, active=active, repeat=1, skip_first=skip),
                             on_trace_ready=tensorboard_trace_handler(self.output_dir),
                             experimental_config=_ExperimentalConfig(profiler_level=level, mstx=c.mstx))
        self._prof.start()
        self._prof.step()  # the schedule's step k is training step first_step + k

    def step(self) -> None:
        if self._prof is not None:
            self._prof.step()

    def stop(self) -> None:
        if self._prof is not None:
            self._prof.stop()
            self._prof = None
