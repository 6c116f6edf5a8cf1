"""Pipeline parallelism (1F1B and GPipe) with context parallelism inside each stage.

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
neighbours never wait on each other's sends. The CPU backend has no batched send/recv, and
:mod:`mindtrain.parallel.collectives` only has a blocking send, hence :func:`_isend` here.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional, Sequence

import time

import numpy as np

import mindspore as ms
from mindspore import Tensor, ops

from mindtrain.parallel import collectives as C
from mindtrain.parallel.context_parallel import apply_context_parallel, split_batch
from mindtrain.parallel.mesh import DeviceMesh, Group
from mindtrain.parallel.pipeline_schedule import stage_ops
from mindtrain.parallel.pipeline_stage import METRICS, ModelStage, partition_units


def _isend(x: Tensor, dst: int, group: Group):
    """Start sending ``x`` to member ``dst``; returns what must be kept until ``wait``."""
    import mindspore.mint.distributed as dist

    buf = C.fresh(x)
    work = dist.isend(buf, dst=group.global_rank(dst), group=group.name)
    return work, buf


class PipelineSchedule:
    """Runs one optimizer step's micro-batches through this rank's stage.

    ``model`` is the whole model (same initial weights on every rank), ``plan`` its
    parallel plan, ``mesh`` the initialised :class:`DeviceMesh` (its ``pp`` and ``cp``
    groups are used; with ``pp == cp == 1`` this is plain gradient accumulation).
    """

    def __init__(self, model, plan: Mapping[str, Any], mesh: DeviceMesh, seq_length: int,
                 schedule: str = "1f1b", layers_per_stage: Optional[Sequence[int]] = None):
        self.model = model
        self.mesh = mesh
        self.pp = mesh.group("pp")
        self.cp = mesh.group("cp")
        self.seq_length = seq_length
        self.schedule = schedule
        self.parts = partition_units(plan["units"], self.pp.size, layers_per_stage)
        self.stage_index = self.pp.index
        self.num_stages = self.pp.size
        # stages run eager: the separate no-grad forward and the CP hooks do not compile
        if getattr(model, "jit_enabled", False):
            model.set_jit(False)
        apply_context_parallel(model, self.cp, seq_length)
        self.stage = ModelStage(model, plan, self.parts[self.stage_index])
        self.last_timing: dict[str, float] = {}
        """``step_s`` (wall time of the last :meth:`step`) and ``busy_s`` (its stage compute)."""
        self.param_names = self.stage.param_names
        self.params = self.stage.params
        # Weights used on two stages (the embedding by the MTP modules): their gradients are
        # summed over the stages that hold them, so each holder updates them identically.
        self._tied = self._tied_group(plan)
        mine = set(self.parts[self.stage_index])
        # grad norm counts a tied weight once: on the stage that owns its unit
        self._norm_mask = [plan["params"][n]["unit"] in mine for n in self.param_names]
        self._tied_idx = [i for i, n in enumerate(self.param_names) if n in self._tied_names]

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
        return split_batch(batch, self.cp.size, self.cp.index, self.stage.num_heads, len(self.stage.mtp_ids)
                           if self.stage.is_last else 0)

    def step(self, micro_batches: Sequence[Mapping[str, Any]]):
        """Forward and backward of every micro-batch.

        Returns ``(grads, figures, load)``: ``grads`` for :attr:`params` summed over the
        micro-batches, the CP group and the stages sharing a weight; ``figures`` the
        float64 array of :data:`METRICS` averaged over micro-batches, each the
        single-process value (summed over stages and CP ranks, on every rank);
        ``load`` the [n_moe_layers, E] tokens per expert of all stages, summed over
        micro-batches and the CP group. Data-parallel reduction is left to the caller.
        """
        start = time.perf_counter()
        busy = 0.0
        mbs = [self.split(b) for b in micro_batches]
        m = len(mbs)
        st = self.stage
        first, last = st.is_first, st.is_last
        b, s_local = mbs[0]["input_ids"].shape
        act_shape = (b, s_local, st.hidden_size)
        inputs: dict[int, Optional[Tensor]] = {}
        pending = []
        acc: Optional[list[Tensor]] = None
        figures = []
        load = None
        me = self.stage_index
        for kind, i in stage_ops(self.schedule, self.num_stages, me, m):
            if kind == "F":
                h = None if first else C.recv(act_shape, ms.float32, me - 1, self.pp)
                inputs[i] = h
                if not last:
                    t = time.perf_counter()
                    out = st.forward_only(h, mbs[i])
                    out.asnumpy()  # the CPU runs ops asynchronously; wait so the time is the compute
                    busy += time.perf_counter() - t
                    pending.append(_isend(out, me + 1, self.pp))
                continue
            sens = None if last else C.recv(act_shape, ms.float32, me + 1, self.pp)
            t = time.perf_counter()
            gh, grads, fig, count = st.backward(inputs.pop(i), sens, mbs[i])
            fig.asnumpy()
            busy += time.perf_counter() - t
            if not first:
                pending.append(_isend(gh, me - 1, self.pp))
            acc = grads if acc is None else [a + g for a, g in zip(acc, grads)]
            figures.append(fig)
            rows = st.load_rows(count)
            load = rows if load is None else load + rows
        for work, _ in pending:
            work.wait()
        result = self._finish(acc, figures, load, m)
        self.last_timing = {"step_s": time.perf_counter() - start, "busy_s": busy}
        return result

    def _finish(self, acc, figures, load, m):
        sizes = [int(np.prod(g.shape)) for g in acc]
        fig = ops.stack(figures).mean(0)
        n_load = int(np.prod(load.shape))
        # one all-reduce over CP carries gradient shares, figures and expert load
        flat = ops.cat([g.reshape(-1) for g in acc] + [fig, load.reshape(-1)])
        flat = C.all_reduce(flat, self.cp)
        n = sum(sizes)
        grads = [g.reshape(a.shape) for g, a in zip(ops.split(flat[:n], sizes), acc)] if acc else []
        tail = flat[n:]
        if self._tied is not None and self._tied_idx:
            tied = C.all_reduce(ops.cat([grads[i].reshape(-1) for i in self._tied_idx]), self._tied)
            parts = ops.split(tied, [sizes[i] for i in self._tied_idx])
            for i, t in zip(self._tied_idx, parts):
                grads[i] = t.reshape(acc[i].shape)
        # figures and load: the stages' contributions are disjoint, so summing over pp collects them
        tail = C.all_reduce(tail, self.pp)
        figures = tail[:len(METRICS)].asnumpy().astype(np.float64)
        load = tail[len(METRICS):len(METRICS) + n_load].reshape(load.shape)
        return grads, figures, load

    def grad_norm(self, grads: Sequence[Tensor]) -> float:
        """Global L2 norm of the whole model's gradient (each weight counted once)."""
        sq = ops.zeros((1,), ms.float32)
        for g, keep in zip(grads, self._norm_mask):
            if keep:
                sq = sq + (g * g).sum()
        sq = C.all_reduce(sq, self.pp)
        return float(np.sqrt(sq.asnumpy()[0]))
