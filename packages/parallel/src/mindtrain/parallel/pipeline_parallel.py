"""Pipeline parallelism (1F1B, interleaved 1F1B and GPipe) with context parallelism inside each stage.

Every rank builds the whole model with the same seed and runs only its stage's units
(:class:`~mindtrain.parallel.pipeline_stage.ModelStage`); activations go forward and their
gradients backward point to point between neighbouring stages of the ``pp`` group.

MindSpore's PyNative mode cannot keep a forward graph and run its backward later (``ms.vjp``
with several graphs outstanding fails in ``grad.cc``), so a stage sends its output from a
forward without a graph and the backward recomputes that forward inside
``ms.value_and_grad`` with the received output gradient as sensitivity. The result is exact
(the forward is deterministic); the price is one extra stage forward per micro-batch, as in
activation recomputation. The last stage skips the separate forward.

Sends are non-blocking (``isend``, waited at the end of the step) and receives blocking, so
neighbours never wait on each other's sends.
With interleaving (``chunks > 1``) a rank holds several non-contiguous model chunks
(virtual stages, see :mod:`~mindtrain.parallel.pipeline_schedule`) and the tensors of
chunk ``c`` go to and come from the ranks before and after it in virtual-stage order
(rank ``P - 1``'s chunk ``c`` feeds rank 0's chunk ``c + 1``). The CPU backend has no batched
send/recv; sends go through :func:`mindtrain.parallel.collectives.isend`.

The other dimensions of the mesh compose inside each stage: tensor (+ sequence) parallelism
and expert parallelism are applied to the model by the schedule itself, data parallelism
reduces the stage's gradients over ``dp``, optionally sharding the stage's optimizer state
(ZeRO-1), also its gradients (ZeRO-2) and also its weights between steps (ZeRO-3) over
``dp`` through :class:`~mindtrain.parallel.fsdp.FSDP`. Under ZeRO-3 a stage gathers its
weights once at the start of a step and frees them after its last backward, as torchtitan
does when it composes FSDP with pipeline parallelism (re-gathering a stage's weights for
every micro-batch's forward and recomputed backward would multiply the all-gathers by 2M).
"""

from __future__ import annotations

import os
import time
from typing import Any, Iterable, Mapping, Optional, Sequence

import numpy as np

import mindspore as ms
from mindspore import Tensor, ops

from mindtrain.config import ConfigError, StepFigures
from mindtrain.parallel import collectives as C
from mindtrain.parallel.context_parallel import apply_context_parallel, split_batch
from mindtrain.parallel.expert_parallel import apply_expert_parallel
from mindtrain.parallel.fsdp import FSDP
from mindtrain.parallel.layout import (Shard, full_arrays, grad_norm, load_pieces, local_arrays, own_full_arrays,
                                      own_local_arrays, shards_of)
from mindtrain.parallel.mesh import DeviceMesh, Group
from mindtrain.parallel.tensor_parallel import apply_tensor_parallel
from mindtrain.parallel.pipeline_schedule import op_messages, resolve_schedule, stage_ops
from mindtrain.config.pipeline import partition_units
from mindtrain.parallel.pipeline_stage import METRICS, ModelStage


RECEIVE_TIMEOUT_S = 900
"""Seconds a CPU receive may wait for its sender (MindSpore's default is 30)."""


def relax_receive_timeout(seconds: int = RECEIVE_TIMEOUT_S) -> None:
    """Let a stage wait longer than 30 s for its neighbour on the CPU backend.

    MindSpore 2.10's CPU collectives fail a receive that waits more than ``MS_NODE_TIMEOUT``
    seconds (default 30) for its sender, and a stage waits for a whole forward + backward
    of the next stage. The variable is read when the process runs its first collective, so
    set it after ``init`` (before, it would also stretch msrun's node heartbeat timeout and
    with it how long a failed rank takes to end the job) and before any collective. A larger
    value already set is kept; a smaller one (e.g. a short heartbeat timeout given to msrun)
    is raised, which after ``init`` only affects the collectives.
    """
    current = os.environ.get("MS_NODE_TIMEOUT", "")
    if not (current.isdigit() and int(current) >= seconds):
        os.environ["MS_NODE_TIMEOUT"] = str(int(seconds))


