"""What runs around each training step besides the step itself: ``monitor.train_state``,
``monitor.health_checkpoint``, ``monitor.tensorboard``, ``callbacks`` and ``profiler``.
The Trainer calls :class:`StepHooks` at five points of its loop; each feature lives in its
own module (monitor, health, tensorboard, callbacks, profiler)."""

from __future__ import annotations

from typing import Callable, Optional, Sequence

from mindtrain.config import families
from mindtrain.trainer.callbacks import CallbackHandler, TrainerState, build_callbacks
from mindtrain.trainer.health import HealthCheck
from mindtrain.trainer.log_line import mtp_fields
from mindtrain.trainer.moe_monitor import MoeMonitor
from mindtrain.trainer.monitor import TrainStateMonitor, TrainStateRecord
from mindtrain.trainer.profiler import StepProfiler
from mindtrain.trainer.tensorboard import TensorBoardWriter, check_settings


class StepHooks:
    """``log`` prints into this rank's log, ``out`` on rank 0 only."""

    def __init__(self, cfg, rank: int, device: str, total_steps: int, accumulation: int,
                 log: Callable[[str], None], out: Callable[[str], None]):
        """Built before the model, so that a config mistake here fails fast; :meth:`bind`
        adds the model and optimizer once they exist."""
        self.cfg = cfg
        self.log = log
        self.out = out
        self.total_steps = total_steps
        m = cfg.model
        self.moe = families.has_moe(m)
        self.train_state = TrainStateMonitor.from_config(cfg.monitor.train_state)
        self.health = HealthCheck.from_config(cfg.monitor.health_checkpoint, log=log, rank=rank)
        self.callbacks = CallbackHandler(build_callbacks(cfg.callbacks))
        self.profiler = StepProfiler(cfg.profiler, rank, device)
        self.state = TrainerState(max_steps=total_steps, global_batch_size=cfg.training.global_batch_size,
                                  num_accumulation_steps=accumulation)
        tb = cfg.monitor.tensorboard
        if tb.output_dir:
            check_settings(tb.log_interval, tb.queue_size)
        self.tensorboard: Optional[TensorBoardWriter] = TensorBoardWriter.from_config(cfg) if rank == 0 else None
        self._record: Optional[TrainStateRecord] = None
        mm = cfg.monitor.moe_monitor
        self.moe_monitor = MoeMonitor(mm.save_tokens_per_expert_interval, mm.target_layers, [], 0)

    def bind(self, model, optimizer, first_step: int) -> None:
        """The built model and optimizer (passed to callbacks) and the step training starts
        after (a resumed run's)."""
        self.callbacks.objects.update(model=model, optimizer=optimizer)
        mm = self.cfg.monitor.moe_monitor
        self.moe_monitor = MoeMonitor(mm.save_tokens_per_expert_interval, mm.target_layers,
                                      list(getattr(model, "moe_layer_ids", [])), self.cfg.model.num_hidden_layers)
        for note in self.moe_monitor.notes():
            self.out(f"mindtrain: {note}")
        self.state.global_step = first_step
        self.profiler.first_step = first_step

    def _logged(self, step: int) -> bool:
        return step % self.cfg.training.log_interval == 0 or step == self.total_steps

    # ------------------------------------------------------------------ loop points
    def train_begin(self, consumed_samples: int) -> None:
        self.state.consumed_samples = consumed_samples
        self.state.is_train_begin = True
        self.callbacks.call("on_train_begin", self.cfg, self.state)
        self.profiler.start()

    def step_begin(self) -> None:
        self.callbacks.call("on_step_begin", self.cfg, self.state)

    def after_gradients(self, step: int, named_grads: Sequence, device_norms,
                        micro_losses: Sequence[float], device_losses: Sequence[float], expert_load=None) -> None:
        """Called with the step's gradients before clipping and the update (whether it is
        skipped is :class:`~mindtrain.trainer.health.SkipDecision`'s call, after this).
        ``device_norms``: a :class:`~mindtrain.trainer.monitor.DeviceNorms` of the layout;
        ``expert_load``: the step's tokens per expert [MoE layers, experts], all ranks."""
        self._record = None
        if expert_load is not None:
            for line in self.moe_monitor.lines(step, expert_load):
                self.out(line)
        # the same decision on every rank (device_norm sums over all of them), though only
        # rank 0 writes TensorBoard
        tb = self.cfg.monitor.tensorboard
        due = self._logged(step) or bool(tb.output_dir and step % tb.log_interval == 0)
        if self.train_state.active and due:
            self._record = self.train_state.observe(step, named_grads, device_norms, micro_losses, device_losses)
        self.health.check_embedding(step, named_grads)

    def step_end(self, rec: dict) -> None:
        """After the step line: train_state lines, TensorBoard, callbacks, profiler."""
        step = rec["step"]
        self.state.global_step = step
        self.state.consumed_samples = rec["consumed_samples"]
        if self._record is not None and self._logged(step):
            for line in self._record.local_lines():
                self.log(line)
            for line in self._record.rank0_lines():
                self.out(line)
        if self.tensorboard is not None:
            m = self.cfg.model
            self.tensorboard.write(step, dict(rec, global_batch_size=rec.get("global_batch_size", self.cfg.training.global_batch_size)),
                                   mtp=mtp_fields(rec["mtp_loss"], m.num_nextn_predict_layers,
                                                  m.mtp_loss_scaling_factor),
                                   moe=self.moe, train_state=self._record)
        self.callbacks.call("on_step_end", self.cfg, self.state, loss=rec["loss"], grad_norm=rec["grad_norm"],
                            lr=rec["lr"], skipped=rec["skipped"], record=rec)
        self.profiler.step()

    def train_end(self) -> None:
        self.state.is_train_end = True
        self.callbacks.call("on_train_end", self.cfg, self.state)
        self.close()

    def close(self) -> None:
        self.profiler.stop()
        if self.tensorboard is not None:
            self.tensorboard.close()
            self.tensorboard = None
