"""The one entry point: :func:`parallelize` lays a model out over a mesh and returns its
:class:`~mindtrain.parallel.layout.Layout`.

Pipeline or context parallelism (``pp > 1`` or ``cp > 1``) gives a
:class:`~mindtrain.parallel.pipeline_parallel.PipelineSchedule` (TP, EP and the data-parallel
sharding applied inside each stage); every other combination a :class:`ShardedLayout`:
FSDP over ``dp`` with the configured ZeRO strategy, tensor + sequence parallelism and expert
parallelism around the whole model, one forward and backward per micro-batch.

Compiled layers need nothing from a layout: the model's compiled pieces take their weights
as graph inputs (mindtrain-models' ``Block``), so whatever a layout does to a weight's
storage (a TP slice, a ZeRO-3 unit's gathered weight swapped in by ``set_data``) is what
they compute with, and a layer that a layout wraps inside (TP, EP, CP) runs its compiled
pieces between the layout's collectives.
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping, Optional, Sequence

import mindspore as ms
import numpy as np
from mindspore import Tensor, ops

from mindtrain.config import MindTrainConfig, StepFigures, num_accumulation_steps
from mindtrain.config.fsdp_policy import reshard_after_forward
from mindtrain.config.plan import ParallelPlan
from mindtrain.parallel.expert_parallel import apply_expert_parallel, global_expert_load
from mindtrain.parallel.fsdp import fully_shard
from mindtrain.parallel.layout import (Layout, Shard, full_arrays, grad_norm, load_pieces, local_arrays,
                                      own_full_arrays, own_local_arrays, shards_of)
from mindtrain.parallel.mesh import DeviceMesh
from mindtrain.parallel.pipeline_parallel import PipelineSchedule, relax_receive_timeout
from mindtrain.parallel.tensor_parallel import apply_tensor_parallel

ZERO3 = "optim_grads_params"


def parallelize(model, plan: ParallelPlan, mesh: DeviceMesh, config: MindTrainConfig, *,
                accumulation: Optional[int] = None, columns: Optional[Sequence[str]] = None,
                connect: bool = True) -> Layout:
    """Lay ``model`` out over ``mesh`` as ``config.parallelism`` says; returns its :class:`Layout`.

    ``plan`` is the model's :class:`~mindtrain.config.plan.ParallelPlan`; ``model`` must be
    the whole model with its initial (or loaded) weights, untouched by any layout. With more
    than one rank, this creates the mesh's process groups (for a pipeline, after lifting the
    CPU backend's receive timeout: a stage waits a whole neighbour's forward + backward).
    ``accumulation``: micro-batches per optimizer step on this rank (default: from
    ``config``); ``columns``: the batch columns in model-call order, the first being the
    input ids (default: ``config.train_dataset.dataloader.column_names``). ``connect=False``
    creates no process group: a dry layout of one rank of any world size in one process (to
    build and measure a rank's share), which must then not communicate.
    """
    dims = mesh.dims
    if accumulation is None:
        accumulation = num_accumulation_steps(config, dims)
    pipelined = dims.pp > 1 or dims.cp > 1
    if mesh.world_size > 1 and connect:
        if pipelined:
            relax_receive_timeout()  # before this process's first collective
        mesh.init_process_groups()
    p = config.parallelism
    if pipelined:
        return PipelineSchedule(model, plan, mesh, config.model.seq_length,
                                schedule=p.pipeline_parallel_schedule,
                                layers_per_stage=p.pipeline_parallel_layers_per_stage,
                                dp_sharding=p.data_parallel_shard_strategy if dims.dp_shard > 1 else None,
                                chunks=p.pipeline_parallel_interleave_num, split_experts=split_experts(config),
                                dispatcher=p.moe_token_dispatcher_type, cp_method=p.context_parallel_method,
                                ulysses_degree=p.ulysses_degree_in_cp)
    if columns is None:
        columns = config.train_dataset.dataloader.column_names
    return ShardedLayout(model, plan, mesh, config, accumulation, columns)


def split_experts(config: MindTrainConfig) -> bool:
    """Whether tensor parallelism splits the routed experts: yes unless
    ``parallelism.expert_tensor_parallel`` is 1 (MindFormers' only value: experts whole on
    every TP rank)."""
    return config.parallelism.expert_tensor_parallel != 1


def model_forward(model, columns: Sequence[str]):
    """``forward(*inputs) -> StepFigures`` (of tensors): the model's call on one micro-batch
    given as tensors in ``columns`` order (the first the input ids, the others by name)."""
    names = list(columns)[1:]

    def forward(*inputs):
        kwargs = dict(zip(names, inputs[1:]))
        loss, metrics = model(inputs[0], labels=kwargs["labels"], loss_mask=kwargs.get("loss_mask"),
                              position_ids=kwargs.get("position_ids"), attention_mask=kwargs.get("attention_mask"))
        return StepFigures.from_model(loss, metrics, ops.zeros((), ms.float32))

    return forward


class ShardedLayout:
    """FSDP x TP x EP: the laid-out model and its gradient step on this rank.

    :meth:`run_step` runs each micro-batch's forward and backward and accumulates gradients
    of ``loss / accumulation``, so after all micro-batches :meth:`gradients` is the
    gradient of the global-batch mean loss for :attr:`named_params` (the tensors the
    optimizer owns).
    """

    def __init__(self, model, plan: ParallelPlan, mesh: DeviceMesh, config: MindTrainConfig, accumulation: int,
                 columns: Sequence[str]):
        dims = mesh.dims
        self.model = model
        self._shapes = {n: tuple(p.shape) for n, p in plan.params.items()}
        self.columns = list(columns)
        self.mesh = mesh
        self.accum = accumulation
        self.strategy = config.parallelism.data_parallel_shard_strategy
        self.fsdp = None
        self.tp = None
        self.ep = None
        zero3 = dims.dp > 1 and self.strategy == ZERO3
        # ZeRO-3 gathers per decoder layer / MTP module (units)
        if dims.tp > 1:
            self.tp = apply_tensor_parallel(model, plan, mesh, split_experts=split_experts(config))
        if dims.ep > 1:
            self.ep = apply_expert_parallel(model, plan, mesh, config.parallelism.moe_token_dispatcher_type,
                                            split_experts(config))
        dense = [(p.name, p) for p in model.trainable_params()]
        self._scale = 1.0 / accumulation  # run_step sets it: 1 / that step's micro-batches
        forward = model_forward(model, self.columns)

        def scaled(*inputs):
            figures = forward(*inputs)
            # aux goes through value_and_grad as a plain tuple in StepFigures order
            return figures.loss * self._scale, tuple(figures)

        self._forward = forward
        if dims.dp > 1:
            units, shared = (), None
            if zero3:
                units, shared = _zero3_units(model, plan)
            reshard, _ = reshard_after_forward(config.parallelism.reshard_after_forward_policy, self.strategy,
                                               dims.pp > 1)
            hsdp = {}
            if dims.dense_shard_size < dims.dp:
                # HSDP: dense weights sharded within groups of dense_shard ranks, replicated across
                # them; routed experts (not split by EP) keep the whole data-parallel group
                experts = {n: "dp" for n, p in plan.params.items() if p.expert and n in dict(dense)}
                hsdp = dict(dim="dense", replicate="dense_replica", param_groups=experts)
            self.fsdp = fully_shard(model, mesh, units=units, strategy=self.strategy, shared=shared,
                                    reshard_after_forward=reshard, **hsdp)
            self.named_dense = self.fsdp.named_parameters()
            self._step = self.fsdp.value_and_grad(scaled, has_aux=True)
            self._forward = self.fsdp.forward(forward)
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
        named_experts = list(self.ep.named_parameters()) if self.ep is not None else []
        self.expert_names = [n for n, _ in named_experts]
        self.named_params = list(self.named_dense) + named_experts
        """``(name, tensor)`` the optimizer updates: dense weights (their ``dp`` shards under
        FSDP, TP pieces), then this rank's expert weights."""
        # a TP-replicated gradient is the same on every TP rank, and expert weights that stay
        # whole on several edp ranks (experts not divisible over edp) too: count each once
        self._replicas = [self.tp.replicas(n) if self.tp is not None else 1 for n in self.dense_names]
        if self.fsdp is not None and self.fsdp.replicate is not None:  # HSDP: a shard on every replica
            held = self.fsdp.slots
            self._replicas = [r * (self.fsdp.replicate.size if held[n].group == self.fsdp.group else 1)
                              for r, n in zip(self._replicas, self.dense_names)]
        if self.ep is not None:
            self._replicas += [self.ep.replicas] * len(self.expert_names)

    # ------------------------------------------------------------------ step
    def run_step(self, batches: Sequence[Mapping[str, Any]]) -> list[StepFigures]:
        """Forward + backward of one optimizer step's micro-batches (dicts of arrays by
        column); returns each micro-batch's figures (floats, this rank's). The gradient is of
        the mean over ``batches``, however many there are (a batch-size ramp changes them)."""
        self._scale = 1.0 / len(batches)
        figures = []
        for b in batches:
            _, aux = self._step(*[Tensor(np.ascontiguousarray(b[c])) for c in self.columns])
            figures.append(StepFigures(*(float(t.asnumpy()) for t in aux)))
        return figures

    def evaluate(self, batches: Sequence[Mapping[str, Any]]) -> list[StepFigures]:
        """Forward only of each micro-batch; its figures (floats, this rank's). Call it
        between steps: the expert load these forwards count is dropped."""
        figures = []
        for b in batches:
            out = self._forward(*[Tensor(np.ascontiguousarray(b[c])) for c in self.columns])
            figures.append(StepFigures(*(float(t.asnumpy()) for t in out)))
        self.model.take_expert_load()
        return figures

    def gradients(self) -> list[Tensor]:
        """Reduced gradients aligned with :attr:`named_params`."""
        grads = self.fsdp.grads if self.fsdp is not None else self._acc
        if self.tp is not None:
            grads = self.tp.sync_grads(self.dense_names, grads)
        grads = list(grads)
        if self.ep is not None:
            grads += self.ep.grads
        return grads

    def grad_norm(self, grads: Sequence[Tensor], only: Optional[Sequence[int]] = None) -> float:
        """Global L2 norm of the whole model's gradient, in float64 on the host (the same
        digits run after run, whatever order a multi-threaded kernel would add in);
        ``only``: of those parameters alone (indices into :attr:`named_params`, the same on
        every rank: LoRA's adapters)."""
        if only is not None:
            return grad_norm([grads[i] for i in only], self.mesh.group("world"), [self._replicas[i] for i in only])
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
        if self.mesh.world_size == 1:
            return load
        return global_expert_load(load, self.mesh)

    # ------------------------------------------------------------------ full state
    def to_full(self, tensors: Sequence[Tensor]) -> dict[str, np.ndarray]:
        """Full-shape arrays, keyed by parameter name, of tensors laid out like
        :attr:`named_params` (the parameters themselves or optimizer moments). A collective:
        every rank calls it and gets the result."""
        return full_arrays(self.fsdp, self.tp, self.ep, self.dense_names, self.expert_names, tensors)

    def to_local(self, full: Mapping[str, Any]) -> list[Tensor]:
        """This rank's pieces of full-shape arrays, aligned with :attr:`named_params`."""
        return local_arrays(self.fsdp, self.tp, self.ep, self.dense_names, self.expert_names, full)

    def gather_own(self, named: Sequence[tuple[str, Tensor]]) -> dict[str, np.ndarray]:
        """See :meth:`mindtrain.parallel.layout.Layout.gather_own`."""
        return own_full_arrays(self.fsdp, self.tp, self.ep, self.expert_names, named)

    def scatter_own(self, full: Mapping[str, Any]) -> list[Tensor]:
        """See :meth:`mindtrain.parallel.layout.Layout.scatter_own`."""
        return own_local_arrays(self.fsdp, self.tp, self.ep, self.expert_names, full)

    def shards(self) -> list[Shard]:
        """Where each of :attr:`named_params` sits in its full array."""
        return shards_of(self.fsdp, self.tp, self.ep, self.dense_names, self.expert_names, self._shapes)

    def load_params(self, pieces: Iterable[np.ndarray]) -> None:
        """Write this rank's pieces (aligned with :attr:`named_params`) into the weights."""
        n = len(self.dense_names)
        load_pieces(self.fsdp, self.named_params[:n], self.named_params[n:], pieces)

    def memory_bytes(self) -> int:
        """Bytes of parameters resident on this rank between steps: FSDP shards plus any
        full parameters kept gathered (ZeRO-1/2 keep all of them), TP/EP local pieces."""
        if self.fsdp is not None:
            experts = self.ep.param_bytes() if self.ep is not None else 0
            return int(self.fsdp.memory_bytes()["params"] + experts)
        return int(sum(p.size * p.itemsize for _, p in self.named_params))

    def ep_sent_bytes(self) -> int:
        """See :meth:`mindtrain.parallel.layout.Layout.ep_sent_bytes`."""
        return int(self.ep.sent_bytes) if self.ep is not None else 0


def _zero3_units(model, plan: ParallelPlan) -> tuple[tuple[str, ...], dict[str, list[str]]]:
    """FSDP units = the plan's decoder layers and MTP modules, as cell paths; a parameter of
    a unit that the model also uses outside it (an MTP module's shared-head norm, applied
    by the head) stays gathered with the root."""
    cells = dict(model.cells_and_names())
    units = tuple(u.path for u in plan.units if u.kind in ("decoder", "mtp") and u.path in cells)
    shared = {name: [] for name, p in plan.params.items() if p.applied_outside and p.trainable}
    return units, shared


__all__ = ["ShardedLayout", "model_forward", "parallelize"]
