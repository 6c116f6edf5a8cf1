"""How this rank computes its share of one optimizer step: the model laid out by
mindtrain.parallel (FSDP over ``data_parallel_shard``, TP + SP, EP) and the gradient rules
that make the step equal to one process with the whole global batch.

Every rank builds the whole model from the same seed (and loads weights into it) before
the engine shards it, so all layouts start from identical parameters.

Compiled layers (the model's default ``ms.jit`` per decoder layer) read a parameter's
storage bound at compile time, so they see in-place writes (``ops.assign``, the AdamW
kernel) but never a parameter swapped by ``set_data``. ZeRO-3 frees and re-gathers
parameters by swapping storage, and TP/EP replace layer forwards with collectives, so
those layouts run eager layers; a single process and FSDP ZeRO-1/2 keep the compiled ones.
"""

from __future__ import annotations

from typing import Optional, Sequence

import mindspore as ms
import numpy as np
from mindspore import Tensor

from mindtrain.config import MindTrainConfig, ParallelDims, StepFigures

ZERO3 = "optim_grads_params"


class Engine:
    """The laid-out model and its gradient step on this rank.

    ``forward(*inputs) -> StepFigures`` (of tensors) is the model call for one micro-batch; :meth:`micro_step` runs it with backward and accumulates gradients
    of ``loss / accumulation``, so after all micro-batches :meth:`gradients` is the gradient
    of the global-batch mean loss for :attr:`named_params` (the tensors the optimizer owns).
    """

    def __init__(self, model, cfg: MindTrainConfig, dims: ParallelDims, rank: int, distributed: bool,
                 accumulation: int, forward, columns: Sequence[str]):
        from mindtrain.models import parallel_plan
        from mindtrain.parallel import DeviceMesh

        self.model = model
        self.columns = list(columns)
        self.dims = dims
        self.accum = accumulation
        self.strategy = cfg.parallelism.data_parallel_shard_strategy
        self.mesh = DeviceMesh(dims, rank)
        if distributed:
            self.mesh.init_process_groups()
        self.fsdp = None
        self.tp = None
        self.ep = None
        zero3 = dims.dp > 1 and self.strategy == ZERO3
        self.eager = dims.tp > 1 or dims.ep > 1 or zero3
        if self.eager and getattr(model, "jit_enabled", False):
            model.set_jit(False)
        plan = parallel_plan(model)
        if dims.tp > 1:
            from mindtrain.parallel import apply_tensor_parallel

            self.tp = apply_tensor_parallel(model, plan, self.mesh)
        if dims.ep > 1:
            from mindtrain.parallel import apply_expert_parallel

            self.ep = apply_expert_parallel(model, plan, self.mesh)
        dense = [(p.name, p) for p in model.trainable_params()]
        scale = 1.0 / accumulation

        def scaled(*inputs):
            figures = forward(*inputs)
            # aux goes through value_and_grad as a plain tuple in StepFigures order
            return figures.loss * scale, tuple(figures)

        if dims.dp > 1:
            from mindtrain.parallel import fully_shard

            units, shared = (), None
            if zero3 and self.tp is None and self.ep is None:
                units, shared = _zero3_units(model, plan)
            from mindtrain.config.fsdp_policy import reshard_after_forward

            reshard, _ = reshard_after_forward(cfg.parallelism.reshard_after_forward_policy, self.strategy, dims.pp > 1)
            self.fsdp = fully_shard(model, self.mesh, units=units, strategy=self.strategy, shared=shared,
                                    reshard_after_forward=reshard)
            self.named_dense = self.fsdp.named_parameters()
            self._step = self.fsdp.value_and_grad(scaled, has_aux=True)
        else:
            self.named_dense = dense
            grad_fn = ms.value_and_grad(scaled, None, [p for _, p in dense], has_aux=True)
            self._acc: Optional[list[Tensor]] = None

            def step(*inputs):
                (value, aux), grads = grad_fn(*inputs)
                self._acc = list(grads) if self._acc is None else [a + g for a, g in zip(self._acc, grads)]
                return value, aux

            self._step = step
        self.dense_names = [n for n, _ in self.named_dense]
        self.expert_named = self.ep.named_parameters() if self.ep is not None else []
        self.named_params = list(self.named_dense) + list(self.expert_named)
        # a TP-replicated gradient is the same on every TP rank, and expert weights that stay
        # whole on several edp ranks (experts not divisible over edp) too: count each once
        self._replicas = [self.tp.replicas(n) if self.tp is not None else 1 for n in self.dense_names]
        if self.ep is not None:
            self._replicas += [self.ep.replicas] * len(self.expert_named)

    # ------------------------------------------------------------------ step
    def run_step(self, batches: Sequence[dict]) -> list[StepFigures]:
        """Forward + backward of one optimizer step's micro-batches (dicts of arrays by
        column); returns each micro-batch's figures (floats)."""
        return [self.micro_step([Tensor(np.ascontiguousarray(b[c])) for c in self.columns]) for b in batches]

    def micro_step(self, inputs: Sequence[Tensor]) -> StepFigures:
        """Forward + backward of one micro-batch; returns its unscaled figures on this rank."""
        _, aux = self._step(*inputs)
        return StepFigures(*(float(t.asnumpy()) for t in aux))

    def gradients(self) -> list[Tensor]:
        """Reduced gradients aligned with :attr:`named_params`."""
        if self.fsdp is not None:
            grads = self.fsdp.grads
        else:
            grads = self._acc
        if self.tp is not None:
            grads = self.tp.sync_grads(self.dense_names, grads)
        grads = list(grads)
        if self.ep is not None:
            grads += self.ep.grads
        return grads

    def grad_norm(self, grads: Sequence[Tensor]) -> float:
        """Global L2 norm of the whole model's gradient, in float64 on the host (the same
        digits run after run, whatever order a multi-threaded kernel would add in)."""
        from mindtrain.parallel import grad_norm

        return grad_norm(grads, self.mesh.group("world"), self._replicas)

    def finish_step(self) -> None:
        """After the optimizer step: refresh gathered parameters, drop gradients."""
        if self.fsdp is not None:
            self.fsdp.finish_step()
        else:
            self._acc = None
        if self.ep is not None:
            self.ep.zero_grad()

    def expert_load(self) -> Tensor:
        """Tokens per expert of the whole global batch (for update_expert_bias)."""
        load = self.model.take_expert_load()
        if self.dims.world_size == 1:
            return load
        from mindtrain.parallel import global_expert_load

        return global_expert_load(load, self.mesh)

    # ------------------------------------------------------------------ full state
    def to_full(self, tensors: Sequence[Tensor]) -> dict[str, np.ndarray]:
        """Full-shape arrays, keyed by parameter name, of tensors laid out like
        :attr:`named_params` (the parameters themselves or optimizer moments). A collective:
        every rank calls it and gets the result."""
        from mindtrain.parallel import full_arrays

        return full_arrays(self.fsdp, self.tp, self.ep, self.dense_names, [n for n, _ in self.expert_named], tensors)

    def to_local(self, full: dict[str, np.ndarray]) -> list[Tensor]:
        """This rank's pieces of full-shape arrays, aligned with :attr:`named_params`."""
        from mindtrain.parallel import local_arrays

        return local_arrays(self.fsdp, self.tp, self.ep, self.dense_names, [n for n, _ in self.expert_named], full)

    def full_params(self) -> dict[str, np.ndarray]:
        """Every trainable parameter at full shape (collective; all ranks get it)."""
        return self.to_full([p for _, p in self.named_params])

    def memory_bytes(self) -> int:
        """Bytes of parameters resident on this rank between steps: FSDP shards plus any
        full parameters kept gathered (ZeRO-1/2 keep all of them), TP/EP local pieces."""
        if self.fsdp is not None:
            experts = self.ep.param_bytes() if self.ep is not None else 0
            return int(self.fsdp.memory_bytes()["params"] + experts)
        return int(sum(p.size * p.itemsize for _, p in self.named_params))