def _message(x, carry):
    """What goes to the neighbour stage: ``x`` alone, or flat with the balance terms after it."""
    if carry is None:
        return x
    return ops.concat((x.reshape(-1), carry.reshape(-1)))


def _unit_params(plan: Mapping[str, Any], unit: str) -> list[str]:
    return next(u["params"] for u in plan["units"] if u["name"] == unit)


class _StageParameters:
    """The dense parameters of one stage, presented to :class:`FSDP` as the thing to shard
    (FSDP only lists a model's parameters and sub-Cells)."""

    def __init__(self, params):
        self._params = list(params)

    def get_parameters(self):
        return iter(self._params)

    def trainable_params(self):
        return list(self._params)

    def cells_and_names(self):
        return iter(())


class PipelineSchedule:
    """Runs one optimizer step's micro-batches through this rank's stage.

    ``model`` is the whole model (same initial weights on every rank), ``plan`` its
    parallel plan, ``mesh`` the initialised :class:`DeviceMesh`. With ``pp == cp == 1`` this
    is plain gradient accumulation. The schedule applies tensor parallelism (``tp > 1``) and
    expert parallelism (``ep > 1``) to ``model`` itself, in that order and before the CP
    hooks; pass a model to which neither was applied. :attr:`tp` and :attr:`ep` are the
    returned :class:`~mindtrain.parallel.tensor_parallel.TensorParallel` /
    :class:`~mindtrain.parallel.expert_parallel.ExpertParallel`.

    ``chunks`` > 1 gives this rank that many model chunks (virtual stages ``c * pp + rank``)
    and runs interleaved 1F1B; ``layers_per_stage`` takes every form of
    :func:`mindtrain.config.pipeline.layer_counts`.

    ``dp_sharding``: ``None`` keeps the stage's gradients and optimizer state whole on every
    data-parallel rank. The FSDP strategies shard the dense ones on dim 0 over ``dp`` and
    :attr:`params` are then the shards: ``"optim"`` (ZeRO-1) sums each micro-batch's full
    gradients and reduces them once per step, full weights stay resident and
    :meth:`finish_step` all-gathers the updated shards; ``"optim_grads"`` (ZeRO-2) reduces
    each micro-batch's gradients at once and keeps only the shard; ``"optim_grads_params"``
    (ZeRO-3) in addition frees the stage's full weights between steps (gathered at the start
    of :meth:`step`, freed after its last backward).

    Per step the caller does::

        grads, figures, load = sched.step(micro_batches)
        grads = [g / len(micro_batches) for g in grads]
        norm = sched.grad_norm(grads)          # clip with it
        optimizer.step(grads)                   # on sched.params
        sched.finish_step()
        model.update_expert_bias(load)

    or the same through the :class:`~mindtrain.parallel.layout.Layout` methods
    (:meth:`run_step`, :meth:`gradients`, :meth:`expert_load`), which is what
    :func:`mindtrain.parallel.parallelize` returns for a pipeline.
    """

    def __init__(self, model, plan: Mapping[str, Any], mesh: DeviceMesh, seq_length: int,
                 schedule: str = "1f1b", layers_per_stage: Any = None,
                 dp_sharding: Optional[str] = None, chunks: int = 1, split_experts: bool = True,
                 dispatcher: str = "alltoall", cp_method: str = "colossal", ulysses_degree: Optional[int] = None):
        if dp_sharding not in (None, "optim", "optim_grads", "optim_grads_params"):
            raise ConfigError("parallelism.data_parallel_shard_strategy",
                              f"{dp_sharding!r} is not a sharding strategy; use optim, optim_grads or "
                              f"optim_grads_params")
        self.schedule = resolve_schedule(schedule, chunks)
        if mesh.world_size > 1:
            # only a job's ranks receive; in one process the variable would outlive this
            # object and reach every msrun started later from it (its scheduler would then
            # wait 900 s for a failed rank's heartbeat)
            relax_receive_timeout()
        self.model = model
        self.plan = plan
        self.mesh = mesh
        self.pp = mesh.group("pp")
        self.cp = mesh.group("cp")
        self.dp = mesh.group("dp")
        self.seq_length = seq_length
        if chunks > 1 and self.pp.size == 1:
            raise ConfigError("parallelism.pipeline_parallel_interleave_num",
                              f"{chunks} chunks need pipeline_parallel > 1; set it to 1")
        self.num_chunks = chunks
        self.virtual_parts = partition_units(plan["units"], self.pp.size, layers_per_stage, chunks)
        """Unit names per virtual stage (chunk ``c`` of rank ``r`` is entry ``c * pp + r``)."""
        self.stage_index = self.pp.index
        self.num_stages = self.pp.size
        self.parts = [[u for c in range(chunks) for u in self.virtual_parts[c * self.num_stages + r]]
                      for r in range(self.num_stages)]
        """Unit names per rank of the ``pp`` group (its chunks in order)."""
        self.tp = apply_tensor_parallel(model, plan, mesh, split_experts)
        self.ep = apply_expert_parallel(model, plan, mesh, dispatcher, split_experts)
        apply_context_parallel(model, self.cp, seq_length, cp_method, ulysses_degree)
        self.chunks = [ModelStage(model, plan, self.virtual_parts[c * self.num_stages + self.stage_index])
                       for c in range(chunks)]
        self.stage = self.chunks[0]
        """This rank's first (without interleaving: only) chunk."""
        # this rank's dense weights over all its chunks, each once
        named: dict[str, Any] = {}
        for ch in self.chunks:
            named.update((n, p) for n, p in zip(ch.param_names, ch.params) if n not in named)
        self.stage_params = list(named.values())
        """The dense weights of all this rank's chunks (full, as the model holds them)."""
        order = {n: i for i, n in enumerate(named)}
        self._chunk_index = [[order[n] for n in ch.param_names] for ch in self.chunks]
        self.last_timing: dict[str, float] = {}
        """``step_s`` (wall time of the last :meth:`step`) and ``busy_s`` (its stage compute)."""
        self.dense_names = list(named)
        # Weights used on two stages (the embedding by the MTP modules): their gradients are
        # summed over the stages that hold them, so each holder updates them identically.
        self._tied = self._tied_group(plan)
        mine = set(self.parts[self.stage_index])
        # grad norm counts a tied weight once: on the stage that owns its unit
        self._norm_mask = [plan["params"][n]["unit"] in mine for n in self.dense_names]
        self._tied_idx = [i for i, n in enumerate(self.dense_names) if n in self._tied_names]
        self._tp_replicated = [i for i, n in enumerate(self.dense_names) if n in self.tp.replicated]
        # this stage's routed-expert weights, owned by expert parallelism (not autograd leaves)
        self.expert_names = [n for u in self.parts[self.stage_index]
                             for n in _unit_params(plan, u) if n in self.ep.slots]
        self.fsdp: Optional[FSDP] = None
        if dp_sharding is not None and self.dp.size > 1:
            self.fsdp = FSDP(_StageParameters(self.stage_params), self.dp, strategy=dp_sharding)
        # ZeRO-2/3: every micro-batch's gradients are reduced at once and only the shard kept
        self._shard_each = self.fsdp is not None and self.fsdp.strategy != "optim"
        self._zero3 = self.fsdp is not None and self.fsdp.strategy == "optim_grads_params"
        dense = self.fsdp.params if self.fsdp is not None else self.stage_params
        self.param_names = self.dense_names + self.expert_names
        """Names of :attr:`params`: the stage's dense weights, then its expert weights."""
        self.params = list(dense) + [self.ep.slots[n].param for n in self.expert_names]
        """What the optimizer updates: dense weights (their ``dp`` shards with ZeRO-1), then
        this rank's expert weights (their ``ep``/``edp`` shards)."""
        self.named_params = list(zip(self.param_names, self.params))
        """``(name, tensor)`` of :attr:`params` (the :class:`~mindtrain.parallel.layout.Layout` view)."""
        self._grads: Optional[list[Tensor]] = None
        self._load: Optional[Tensor] = None

    # ---------------------------------------------------------------- setup
    def _tied_group(self, plan) -> Optional[Group]:
        self._tied_names: list[str] = []
        if self.num_stages == 1:
            return None
        holders: dict[str, list[int]] = {}
        for name, users in plan.get("shared", {}).items():
            stages = sorted({s for s, part in enumerate(self.parts) for u in users if u in part})
            if len(stages) > 1:
                holders[name] = stages
        groups = {tuple(v) for v in holders.values()}
        if len(groups) > 1:
            raise NotImplementedError(f"tied weights across different stage sets: {holders}")
        if not groups:
            return None
        stages = groups.pop()
        if self.stage_index not in stages:
            return None
        self._tied_names = [n for n in holders]
        ranks = tuple(self.pp.ranks[s] for s in stages)
        if ranks == self.pp.ranks:
            return self.pp
        return Group("pp_tied", ranks, ranks.index(self.mesh.global_rank), C.new_group(ranks))

    # ---------------------------------------------------------------- step
    def split(self, batch: Mapping[str, Any]) -> dict:
        """This rank's CP part of one micro-batch (see :func:`split_batch`)."""
        last = self.chunks[-1]  # the last virtual stage is the last rank's last chunk
        return split_batch(batch, self.cp.size, self.cp.index, last.num_heads, len(last.mtp_ids)
                           if last.is_last else 0, inputs=self.model.whole_sequence_inputs)

    def step(self, micro_batches: Sequence[Mapping[str, Any]]):
        """Forward and backward of this rank's micro-batches (whole sequences; CP splits them).

        Returns ``(grads, figures, load)``, each already reduced over the whole mesh:
        ``grads`` aligned with :attr:`params`, summed over the micro-batches, the CP group and
        the stages sharing a weight, summed over TP where a weight is replicated, and averaged
        over the data-parallel (``dp``) ranks (with ZeRO-1 only this rank's shard); dividing by
        the number of micro-batches gives the gradient of the global batch's mean loss.
        ``figures`` a :class:`~mindtrain.config.StepFigures` of floats, averaged over
        micro-batches and ``dp`` ranks, each the single-process value; ``load`` the [n_moe_layers, E] tokens
        per expert of the global batch (for ``update_expert_bias``), on every rank.
        """
        start = time.perf_counter()
        busy = 0.0
        self.ep.zero_grad()
        if self._zero3:
            self.fsdp.gather_params()
        mbs = [self.split(b) for b in micro_batches]
        m = len(mbs)
        b, s_local = mbs[0]["input_ids"].shape
        # sequence parallelism: between layers each TP rank holds 1/tp of the local sequence
        act_shape = (b, s_local // self.tp.size, self.stage.hidden_size)
        inputs: dict[tuple[int, int], Optional[Tensor]] = {}
        partial: dict[int, list] = {}  # micro-batch -> this rank's dense gradients so far
        pending = []
        acc: Optional[list[Tensor]] = None
        figures = []
        load = None
        me, n_dense = self.stage_index, len(self.dense_names)
        for op in stage_ops(self.schedule, self.num_stages, me, m, self.num_chunks):
            i, c = op.micro, op.chunk
            st = self.chunks[c]
            recv, send = op_messages(op, me, self.num_stages, self.num_chunks)
            if op.kind == "F":
                h, carried = (None, None) if recv is None else self._recv(act_shape, st, False, recv[0])
                inputs[(c, i)] = (h, carried)
                if send is not None:  # the last virtual stage's forward runs inside its backward
                    t = time.perf_counter()
                    out, carry = st.forward_only(h, mbs[i], carried)
                    out.asnumpy()  # the CPU runs ops asynchronously; wait so the time is the compute
                    busy += time.perf_counter() - t
                    pending.append(C.isend(_message(out, carry), send[0], self.pp))
                continue
            sens, total = (None, None) if recv is None else self._recv(act_shape, st, True, recv[0])
            t = time.perf_counter()
            h, carried = inputs.pop((c, i))
            gh, grads, fig, count, carry = st.backward(h, sens, mbs[i], carried, total)
            fig.asnumpy()
            busy += time.perf_counter() - t
            if send is not None:
                pending.append(C.isend(_message(gh, carry), send[0], self.pp))
            mine = partial.setdefault(i, [None] * n_dense)
            for k, g in zip(self._chunk_index[c], grads):
                mine[k] = g if mine[k] is None else mine[k] + g
            figures.append(fig)
            rows = st.load_rows(count)
            load = rows if load is None else load + rows
            if c > 0:
                continue
            # chunk 0's backward is the micro-batch's last on this rank: its gradients are complete
            grads = [ops.zeros(p.shape, p.dtype) if g is None else g
                     for g, p in zip(partial.pop(i), self.stage_params)]
            if self._shard_each:
                grads = self._reduce_micro(grads)
            acc = grads if acc is None else [a + g for a, g in zip(acc, grads)]
        for work in pending:
            work.wait()
        if self._zero3:
            self.fsdp.free_params()
        result = self._finish(acc, figures, load, m)
        self.last_timing = {"step_s": time.perf_counter() - start, "busy_s": busy}
        return result

    def evaluate(self, batches: Sequence[Mapping[str, Any]]) -> list[StepFigures]:
        """Forward only of ``batches`` (no gradients, no weight change): each micro-batch goes
        through the virtual stages in order, its activations sent ahead as in training.
        Returns one :class:`~mindtrain.config.StepFigures`, the mean over the micro-batches
        reduced over the mesh as :meth:`run_step`'s. Under ZeRO-3 the stage's weights are
        gathered for the call and freed after it."""
        if self._zero3:
            self.fsdp.gather_params()
        try:
            mbs = [self.split(b) for b in batches]
            b, s_local = mbs[0]["input_ids"].shape
            act_shape = (b, s_local // self.tp.size, self.stage.hidden_size)
            n_virtual = self.num_stages * self.num_chunks
            figures, pending = [], []
            for mb in mbs:
                for v in range(n_virtual):
                    chunk, rank = divmod(v, self.num_stages)
                    if rank != self.stage_index:
                        continue
                    st = self.chunks[chunk]
                    h, carried = (None, None) if v == 0 else \
                        self._recv(act_shape, st, False, (v - 1) % self.num_stages)
                    with ms._no_grad():
                        out, _, fig, _, carry = st.forward(h, mb, carried)
                    figures.append(fig)
                    if v < n_virtual - 1:
                        pending.append(C.isend(_message(out, carry), (v + 1) % self.num_stages, self.pp))
            for work in pending:
                work.wait()
        finally:
            if self._zero3:
                self.fsdp.free_params()
        # each virtual stage's figures are its share of a micro-batch: sum them, average over
        # micro-batches, add up the CP and stage shares, average over dp
        fig = C.all_reduce(ops.stack(figures).sum(0) / float(len(mbs)), self.mesh.group("dp_cp"))
        fig = C.all_reduce(fig, self.pp)
        return [StepFigures.from_named(METRICS, (fig.asnumpy().astype(np.float64) / self.dp.size).tolist())]

    def _recv(self, act_shape, stage, backward: bool, src: int):
        """One message from stage ``src``: the activation (or its gradient) of ``act_shape``
        and, for a model whose balance loss spans its layers, the balance terms it carries
        (forward [2, E], backward [E]; see :meth:`ModelStage.forward`), else None."""
        extra = stage.message_extra(backward)
        if not extra:
            return C.recv(act_shape, ms.float32, src, self.pp), None
        n = int(np.prod(act_shape))
        flat = C.recv((n + extra,), ms.float32, src, self.pp)
        carry = flat[n:]
        return flat[:n].reshape(act_shape), carry if backward else carry.reshape(2, extra // 2)

    def _reduce_micro(self, grads: list) -> list:
        """ZeRO-2/3: one micro-batch's stage gradients summed over CP and averaged over
        ``dp``, of which this rank keeps its shard."""
        if self.cp.size > 1:
            grads = self._sum_over(list(grads), list(range(len(grads))), self.cp)
        return self.fsdp.reduce_scatter(grads)

    def _finish(self, acc, figures, load, m):
        reduced = self._shard_each  # the gradients are already reduced shards
        sizes = [int(np.prod(g.shape)) for g in acc] if not reduced else []
        # every chunk's figures are its share of a micro-batch: sum them, average over micro-batches
        fig = ops.stack(figures).sum(0) / float(m)
        n_load = int(np.prod(load.shape))
        # One all-reduce over dp x cp carries gradient shares, figures and expert load: CP
        # shares add up, data-parallel ranks are averaged (load: summed) below.
        flat = ops.cat(([] if reduced else [g.reshape(-1) for g in acc]) + [fig, load.reshape(-1)])
        flat = C.all_reduce(flat, self.mesh.group("dp_cp"))
        n = sum(sizes)
        inv_dp = 1.0 / self.dp.size
        if reduced:
            grads = list(acc)
        else:
            grads = [g.reshape(a.shape) for g, a in zip(ops.split(flat[:n] * inv_dp, sizes), acc)] if acc else []
        tail = flat[n:]
        if self._tied is not None and self._tied_idx:
            grads = self._sum_over(grads, self._tied_idx, self._tied)
        if self.tp.size > 1 and self._tp_replicated:
            # every TP rank computed a partial gradient of a replicated weight
            grads = self._sum_over(grads, self._tp_replicated, self.tp.group)
        # figures and load: the stages' contributions are disjoint, so summing over pp collects them
        tail = C.all_reduce(tail, self.pp)
        # the stage packs its figures in METRICS order; from here on they travel by name
        figures = StepFigures.from_named(METRICS, (tail[:len(METRICS)].asnumpy().astype(np.float64) * inv_dp).tolist())
        load = tail[len(METRICS):len(METRICS) + n_load].reshape(load.shape)
        if self.fsdp is not None and not reduced:
            grads = self.fsdp.shard_full(grads, self.dense_names)
        # expert gradients come from expert parallelism averaged over dp x cp; CP shares add up
        cp = float(self.cp.size)
        experts = [self.ep.slots[n].grad for n in self.expert_names]
        experts = [ops.zeros(self.ep.slots[n].param.shape, ms.float32) if g is None else g * cp
                   for n, g in zip(self.expert_names, experts)]
        return grads + experts, figures, load

    @staticmethod
    def _sum_over(grads: list, idx: Sequence[int], group: Group) -> list:
        """``grads`` with the entries ``idx`` summed over ``group`` (one all-reduce)."""
        sizes = [int(np.prod(grads[i].shape)) for i in idx]
        total = C.all_reduce(ops.cat([grads[i].reshape(-1) for i in idx]), group)
        out = list(grads)
        for i, t in zip(idx, ops.split(total, sizes)):
            out[i] = t.reshape(grads[i].shape)
        return out

    def grad_norm(self, grads: Sequence[Tensor]) -> float:
        """Global L2 norm of the whole model's gradient (each weight counted once), from
        ``grads`` aligned with :attr:`params`; the same float on every rank."""
        # each rank's squares are divided by how many ranks hold the same values
        dense_rep = self.cp.size * (1 if self.fsdp is not None else self.dp.size)
        expert_rep = self.ep.replicas if self.expert_names else 1
        tp_rep = set(self._tp_replicated)
        n_dense = len(self.dense_names)
        # a tied weight counts on the stage that owns its unit only
        counted = [i for i in range(len(grads)) if i >= n_dense or self._norm_mask[i]]
        replicas = [dense_rep * (self.tp.size if i in tp_rep else 1) if i < n_dense else expert_rep
                    for i in counted]
        return grad_norm([grads[i] for i in counted], self.mesh.group("world"), replicas)

    def to_full(self, tensors: Sequence[Tensor]) -> dict[str, np.ndarray]:
        """Full arrays of every stage's tensors laid out like :attr:`params` (the weights
        themselves or optimizer moments), on every rank: each stage un-shards its own, then
        they are broadcast over ``pp`` stage by stage (collective over the mesh)."""
        mine = full_arrays(self.fsdp, self.tp, self.ep, self.dense_names, self.expert_names, tensors)
        if self.num_stages == 1:
            return mine
        out: dict[str, np.ndarray] = {}
        for stage, part in enumerate(self.parts):
            for u in self.plan["units"]:
                if u["name"] not in part:
                    continue
                for n in u["params"]:
                    info = self.plan["params"][n]
                    if not info["trainable"]:
                        continue
                    x = Tensor(np.ascontiguousarray(mine[n])) if stage == self.stage_index \
                        else Tensor(np.zeros(info["shape"], np.float32))
                    out[n] = C.broadcast(x, stage, self.pp).asnumpy()
        return out

    def to_local(self, full: Mapping[str, Any]) -> list[Tensor]:
        """This rank's pieces of full arrays, aligned with :attr:`params` (no communication)."""
        return local_arrays(self.fsdp, self.tp, self.ep, self.dense_names, self.expert_names, full)

    def gather_own(self, named: Sequence[tuple[str, Tensor]]) -> dict[str, np.ndarray]:
        """See :meth:`mindtrain.parallel.layout.Layout.gather_own` (this stage's parameters)."""
        return own_full_arrays(self.fsdp, self.tp, self.ep, self.expert_names, named)

    def scatter_own(self, full: Mapping[str, Any]) -> list[Tensor]:
        """See :meth:`mindtrain.parallel.layout.Layout.scatter_own`."""
        return own_local_arrays(self.fsdp, self.tp, self.ep, self.expert_names, full)

    def shards(self) -> list[Shard]:
        """Where each of :attr:`params` sits in its full array."""
        shapes = {n: tuple(self.plan["params"][n]["shape"]) for n in self.param_names}
        return shards_of(self.fsdp, self.tp if self.tp.size > 1 else None, self.ep, self.dense_names,
                         self.expert_names, shapes)

    def load_params(self, pieces: Iterable[np.ndarray]) -> None:
        """Write this rank's pieces (aligned with :attr:`params`) into the weights."""
        n = len(self.dense_names)
        load_pieces(self.fsdp, self.named_params[:n], self.named_params[n:], pieces)

    def memory_bytes(self) -> int:
        """Bytes of parameters resident on this rank between steps: the stage's full weights
        (kept resident; freed under ZeRO-3), its FSDP shards and its expert pieces."""
        resident = sum(q.size * q.itemsize for q in self.stage_params)
        shards = sum(q.size * q.itemsize for q in self.fsdp.params) if self.fsdp is not None else 0
        return int(resident + shards + self.ep.param_bytes(self.expert_names))

    def ep_sent_bytes(self) -> int:
        """See :meth:`mindtrain.parallel.layout.Layout.ep_sent_bytes`."""
        return int(self.ep.sent_bytes)

    def finish_step(self) -> None:
        """After the optimizer updated :attr:`params`: with ZeRO-1/2 all-gather the updated
        shards into the stage's full weights (ZeRO-3 gathers them at the next step); drop
        the gradients."""
        if self.fsdp is not None:
            self.fsdp.finish_step()
        self.ep.zero_grad()
        self._grads = None

    # ---------------------------------------------------------------- Layout
    def run_step(self, batches: Sequence[Mapping[str, Any]]) -> list[StepFigures]:
        """:meth:`step` over one optimizer step's micro-batches, its gradients divided by
        their number (see :meth:`gradients`, :meth:`expert_load`); returns one
        :class:`~mindtrain.config.StepFigures`: the mean over the micro-batches."""
        grads, figures, load = self.step(list(batches))
        self._grads = [g / float(len(batches)) for g in grads]
        self._load = load
        return [figures]

    def gradients(self) -> list[Tensor]:
        """The last :meth:`run_step`'s gradient of the global batch's mean loss, aligned with
        :attr:`params`."""
        return list(self._grads)

    def expert_load(self) -> Tensor:
        """Tokens per expert of the last :meth:`run_step`'s global batch. The stages count
        through the schedule, so the model's own tally is dropped."""
        self.model.take_expert_load()
        return self._load
