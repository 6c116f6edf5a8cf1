"""The one entry point: :func:`parallelize` lays a model out over a mesh and returns its
:class:`~mindtrain.parallel.layout.Layout`.

Pipeline or context parallelism (``pp > 1`` or ``cp > 1``) gives a
:class:`~mindtrain.parallel.pipeline_parallel.PipelineSchedule` (TP, EP and the data-parallel
sharding applied inside each stage); every other combination a :class:`ShardedLayout`:
FSDP over ``dp`` with the configured ZeRO strategy, tensor + sequence parallelism and expert
parallelism around the whole model, one forward and backward per micro-batch. Both are a
:class:`~mindtrain.parallel.share.ModelShare` (what the rank owns, laid out once) with their
own step loop.

Compiled layers need nothing from a layout: the model's compiled pieces take their weights
as graph inputs (mindtrain-models' ``Block``), so whatever a layout does to a weight's
storage (a TP slice, a ZeRO-3 unit's gathered weight swapped in by ``set_data``) is what
they compute with, and a layer that a layout wraps inside (TP, EP, CP) runs its compiled
pieces between the layout's collectives.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional, Sequence

import mindspore as ms
import numpy as np
from mindspore import Tensor, ops

from mindtrain.config import MindTrainConfig, StepFigures, num_accumulation_steps
from mindtrain.config.fsdp_policy import reshard_after_forward
from mindtrain.config.plan import ParallelPlan
from mindtrain.config import ZERO3
from mindtrain.parallel.expert_parallel import global_expert_load
from mindtrain.parallel.layout import Layout
from mindtrain.parallel.mesh import DeviceMesh
from mindtrain.parallel.pipeline_parallel import PipelineSchedule, relax_receive_timeout
from mindtrain.parallel.share import ModelShare, zero3_units


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


class ShardedLayout(ModelShare):
    """FSDP x TP x EP: the laid-out model and its gradient step on this rank (what it owns,
    its reductions and full-state conversions are :class:`~mindtrain.parallel.share.ModelShare`'s).

    :meth:`run_step` runs each micro-batch's forward and backward and accumulates gradients
    of ``loss / accumulation``, so after all micro-batches :meth:`gradients` is the
    gradient of the global-batch mean loss for :attr:`named_params` (the tensors the
    optimizer owns).
    """

    def __init__(self, model, plan: ParallelPlan, mesh: DeviceMesh, config: MindTrainConfig, accumulation: int,
                 columns: Sequence[str]):
        p = config.parallelism
        self._lay_out(model, plan, mesh, split_experts(config), p.moe_token_dispatcher_type)
        self.columns = list(columns)
        self.accum = accumulation
        strategy = p.data_parallel_shard_strategy if mesh.dims.dp > 1 else None
        units, shared = zero3_units(model, plan) if strategy == ZERO3 else ((), None)
        reshard, _ = reshard_after_forward(p.reshard_after_forward_policy, p.data_parallel_shard_strategy,
                                           mesh.dims.pp > 1)
        # ZeRO-3 gathers per decoder layer / MTP module (units)
        self._own(model.trainable_params(), list(self.ep.slots), strategy, units=units, shared=shared,
                  reshard=reshard)
        self._scale = 1.0 / accumulation  # run_step sets it: 1 / that step's micro-batches
        forward = model_forward(model, self.columns)

        def scaled(*inputs):
            figures = forward(*inputs)
            # aux goes through value_and_grad as a plain tuple in StepFigures order
            return figures.loss * self._scale, tuple(figures)

        self._forward = forward
        self._acc: Optional[list[Tensor]] = None
        if self.fsdp is not None:
            self._step = self.fsdp.value_and_grad(scaled, has_aux=True)
            self._forward = self.fsdp.forward(forward)
        else:
            grad_fn = ms.value_and_grad(scaled, None, self.stage_params, has_aux=True)

            def step(*inputs):
                (value, aux), grads = grad_fn(*inputs)
                self._acc = list(grads) if self._acc is None else [a + g for a, g in zip(self._acc, grads)]
                return value, aux

            self._step = step

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
        """Reduced gradients aligned with :attr:`named_params` (FSDP reduced the dense ones
        over ``dp``; without FSDP this rank is its whole data-parallel group)."""
        return self.complete(self.fsdp.grads if self.fsdp is not None else self._acc)

    def finish_step(self) -> None:
        """After the optimizer step: refresh gathered parameters, drop gradients."""
        super().finish_step()
        self._acc = None

    def expert_load(self) -> Tensor:
        """Tokens per expert of the whole global batch (for update_expert_bias)."""
        load = self.model.take_expert_load()
        if self.mesh.world_size == 1:
            return load
        return global_expert_load(load, self.mesh)


__all__ = ["ShardedLayout", "model_forward", "parallelize"]
