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
from typing import Any, Mapping, Optional, Sequence

import numpy as np

import mindspore as ms
from mindspore import Tensor, ops

from mindtrain.config import ConfigError, StepFigures
from mindtrain.parallel import collectives as C
from mindtrain.parallel.context_parallel import apply_context_parallel, split_batch
from mindtrain.parallel.mesh import DeviceMesh, Group
from mindtrain.parallel.share import ModelShare
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


class PipelineSchedule(ModelShare):
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
        self.pp = mesh.group("pp")
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
        self._lay_out(model, plan, mesh, split_experts, dispatcher)
        apply_context_parallel(model, self.cp, seq_length, cp_method, ulysses_degree)
        self.chunks = [ModelStage(model, plan, self.virtual_parts[c * self.num_stages + self.stage_index])
                       for c in range(chunks)]
        self.stage = self.chunks[0]
        """This rank's first (without interleaving: only) chunk."""
        # the trimmed model this rank owns: the dense weights of all its chunks, each once
        named: dict[str, Any] = {}
        for ch in self.chunks:
            named.update((n, p) for n, p in zip(ch.param_names, ch.params) if n not in named)
        order = {n: i for i, n in enumerate(named)}
        self._chunk_index = [[order[n] for n in ch.param_names] for ch in self.chunks]
        self.last_timing: dict[str, float] = {}
        """``step_s`` (wall time of the last :meth:`step`) and ``busy_s`` (its stage compute)."""
        # Weights used on two stages (the embedding by the MTP modules): their gradients are
        # summed over the stages that hold them, so each holder updates them identically.
        tied, tied_names = self._tied_group(plan)
        mine = set(self.parts[self.stage_index])
        # this stage's routed-expert weights, owned by expert parallelism (not autograd leaves)
        experts = [n for u in self.parts[self.stage_index] for n in _unit_params(plan, u) if n in self.ep.slots]
        # the same layout as a ShardedLayout's, on the stage's weights; under ZeRO-3 the stage
        # gathers them once per step (no per-unit gathers), as torchtitan's FSDP + PP does
        self._own(list(named.values()), experts, dp_sharding, tied=tied, tied_names=tied_names,
                  # grad norm counts a tied weight once: on the stage that owns its unit
                  counted=[plan["params"][n]["unit"] in mine for n in named])
        # ZeRO-2/3: every micro-batch's gradients are reduced at once and only the shard kept
        self._shard_each = self.fsdp is not None and self.fsdp.strategy != "optim"
        self._grads: Optional[list[Tensor]] = None
        self._load: Optional[Tensor] = None

    # ---------------------------------------------------------------- setup
    def _tied_group(self, plan) -> tuple[Optional[Group], list[str]]:
        """The group of this rank's stage and the others holding a weight of its (the MTP
        modules' embedding), and those weights' names."""
        if self.num_stages == 1:
            return None, []
        holders: dict[str, list[int]] = {}
        for name, users in plan.get("shared", {}).items():
            stages = sorted({s for s, part in enumerate(self.parts) for u in users if u in part})
            if len(stages) > 1:
                holders[name] = stages
        groups = {tuple(v) for v in holders.values()}
        if len(groups) > 1:
            raise NotImplementedError(f"tied weights across different stage sets: {holders}")
        if not groups:
            return None, []
        stages = groups.pop()
        if self.stage_index not in stages:
            return None, []
        ranks = tuple(self.pp.ranks[s] for s in stages)
        if ranks == self.pp.ranks:
            return self.pp, list(holders)
        return Group("pp_tied", ranks, ranks.index(self.mesh.global_rank), C.new_group(ranks)), list(holders)

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
        if self.zero3:
            self.fsdp.gather_params()
        mbs = [self.split(b) for b in micro_batches]
        m = len(mbs)
        b, s_local = mbs[0]["input_ids"].shape
        # sequence parallelism: between layers each TP rank holds 1/tp of the local sequence
        act_shape = (b, s_local // self.tp.size, *self.stage.activation)
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
                grads = self.reduce_dense(grads)
            acc = grads if acc is None else [a + g for a, g in zip(acc, grads)]
        for work in pending:
            work.wait()
        if self.zero3:
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
        if self.zero3:
            self.fsdp.gather_params()
        try:
            mbs = [self.split(b) for b in batches]
            b, s_local = mbs[0]["input_ids"].shape
            act_shape = (b, s_local // self.tp.size, *self.stage.activation)
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
            if self.zero3:
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

    def _finish(self, acc, figures, load, m):
        # the dense gradients: reduced over dp x cp by the layout's one reduction (ZeRO-2/3 did
        # it per micro-batch), then tied and TP-replicated weights summed, expert ones appended
        grads = self.complete(acc if self._shard_each else self.reduce_dense(acc))
        # every chunk's figures are its share of a micro-batch: sum them, average over
        # micro-batches; CP shares add up, data-parallel ranks are averaged (load: summed)
        fig = ops.stack(figures).sum(0) / float(m)
        tail = C.all_reduce(ops.cat([fig, load.reshape(-1)]), self.mesh.group("dp_cp"))
        # figures and load: the stages' contributions are disjoint, so summing over pp collects them
        tail = C.all_reduce(tail, self.pp)
        # the stage packs its figures in METRICS order; from here on they travel by name
        inv_dp = 1.0 / self.dp.size
        figures = StepFigures.from_named(METRICS, (tail[:len(METRICS)].asnumpy().astype(np.float64) * inv_dp).tolist())
        n_load = int(np.prod(load.shape))
        return grads, figures, tail[len(METRICS):len(METRICS) + n_load].reshape(load.shape)

    def to_full(self, tensors: Sequence[Tensor]) -> dict[str, np.ndarray]:
        """Full arrays of every stage's tensors laid out like :attr:`params` (the weights
        themselves or optimizer moments), on every rank: each stage un-shards its own, then
        they are broadcast over ``pp`` stage by stage (collective over the mesh)."""
        mine = super().to_full(tensors)
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

    def finish_step(self) -> None:
        """After the optimizer updated :attr:`params`: with ZeRO-1/2 all-gather the updated
        shards into the stage's full weights (ZeRO-3 gathers them at the next step); drop
        the gradients."""
        super().finish_step()
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
