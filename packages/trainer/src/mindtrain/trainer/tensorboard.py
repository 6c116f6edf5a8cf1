"""monitor.tensorboard: TensorBoard event files written with tensorboardX (the writer
MindFormers imports), on rank 0, every ``log_interval`` steps.

Scalar tags are MindFormers' (its LossCallback's monitor names): ``loss``,
``learning-rate``, ``grad-norm``, ``throughput`` (TFLOP/s per device), ``iteration-time``
(ms), ``batch-size``, ``load-balancing-loss`` (MoE), ``mtp-1-loss`` (or ``mtp-loss`` for
deeper MTP), each also as ``<tag>_vs_samples`` over consumed samples; plus
``device-loss/rank<R>``, ``local-norm/<param>`` and ``device-norm/<param>`` when
``monitor.train_state`` asks for them, and the config as text at step 0.
"""

from __future__ import annotations

from typing import Optional, Sequence

from mindtrain.config import ConfigError


def check_settings(log_interval: int, queue_size: int) -> None:
    """Every rank checks them (all ranks decide alike when a step is written)."""
    for name, value in (("log_interval", log_interval), ("queue_size", queue_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"monitor.tensorboard.{name}", f"is {value!r}; give a positive integer")


class TensorBoardWriter:
    """One SummaryWriter over ``output_dir``; :meth:`write` is a no-op between intervals."""

    def __init__(self, output_dir: str, log_interval: int = 1, queue_size: int = 1000,
                 config_text: Optional[dict[str, str]] = None):
        check_settings(log_interval, queue_size)
        from tensorboardX import SummaryWriter

        self.output_dir = output_dir
        self.log_interval = log_interval
        self._writer = SummaryWriter(logdir=output_dir, max_queue=queue_size)
        for key, text in (config_text or {}).items():
            self._writer.add_text(key, text, global_step=0)
        self._writer.flush()

    @classmethod
    def from_config(cls, cfg) -> Optional["TensorBoardWriter"]:
        """The writer ``cfg.monitor.tensorboard`` asks for, or None (output_dir empty)."""
        tb = cfg.monitor.tensorboard
        if not tb.output_dir:
            return None
        import dataclasses
        import json

        sections = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)}
        text = {name: json.dumps(dataclasses.asdict(value), indent=2, default=str)
                for name, value in sections.items() if dataclasses.is_dataclass(value)}
        return cls(tb.output_dir, tb.log_interval, tb.queue_size, text)

    def due(self, step: int) -> bool:
        return step % self.log_interval == 0

    def write(self, step: int, rec: dict, mtp: Sequence[tuple[str, float]] = (), moe: bool = False,
              train_state=None) -> None:
        """The scalars of one step record (see :meth:`Trainer.train_step`); an evaluation's
        (``validation_loss``) whenever the record has one, under Megatron's names (hyphens for spaces)."""
        if "validation_loss" in rec:
            self._writer.add_scalar("lm-loss-validation", float(rec["validation_loss"]), global_step=step)
            self._writer.add_scalar("lm-loss-validation-ppl", float(rec["validation_ppl"]), global_step=step)
            self._writer.flush()
        if not self.due(step):
            return
        scalars = {"loss": rec["loss"], "learning-rate": rec["lr"], "grad-norm": rec["grad_norm"],
                   "throughput": rec["throughput_flops"] / 1e12, "iteration-time": rec["per_step_time_ms"],
                   "batch-size": rec.get("global_batch_size")}
        if moe:
            scalars["load-balancing-loss"] = rec["load_balancing_loss"]
        for name, value in mtp:
            scalars[name.replace("_", "-")] = value
        samples = rec.get("consumed_samples")
        for tag, value in scalars.items():
            if value is None:
                continue
            self._writer.add_scalar(tag, float(value), global_step=step)
            if samples is not None:
                self._writer.add_scalar(f"{tag}_vs_samples", float(value), global_step=samples)
        if train_state is not None:
            for r, v in enumerate(train_state.device_losses):
                self._writer.add_scalar(f"device-loss/rank{r}", float(v), global_step=step)
            for kind, norms in (("local-norm", train_state.local_norms), ("device-norm", train_state.device_norms)):
                for name, v in norms.items():
                    self._writer.add_scalar(f"{kind}/{name}", v, global_step=step)
        self._writer.flush()

    def close(self) -> None:
        self._writer.flush()
        self._writer.close()
