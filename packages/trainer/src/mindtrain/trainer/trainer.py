"""The Trainer: builds model, data, optimizer and schedule from the config and runs the loop."""

from __future__ import annotations

import math
import os
import random
import resource
import time
from typing import Callable, Optional

import mindspore as ms
import numpy as np
from mindspore import Tensor

from mindtrain.config import (
    MindTrainConfig,
    StepFigures,
    dump_config,
    num_accumulation_steps,
    resolve_parallelism,
)
from mindtrain.config import families
from mindtrain.config.rampup import BatchRamp
from mindtrain.trainer import checkpoint as ckpt
from mindtrain.trainer.hang_watch import HangWatch
from mindtrain.trainer.health import NonFiniteError, SkipDecision  # noqa: F401 (NonFiniteError: re-exported)
from mindtrain.trainer.log_line import format_step_line, mtp_fields
from mindtrain.trainer.lr_schedule import LRSchedule
from mindtrain.trainer.metrics import MetricsWriter, new_run_dir
from mindtrain.trainer.monitor import DeviceNorms
from mindtrain.trainer.max_logits import reset_max_logits, synced_max_logits, wants_max_logits
from mindtrain.trainer.muon import build_optimizer
from mindtrain.trainer.preemption import REASONS, Preemption
from mindtrain.trainer.runtime import Runtime, apply_context
from mindtrain.trainer.share import build_share
from mindtrain.trainer.step_hooks import StepHooks
from mindtrain.trainer.validation import Validator, format_validation_line

def _max_rss_mb() -> float:
    # MindSpore's memory counters read 0 on CPU; the process's peak RSS is what a user sees.
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