def _zero3_units(model, plan) -> tuple[tuple[str, ...], dict[str, list[str]]]:
    """FSDP units = the plan's decoder layers and MTP modules, as cell paths; a parameter of
    a unit that the model also uses outside it (an MTP module's shared-head norm, applied
    by the head) stays gathered with the root."""
    cells = dict(model.cells_and_names())
    units = []
    for u in plan.units:
        if u.kind in ("decoder", "mtp") and u.path in cells:
            units.append(u.path)
    shared = {name: [] for name, p in plan.params.items() if p.applied_outside and p.trainable}
    return tuple(units), shared



class PipelineEngine:
    """Pipeline and/or context parallelism: :class:`PipelineSchedule` runs this rank's
    stage (its CP share of every micro-batch) with TP/EP applied inside and gradients
    reduced over the data-parallel ranks (sharded over ``dp`` with the configured ZeRO
    strategy when it is > 1; ZeRO-3 frees a stage's weights between steps). Same interface
    as :class:`Engine`."""

    def __init__(self, model, cfg: MindTrainConfig, dims: ParallelDims, rank: int, distributed: bool,
                 accumulation: int):
        from mindtrain.models import parallel_plan
        from mindtrain.parallel import DeviceMesh
        from mindtrain.parallel import PipelineSchedule, relax_receive_timeout

        self.model = model
        self.dims = dims
        self.accum = accumulation
        self.mesh = DeviceMesh(dims, rank)
        if distributed:
            # a stage waits a whole neighbour's forward + backward for its input: lift the CPU
            # backend's 30 s receive limit before this process's first collective
            relax_receive_timeout()
            self.mesh.init_process_groups()
        p = cfg.parallelism
        self.plan = parallel_plan(model)
        self.sched = PipelineSchedule(model, self.plan, self.mesh, cfg.model.seq_length,
                                      schedule=p.pipeline_parallel_schedule,
                                      layers_per_stage=p.pipeline_parallel_layers_per_stage,
                                      dp_sharding=p.data_parallel_shard_strategy if dims.dp_shard > 1 else None,
                                      chunks=p.pipeline_parallel_interleave_num)
        self.named_params = list(zip(self.sched.param_names, self.sched.params))
        self._grads: Optional[list[Tensor]] = None
        self._load: Optional[Tensor] = None

    def run_step(self, batches: Sequence[dict]) -> list[StepFigures]:
        """One StepFigures: the schedule's mean over this step's micro-batches."""
        grads, figures, load = self.sched.step(list(batches))
        self._grads = [g / float(self.accum) for g in grads]
        self._load = load
        return [figures]

    def gradients(self) -> list[Tensor]:
        return list(self._grads)

    def grad_norm(self, grads: Sequence[Tensor]) -> float:
        return self.sched.grad_norm(grads)

    def finish_step(self) -> None:
        self.sched.finish_step()
        self._grads = None

    def expert_load(self) -> Tensor:
        self.model.take_expert_load()  # stages count through the schedule; drop the model's own tally
        return self._load

    def to_full(self, tensors: Sequence[Tensor]) -> dict[str, np.ndarray]:
        """Full arrays of every stage's tensors (laid out like each stage's parameters)."""
        return self.sched.to_full(tensors)

    def to_local(self, full: dict[str, np.ndarray]) -> list[Tensor]:
        return self.sched.to_local(full)

    def full_params(self) -> dict[str, np.ndarray]:
        return self.to_full(self.sched.params)

    def memory_bytes(self) -> int:
        return self.sched.memory_bytes()


def build_engine(model, cfg: MindTrainConfig, dims: ParallelDims, rank: int, distributed: bool,
                 accumulation: int, forward, columns: Sequence[str]):
    """The engine for this layout: pipeline/context parallelism, or FSDP x TP x EP."""
    if dims.pp > 1 or dims.cp > 1:
        return PipelineEngine(model, cfg, dims, rank, distributed, accumulation)
    return Engine(model, cfg, dims, rank, distributed, accumulation, forward, columns)
