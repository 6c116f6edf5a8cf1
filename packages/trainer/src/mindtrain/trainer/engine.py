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
from mindspore import Tensor, ops

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
            from mindtrain.parallel.tensor_parallel import apply_tensor_parallel

            self.tp = apply_tensor_parallel(model, plan, self.mesh)
        if dims.ep > 1:
            from mindtrain.parallel.expert_parallel import apply_expert_parallel

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
        # a TP-replicated gradient is the same on every TP rank: count it once in the norm
        self._norm_weight = [1.0 / dims.tp if self.tp is not None and n in self.tp.replicated else 1.0
                             for n in self.dense_names]
        # expert weights that stay whole on several edp ranks (experts not divisible over edp)
        self._expert_weight = 1.0 / self.ep.edp_replicas.size if self.ep is not None else 1.0

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
        n_dense = len(self.dense_names)
        local = 0.0
        for i, g in enumerate(grads):
            g64 = g.asnumpy().astype(np.float64)
            w = self._norm_weight[i] if i < n_dense else self._expert_weight
            local += w * float(np.sum(g64 * g64))
        if self.dims.world_size > 1:
            from mindtrain.parallel import collectives as C

            local = float(C.all_reduce(Tensor([local], ms.float64), self.mesh.group("world")).asnumpy()[0])
        return float(np.sqrt(local))

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
        from mindtrain.parallel.expert_parallel import global_expert_load

        return global_expert_load(load, self.mesh)

    # ------------------------------------------------------------------ full state
    def to_full(self, tensors: Sequence[Tensor]) -> dict[str, np.ndarray]:
        """Full-shape arrays, keyed by parameter name, of tensors laid out like
        :attr:`named_params` (the parameters themselves or optimizer moments). A collective:
        every rank calls it and gets the result."""
        return _to_full(self.fsdp, self.tp, self.ep, self.dense_names, [n for n, _ in self.expert_named], tensors)

    def to_local(self, full: dict[str, np.ndarray]) -> list[Tensor]:
        """This rank's pieces of full-shape arrays, aligned with :attr:`named_params`."""
        return _to_local(self.fsdp, self.tp, self.ep, self.dense_names, [n for n, _ in self.expert_named], full)

    def full_params(self) -> dict[str, np.ndarray]:
        """Every trainable parameter at full shape (collective; all ranks get it)."""
        return self.to_full([p for _, p in self.named_params])

    def memory_bytes(self) -> int:
        """Bytes of parameters resident on this rank between steps: FSDP shards plus any
        full parameters kept gathered (ZeRO-1/2 keep all of them), TP/EP local pieces."""
        if self.fsdp is not None:
            experts = sum(p.size * p.itemsize for _, p in self.expert_named)
            return int(self.fsdp.memory_bytes()["params"] + experts)
        return int(sum(p.size * p.itemsize for _, p in self.named_params))


def _to_full(fsdp, tp, ep, dense_names: Sequence[str], expert_names: Sequence[str],
             tensors: Sequence[Tensor]) -> dict[str, np.ndarray]:
    """Undo FSDP (dim-0 shards over dp), TP (splits over tp) and EP (experts over ep, their
    rows over edp, their TP split over tp) for tensors aligned with ``dense_names + expert_names``; collective."""
    n_dense = len(dense_names)
    dense = list(tensors[:n_dense])
    if fsdp is not None:
        arrays = fsdp.gather_full(dense, list(dense_names))
    else:
        arrays = [t.asnumpy().copy() for t in dense]
    out = {}
    for name, a in zip(dense_names, arrays):
        out[name] = tp.full_param(name, a) if tp is not None else a
    for name, t in zip(expert_names, tensors[n_dense:]):
        out[name] = ep.full_value(name, t)
    return out


def _to_local(fsdp, tp, ep, dense_names: Sequence[str], expert_names: Sequence[str],
              full: dict) -> list[Tensor]:
    """This rank's pieces of full arrays: the inverse of :func:`_to_full` (no communication)."""
    dense = []
    for name in dense_names:
        a = np.asarray(full[name])
        if tp is not None and tp.size > 1 and name in tp.sharded:
            dim = tp.sharded[name][1]
            n = a.shape[dim] // tp.size
            a = np.take(a, np.arange(tp.index * n, (tp.index + 1) * n), axis=dim)
        dense.append(a)
    if fsdp is not None:
        local = fsdp.shard_full(dense, list(dense_names))
    else:
        local = [Tensor(np.ascontiguousarray(a)) for a in dense]
    for name in expert_names:
        local.append(Tensor(ep.local_value(name, full[name])))
    return local


def _zero3_units(model, plan) -> tuple[tuple[str, ...], dict[str, list[str]]]:
    """FSDP units = the plan's decoder layers and MTP modules, as cell paths; a parameter of
    a unit that the model also uses outside it (an MTP module's shared-head norm, applied
    by the head) stays gathered with the root."""
    cells = dict(model.cells_and_names())
    units = []
    for u in plan["units"]:
        if u["kind"] not in ("decoder", "mtp") or u["layer"] is None:
            continue
        path = f"model.layers.{u['layer']}"
        if path in cells:
            units.append(path)
    shared = {name: [] for name in plan["params"] if ".shared_head." in name and plan["params"][name]["trainable"]}
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
        from mindtrain.parallel.pipeline_parallel import PipelineSchedule, relax_receive_timeout

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
        """Full arrays of every stage's tensors (laid out like each stage's parameters);
        each stage's own are un-sharded, then broadcast over ``pp`` stage by stage."""
        s = self.sched
        mine = _to_full(s.fsdp, s.tp, s.ep, s.dense_names, s.expert_names, tensors)
        if s.num_stages == 1:
            return mine
        from mindtrain.parallel import collectives as C

        out: dict[str, np.ndarray] = {}
        for stage, part in enumerate(s.parts):
            for u in self.plan["units"]:
                if u["name"] not in part:
                    continue
                for n in u["params"]:
                    info = self.plan["params"][n]
                    if not info["trainable"]:
                        continue
                    x = Tensor(np.ascontiguousarray(mine[n])) if stage == s.stage_index \
                        else Tensor(np.zeros(info["shape"], np.float32))
                    out[n] = C.broadcast(x, stage, s.pp).asnumpy()
        return out

    def to_local(self, full: dict[str, np.ndarray]) -> list[Tensor]:
        s = self.sched
        return _to_local(s.fsdp, s.tp, s.ep, s.dense_names, s.expert_names, full)

    def full_params(self) -> dict[str, np.ndarray]:
        return self.to_full(self.sched.params)

    def memory_bytes(self) -> int:
        s = self.sched
        resident = sum(q.size * q.itemsize for q in s.stage_params)  # full stage weights stay resident
        shards = sum(q.size * q.itemsize for q in s.fsdp.params) if s.fsdp is not None else 0
        experts = sum(s.ep.slots[n].param.size * s.ep.slots[n].param.itemsize for n in s.expert_names)
        return int(resident + shards + experts)


def build_engine(model, cfg: MindTrainConfig, dims: ParallelDims, rank: int, distributed: bool,
                 accumulation: int, forward, columns: Sequence[str]):
    """The engine for this layout: pipeline/context parallelism, or FSDP x TP x EP."""
    if dims.pp > 1 or dims.cp > 1:
        return PipelineEngine(model, cfg, dims, rank, distributed, accumulation)
    return Engine(model, cfg, dims, rank, distributed, accumulation, forward, columns)