class Trainer:
    """One training job on this rank.

    The model is laid out by :func:`mindtrain.parallel.parallelize` (FSDP over
    ``data_parallel_shard``, tensor + sequence, expert, context and pipeline parallelism),
    and the loop talks to the returned :class:`mindtrain.parallel.Layout` only; per
    optimizer step each data-parallel rank runs ``num_accumulation_steps`` micro-batches,
    and the update uses the gradient of the mean of all micro-batch mean losses of the
    global batch, as one process with the whole batch would.
    """

    def __init__(self, cfg: MindTrainConfig, runtime: Runtime, out: Callable[[str], None] = print):
        from mindtrain.data import PretrainingLoader, build_dataset, check_token_ids

        self.cfg = cfg
        self.rt = runtime
        # start-up notes once (rank 0); the step line on every rank, into each worker's log
        self.out = out if runtime.rank == 0 else (lambda _line: None)
        self.log = out
        for note in apply_context(cfg, runtime.device):
            self.out(f"mindtrain: {note}")
        self.dims = resolve_parallelism(cfg.parallelism, runtime.world_size)
        self.accum = num_accumulation_steps(cfg, self.dims)
        """Micro-batches per step at the full global batch (a ramp's steps may run fewer)."""
        self.ramp = BatchRamp.from_config(cfg.training)
        if self.ramp is not None:
            self.ramp.check_units(self.dims.dp * cfg.training.local_batch_size,
                                  f"data_parallel_shard x local_batch_size = {self.dims.dp}x{cfg.training.local_batch_size}")
        self.hooks = StepHooks(cfg, runtime.rank, runtime.device, cfg.training.steps, self.accum, log=out, out=self.out)
        self.skips = SkipDecision.from_config(cfg, log=out)
        from mindtrain.config.fsdp_policy import reshard_after_forward
        from mindtrain.config.pipeline import microbatch_note

        p = cfg.parallelism
        notes = [microbatch_note(p.pipeline_parallel_microbatch_size, self.dims.pp, self.accum),
                 reshard_after_forward(p.reshard_after_forward_policy, p.data_parallel_shard_strategy,
                                       self.dims.pp > 1)[1]]
        for note in filter(None, notes):
            self.out(f"mindtrain: {note}")
        t = cfg.training
        self.total_steps = t.steps
        # data first: a wrong data_path fails before the (slower) model build
        dl = cfg.train_dataset.dataloader
        self.columns = list(dl.column_names)
        if dl.type == "MindDataset":
            from mindtrain.trainer.mind_dataset import build_mind_loader

            self.loader = build_mind_loader(cfg, self._data_rank(), self.dims.dp)
            self.columns = self.loader.dataset.columns
        else:
            dataset = build_dataset(cfg.train_dataset)
            check_token_ids(dataset, cfg.model.vocab_size)  # one line here, not a gather-kernel trace later
            self.loader = PretrainingLoader(
                dataset, micro_batch_size=t.local_batch_size, global_batch_size=t.global_batch_size,
                dp_rank=self._data_rank(), dp_size=self.dims.dp,
                drop_remainder=cfg.train_dataset.drop_remainder,
                num_workers=cfg.train_dataset.num_parallel_workers, shuffle=dl.shuffle, seed=t.seed)
        self._seed(t.seed)
        # The model's default path: each decoder layer compiled with ms.jit. Everything that
        # changes weights afterwards (optimizer, expert-bias update, checkpoint load) writes
        # the existing buffers in place, which the compiled layers read.
        from mindtrain.models import effective_compute_dtype
        from mindtrain.models.precision import effective_param_dtype

        self.compute_dtype, note = effective_compute_dtype(cfg.model.compute_dtype, runtime.device)
        if note:
            self.out(f"mindtrain: {note}")
        note = effective_param_dtype(cfg.model.param_init_dtype, runtime.device)[1]
        if note:
            self.out(f"mindtrain: {note}")
        if self.compute_dtype == "float16":
            self.out("mindtrain: model.compute_dtype=float16 runs without loss scaling; very small gradients "
                     "may underflow to zero (bfloat16 on Ascend or float32 avoid this)")
        self._batches = None
        self._preempt: Optional[Preemption] = None  # set while train() runs
        self._stop_votes = np.zeros(len(REASONS))  # the last step's preemption votes, summed over ranks
        self.step = 0
        self.consumed_samples = 0
        self.checkpointer = ckpt.Checkpointer(cfg, runtime.rank, runtime.world_size, self.dims.dp,
                                              barrier=runtime.barrier, out=self.out,
                                              any_failed=lambda failed: bool(runtime.all_sum(
                                                  np.array([float(failed)], np.float32))[0] > 0))
        self.checkpointer.all_gather_bytes = runtime.all_gather_bytes
        # this rank's share only: built without memory, laid out, then its pieces made or read
        share = build_share(cfg, self.dims, runtime.rank, self.checkpointer, self.compute_dtype, self.accum,
                            self.columns)
        self.model, self.layout = share.model, share.layout
        self._buffers = share.buffers
        resume = share.resume
        self.params = self.layout.named_params
        self.schedule = LRSchedule.from_config(cfg)
        self.adapted = share.adapted
        self._trained: Optional[list[int]] = None  # LoRA: the adapters' indices in self.params
        if self.adapted is None:
            self.optimizer = build_optimizer(self.params, cfg.optimizer, lr=self.schedule(1), layout=self.layout,
                                             model=cfg.model)
        else:
            from mindtrain.models.lora import is_adapter
            from mindtrain.trainer.lora import AdapterOptimizer

            self._trained = [i for i, (n, _) in enumerate(self.params) if is_adapter(n)]
            self.optimizer = AdapterOptimizer(build_optimizer([self.params[i] for i in self._trained], cfg.optimizer,
                                                              lr=self.schedule(1), layout=self.layout,
                                                              model=cfg.model), self._trained)
            self.out(f"mindtrain: LoRA: adapters on {len(self.adapted)} Linear layers (rank "
                     f"{cfg.lora_config.lora_rank}, alpha {cfg.lora_config.lora_alpha}); the optimizer trains only them")
        self.flops_per_token = self._flops_per_token()
        self._track_logits = wants_max_logits(cfg)
        self._qk_clip = cfg.optimizer.type == "Muon" and bool(cfg.optimizer.qk_clip_enabled)
        self.max_logits: dict = {}
        """The last step's max attention logit per layer and head (all ranks'), when tracked."""
        self.qk_clipped = 0
        """Heads QK-clip scaled at the last step."""
        if resume is not None:
            self._load_state(resume)
        self.hooks.bind(self.model, self.optimizer, self.step)
        self._device_norms = DeviceNorms(self.layout.shards(), runtime.all_gather_bytes,
                                         lambda v: runtime.all_sum(v, np.float64))
        self.validator = Validator.from_config(cfg, self._data_rank(), self.dims.dp,
                                               lambda v: runtime.all_sum(v, np.float64), runtime.world_size)
        self.metrics: Optional[MetricsWriter] = None
        if self.rt.rank == 0:
            run_dir = new_run_dir(cfg.monitor.metrics_dir)
            dump_config(cfg, os.path.join(run_dir, "config.yaml"))
            self.metrics = MetricsWriter(run_dir)

    # ------------------------------------------------------------------ setup
    def _data_rank(self) -> int:
        """This rank's sample stream: its data_parallel_shard index (the TP, CP and pipeline
        ranks of one replica read the same samples)."""
        from mindtrain.parallel import DeviceMesh

        return DeviceMesh(self.dims, self.rt.rank).rank("dp")

    @staticmethod
    def _seed(seed: int) -> None:
        # Every rank seeds identically, so all ranks initialise the same full model.
        ms.set_seed(seed)
        np.random.seed(seed)
        random.seed(seed)

    def _flops_per_token(self) -> float:
        from mindtrain.models import flops_per_token

        return float(flops_per_token(self.cfg.model, self.cfg.model.seq_length))

    # ------------------------------------------------------------------ step
    def global_batch_size(self) -> int:
        """The next step's global batch: training.global_batch_size, or the ramp's size after
        the samples consumed so far (training.rampup_batch_size)."""
        if self.ramp is None:
            return self.cfg.training.global_batch_size
        return self.ramp.global_batch_at(self.consumed_samples)

    def train_step(self) -> dict:
        """One optimizer step (all micro-batches); returns the step's metrics."""
        start = time.perf_counter()
        if self._batches is None:
            self._batches = iter(self.loader)
        global_batch = self.global_batch_size()
        accum = global_batch // (self.dims.dp * self.cfg.training.local_batch_size)
        if self._track_logits:
            reset_max_logits(self.model)  # evaluation forwards since the last step count for nothing
        dropout = getattr(self.model, "dropout", None)
        if dropout is not None:  # on for this step's forwards only (evaluation runs without)
            dropout.begin_step(self.step + 1, self.cfg.training.seed)
        try:
            micro = self.layout.run_step([next(self._batches) for _ in range(accum)])
        finally:
            if dropout is not None:
                dropout.end_step()
        if self._track_logits:
            from mindtrain.parallel import DeviceMesh

            tp_rank = DeviceMesh(self.dims, self.rt.rank).rank("tp")
            self.max_logits = synced_max_logits(self.model, self.rt.all_sum, self.rt.rank, self.rt.world_size,
                                                tp_rank)
            object.__setattr__(self.model, "max_attention_logits", self.max_logits)  # MaxLogitsMonitor reads it
        local = np.mean(np.array(micro, np.float64), axis=0)
        world = self.rt.world_size
        # every rank's figures in one all-reduce (each rank fills its own slot: a gather);
        # the preemption votes ride on it (summed over ranks: Trainer.train decides on them)
        n = len(StepFigures._fields)
        slots = np.zeros((world, n + len(REASONS)), np.float64)
        slots[self.rt.rank, :n] = local
        if self._preempt is not None:
            slots[self.rt.rank, n:] = self._preempt.flags()
        if self.rt.distributed:
            from mindtrain.parallel import all_reduce

            slots = all_reduce(Tensor(slots)).asnumpy().astype(np.float64)
        slots, self._stop_votes = slots[:, :n], slots[:, n:].sum(axis=0)
        per_device = [StepFigures(*row) for row in slots]
        step_figures = StepFigures(*slots.mean(axis=0))
        micro_losses = [m.lm_loss for m in micro]
        device_losses = [f.lm_loss for f in per_device]
        total_load = self.layout.expert_load()
        grads = self.layout.gradients()
        grad_norm = self.layout.grad_norm(grads, only=self._trained)  # LoRA: the adapters' alone
        lr = self.schedule(self.step + 1)
        finite = math.isfinite(grad_norm) and bool(np.all(np.isfinite(step_figures)))
        max_norm = self.cfg.training.max_norm
        self.hooks.after_gradients(self.step + 1, [(n, g) for (n, _), g in zip(self.params, grads)],
                                   self._device_norms, micro_losses, device_losses, total_load)
        skipped = self.skips.decide(self.step + 1, grad_norm, finite)
        if not skipped:
            # clipping (torch's coefficient) is the update's gradient scale: one pass, no copy
            coef = max_norm / (grad_norm + 1e-6)
            self.optimizer.step(grads, lr=lr, grad_scale=coef if max_norm > 0 and coef < 1.0 else 1.0)
            if self._qk_clip:
                self.qk_clipped = self.optimizer.qk_clip(self.max_logits, self.cfg.optimizer.qk_clip_threshold)
            self.model.update_expert_bias(total_load)
        self.layout.finish_step()
        self.step += 1
        self.consumed_samples += global_batch
        elapsed = time.perf_counter() - start
        tokens_per_device = accum * self.cfg.training.local_batch_size * self.cfg.model.seq_length
        tracked = {}
        if self._track_logits:  # the step's largest attention logit (all layers, heads, ranks)
            tracked["max_attention_logit"] = float(max((v.max() for v in self.max_logits.values()), default=0.0))
        if self._qk_clip:
            tracked["qk_clipped_heads"] = 0 if skipped else self.qk_clipped
        return {**tracked, "step": self.step, "loss": step_figures.lm_loss,
                "load_balancing_loss": step_figures.load_balancing_loss,
                "mtp_loss": step_figures.mtp_loss, "total_loss": step_figures.loss, "lr": lr, "grad_norm": grad_norm,
                "per_step_time_ms": elapsed * 1000.0,
                "tokens_per_s": tokens_per_device * self.dims.dp / elapsed,
                "throughput_flops": self.flops_per_token * tokens_per_device / elapsed,
                "max_rss_mb": _max_rss_mb(), "param_bytes": self.layout.memory_bytes(),
                "optimizer_bytes": self.optimizer.state_bytes(),
                # bytes this rank's expert-parallel dispatch and combine sent so far (0 without EP)
                "ep_sent_bytes": self.layout.ep_sent_bytes(),
                "skipped": skipped, "skipped_total": self.skips.skipped_total,
                "consumed_samples": self.consumed_samples, "global_batch_size": global_batch,
                "local_losses": micro_losses, "device_losses": device_losses}

    # ------------------------------------------------------------------ loop
    def train(self) -> list[dict]:
        """Run until training.steps; returns the per-step metrics (on every rank)."""
        cfg = self.cfg
        m = cfg.model
        has_moe = families.has_moe(m)
        history = []
        save_every = cfg.checkpoint.save_interleaved_steps
        # SIGTERM/SIGINT (or msrun gone): every rank stops after the same step, saved
        preempt = self._preempt = Preemption(watch_parent=self.rt.distributed)
        hang = (HangWatch(self.rt.rank, self.rt.world_size, cfg.monitor.hang_timeout, self.log)
                if self.rt.distributed and cfg.monitor.hang_timeout > 0 else None)
        self.hooks.train_begin(self.consumed_samples)
        while self.step < self.total_steps:
            if hang is not None:
                hang.step_begin(self.step + 1)
            self.hooks.step_begin()
            rec = self.train_step()
            history.append(rec)
            if self.step % cfg.training.log_interval == 0 or self.step == self.total_steps:
                self.log(format_step_line(
                    self.step, self.total_steps, rec["loss"], rec["per_step_time_ms"], rec["lr"], rec["grad_norm"],
                    rec["throughput_flops"], load_balancing_loss=rec["load_balancing_loss"] if has_moe else None,
                    mtp=mtp_fields(rec["mtp_loss"], m.num_nextn_predict_layers, m.mtp_loss_scaling_factor)))
            if self.validator is not None and self.validator.due(self.step):
                rec.update(self.validator.run(self.layout))
                self.out(format_validation_line(self.step, self.total_steps, rec))
            self.hooks.step_end(rec)  # train_state lines, TensorBoard, callbacks, profiler
            if self.metrics is not None:
                self.metrics.write({k: v for k, v in rec.items() if k not in ("local_losses",)})
            self.skips.check_non_finite(self.step)
            saved = None
            if self.checkpointer.writer is not None and ((save_every and self.step % save_every == 0)
                                                         or self.step == self.total_steps):
                saved = self.save()
            if hang is not None:
                hang.step_end()
            # distributed: the votes summed in this step's figures all-reduce; one process:
            # its own flags now (nothing to agree with, no collective either way)
            reason = preempt.decide(self._stop_votes if self.rt.distributed else preempt.flags())
            if reason is not None:
                self._stop_preempted(reason, saved)
                break
        preempt.close()
        self._preempt = None
        if hang is not None:
            hang.close()
        self._finish_saves()  # an asynchronous save finishes before training returns
        self.hooks.train_end()
        if self.metrics is not None:
            self.metrics.close()
        return history

    def _stop_preempted(self, reason: str, saved: Optional[str]) -> None:
        """Training stops after this step on every rank: save it (off-interval too) when
        saving is enabled, and say so in one line."""
        if self.checkpointer.writer is not None and saved is None:
            saved = self.save()
        if not self._finish_saves():
            saved = None
        if saved is not None:
            where = (f"checkpoint saved to {saved}; resume with checkpoint.load_path={os.path.dirname(saved)} "
                     "(or --load_checkpoint)")
        else:
            where = "no checkpoint saved (checkpoint.enable_save is false)"
        what = f"{reason} received" if reason.startswith("SIG") else reason
        self.out(f"mindtrain: {what}: stopped after step {self.step} of {self.total_steps}; {where}")

    # ------------------------------------------------------------------ checkpoints
    def save(self) -> Optional[str]:
        """Save this step (every rank). A save that fails (disk full, say) on any rank is one
        line, and training goes on to the next interval; returns the folder, or None then."""
        try:
            self.checkpointer.wait()  # an earlier asynchronous save may have failed
            return self._save()
        except ckpt.SaveFailed as err:
            every = self.cfg.checkpoint.save_interleaved_steps
            nxt = f"the next save is at step {(self.step // every + 1) * every}" if every else "it is not retried"
            self.out(f"mindtrain: {err}; training goes on, {nxt}")
            return None

    def _finish_saves(self) -> bool:
        """Wait for an asynchronous save; False (and one line) if it failed."""
        try:
            self.checkpointer.wait()
            return True
        except ckpt.SaveFailed as err:
            self.out(f"mindtrain: {err}")
            return False

    def _save(self) -> str:
        """Each rank writes its own pieces (checkpoint.layout: mindtrain or mindformers);
        ``checkpoint.no_save_optim``: weights only (no optimizer, data or RNG state)."""
        counters = {"step": self.step, "consumed_samples": self.consumed_samples, **self.skips.state_dict()}
        with_state = not self.cfg.checkpoint.no_save_optim
        folder = self.checkpointer.save_sharded(self.step, counters, self.schedule, self.layout, self._buffers,
                                                self.optimizer if with_state else None,
                                                self.loader.state_dict() if with_state else {}, self.total_steps)
        if self._trained is not None:
            self.save_adapters()
        return folder

    def save_adapters(self) -> str:
        """LoRA: the adapters alone (adapter_model.safetensors with PEFT's names, or MindFormers'
        with ``checkpoint.layout: mindformers``; adapter_config.json), in ``save_path``/lora/iter_NNNNNNN (a collective: the adapters'
        pieces are gathered; rank 0 writes)."""
        from mindtrain.trainer.lora import ADAPTER_DIR, adapter_config, save_adapters

        full = self.layout.gather_own([self.params[i] for i in self._trained])
        if self.dims.pp > 1:  # each stage holds its own layers' adapters: rank 0 collects them all
            from safetensors.numpy import load, save

            parts = self.rt.all_gather_bytes(save(full) if full else b"")
            full = {n: a for part in parts if part for n, a in load(part).items()}
        path = os.path.join(self.cfg.checkpoint.save_path, ADAPTER_DIR, f"iter_{self.step:07d}")
        if self.rt.rank == 0:
            save_adapters(path, full, adapter_config(self.cfg, self.adapted), self.cfg.model)
        return path

    def _load_state(self, resume: ckpt.Resume) -> None:
        counters = self.checkpointer.load_state(resume, self.layout, self.optimizer, self.loader,
                                                self.schedule, self.total_steps)
        self.step = counters["step"]
        self.consumed_samples = counters["consumed_samples"]
        self.skips.load_state_dict(counters)
