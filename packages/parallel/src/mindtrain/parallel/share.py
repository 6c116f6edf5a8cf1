"""What one rank owns of a laid-out model, whatever runs its steps: :class:`ModelShare`.

A rank owns a set of dense weights (the whole model's, or a pipeline stage's: the same
layout applied to a trimmed model, as torchtitan composes FSDP with pipeline parallelism)
and its pieces of the routed experts. :class:`ModelShare` lays them out once:

- tensor (+ sequence) parallelism and expert parallelism, applied to the model;
- FSDP over ``dp`` (ZeRO-1/2/3, HSDP with ``dense_shard_size``) of exactly the dense
  weights this rank owns (``FSDP(params=...)``); ZeRO-3 units are the plan's decoder layers
  and MTP modules that the rank runs whole (a pipeline stage gathers its weights once per
  step instead: see :mod:`~mindtrain.parallel.pipeline_parallel`);
- the one reduction of a rank's dense gradients (summed over ``cp``, averaged over ``dp``,
  summed over ``tp`` for replicated weights and over the stages holding a tied weight);
- the one replica count (how many ranks hold the same piece of a gradient) behind the
  global gradient norm;
- the one way between this rank's pieces and full arrays (:meth:`to_full`, :meth:`to_local`,
  :meth:`gather_own`, :meth:`scatter_own`, :meth:`shards`, :meth:`load_params`).

:class:`~mindtrain.parallel.compose.ShardedLayout` and
:class:`~mindtrain.parallel.pipeline_parallel.PipelineSchedule` add only their step loop.
"""

from __future__ import annotations

import itertools
from typing import Any, Iterable, Mapping, Optional, Sequence

import numpy as np

import mindspore as ms
from mindspore import Tensor, ops

from mindtrain.config import ZERO3
from mindtrain.config.plan import ZERO3_BUCKET_BYTES, ZERO3_UNIT_KINDS
from mindtrain.parallel import collectives as C
from mindtrain.parallel.expert_parallel import apply_expert_parallel
from mindtrain.parallel.fsdp import FSDP, fully_shard
from mindtrain.parallel.layout import Shard, grad_norm, write_param
from mindtrain.parallel.mesh import DeviceMesh, Group
from mindtrain.parallel.tensor_parallel import apply_tensor_parallel


def zero3_units(model, plan) -> tuple[tuple[str, ...], dict[str, list[str]]]:
    """FSDP units = the plan's decoder layers and MTP modules, as cell paths; a parameter of
    a unit that the model also uses outside it (an MTP module's shared-head norm, applied
    by the head) stays gathered with the root and is *shared* with its unit: the unit's
    replayed backward must differentiate every weight the unit reads (measured: one it read
    but did not list made the gradients of the other weights through the same compiled
    norm graph zero)."""
    cells = dict(model.cells_and_names())
    units = tuple(u["path"] for u in plan["units"] if u["kind"] in ZERO3_UNIT_KINDS and u.get("path") in cells)
    path = {u["name"]: u.get("path") for u in plan["units"]}
    shared = {name: [path[p["unit"]]] if path.get(p["unit"]) in units else []
              for name, p in plan["params"].items() if p.get("applied_outside") and p["trainable"]}
    return units, shared


class ModelShare:
    """This rank's share of a model laid out over ``mesh``: build it with :meth:`_lay_out`
    (TP, EP) then :meth:`_own` (what the rank owns, FSDP, replica counts)."""

    named_params: list
    """``(name, tensor)`` the optimizer updates: the dense weights (their ``dp`` shards under
    FSDP, TP pieces), then this rank's expert weights."""

    def _lay_out(self, model, plan, mesh: DeviceMesh, split_experts: bool, dispatcher: str) -> None:
        """Tensor and expert parallelism on ``model`` (objects that change nothing at degree 1)."""
        self.model = model
        self.plan = plan
        self.mesh = mesh
        self.dp = mesh.group("dp")
        self.cp = mesh.group("cp")
        self.tp = apply_tensor_parallel(model, plan, mesh, split_experts)
        self.ep = apply_expert_parallel(model, plan, mesh, dispatcher, split_experts)
        self._shapes = {n: tuple(p["shape"]) for n, p in plan["params"].items()}

    def _own(self, dense: Sequence, expert_names: Sequence[str], strategy: Optional[str], *,
             units: Sequence[str] = (), shared: Optional[Mapping[str, Sequence[str]]] = None,
             reshard: bool = True, tied: Optional[Group] = None, tied_names: Sequence[str] = (),
             counted: Optional[Sequence[bool]] = None) -> None:
        """Own the dense parameters ``dense`` (Parameters, each once) and the routed-expert
        weights ``expert_names`` (held by expert parallelism). ``strategy``: the ZeRO strategy
        (FSDP over ``dp``), or None to keep the dense weights whole on every ``dp`` rank.
        ``units``/``shared``/``reshard``: ZeRO-3 units (see :func:`fully_shard`). ``tied``: the
        group of ranks holding the weights ``tied_names`` too (a tied weight's gradient is
        summed over it); ``counted``: per dense weight, whether the grad norm counts it here
        (a tied weight counts on one stage only)."""
        mesh = self.mesh
        dims = mesh.dims
        self.stage_params = list(dense)
        """The dense weights this rank runs (as the model holds them: gathered ones under FSDP)."""
        self.fsdp: Optional[FSDP] = None
        if strategy is not None and self.dp.size > 1:
            hsdp = {}
            if dims.dense_shard_size < self.dp.size:
                # HSDP: dense weights sharded within groups of dense_shard ranks, replicated across
                # them; routed experts (not split by EP) keep the whole data-parallel group
                names = {p.name for p in dense}
                experts = {n: "dp" for n, p in self.plan["params"].items() if p.get("expert") and n in names}
                hsdp = dict(dim="dense", replicate="dense_replica", param_groups=experts)
            self.fsdp = fully_shard(self.model, mesh, units=units, strategy=strategy, shared=shared,
                                    reshard_after_forward=reshard, params=self.stage_params,
                                    bucket_bytes=ZERO3_BUCKET_BYTES, **hsdp)
            self.named_dense = self.fsdp.named_parameters()
        else:
            self.named_dense = [(p.name, p) for p in self.stage_params]
        self.strategy = self.fsdp.strategy if self.fsdp is not None else None
        self.zero3 = self.strategy == ZERO3
        self.dense_names = [n for n, _ in self.named_dense]
        self.expert_names = list(expert_names)
        self.param_names = self.dense_names + self.expert_names
        self.named_params = list(self.named_dense) + [(n, self.ep.slots[n].param) for n in self.expert_names]
        self.params = [p for _, p in self.named_params]
        self._tied = tied if tied_names else None
        self._tied_idx = [i for i, n in enumerate(self.dense_names) if n in set(tied_names)]
        self._tp_idx = [i for i, n in enumerate(self.dense_names) if self.tp.replicas(n) > 1]
        # The one replica count: how many ranks hold the same piece of each gradient (each is
        # counted once in the norm). Dense: the CP ranks, the dp ranks unless FSDP shards it
        # (with HSDP, the replica groups), the TP ranks of a replicated weight; experts: EP's.
        replicas = []
        for name in self.dense_names:
            r = self.tp.replicas(name) * self.cp.size
            if self.fsdp is None:
                r *= self.dp.size
            elif self.fsdp.replicate is not None and self.fsdp.slots[name].group == self.fsdp.group:
                r *= self.fsdp.replicate.size
            replicas.append(r)
        replicas += [self.ep.replicas] * len(self.expert_names)
        counted = list(counted) if counted is not None else [True] * len(self.dense_names)
        self._counted = [i for i, c in enumerate(counted + [True] * len(self.expert_names)) if c]
        self._replicas = [replicas[i] for i in self._counted]

    # ------------------------------------------------------------------ gradients
    def reduce_dense(self, grads: Sequence[Tensor]) -> list[Tensor]:
        """This rank's local gradients of its dense weights (full, aligned with
        :attr:`stage_params`) summed over ``cp`` and averaged over ``dp``: FSDP's shards
        (reduce-scattered) or, without FSDP, the whole gradients (one all-reduce)."""
        grads = list(grads)
        if self.fsdp is None:
            if self.dp.size * self.cp.size == 1:
                return grads
            out = _sum_over(grads, range(len(grads)), self.mesh.group("dp_cp"))
            return [g / float(self.dp.size) for g in out] if self.dp.size > 1 else out
        if self.cp.size > 1:
            grads = _sum_over(grads, range(len(grads)), self.cp)
        return self.fsdp.reduce_scatter(grads)

    def complete(self, dense: Sequence[Tensor]) -> list[Tensor]:
        """Dense gradients reduced over ``dp`` (:meth:`reduce_dense` or FSDP's) made whole:
        tied weights summed over the stages holding them, replicated weights over ``tp``;
        then the expert gradients (their ``cp`` shares added up). Aligned with
        :attr:`named_params`."""
        grads = list(dense)
        if self._tied is not None and self._tied_idx:
            grads = _sum_over(grads, self._tied_idx, self._tied)
        if self.tp.size > 1 and self._tp_idx:
            # every TP rank computed a partial gradient of a replicated weight
            grads = _sum_over(grads, self._tp_idx, self.tp.group)
        # expert gradients come from expert parallelism averaged over dp x cp; CP shares add up
        cp = float(self.cp.size)
        for n in self.expert_names:
            g = self.ep.slots[n].grad
            g = ops.zeros(self.ep.slots[n].param.shape, ms.float32) if g is None else g
            grads.append(g * cp if cp > 1 else g)
        return grads

    def grad_norm(self, grads: Sequence[Tensor], only: Optional[Sequence[int]] = None) -> float:
        """Global L2 norm of the whole model's gradient (each piece counted once), from
        ``grads`` aligned with :attr:`named_params`, in float64 on the host; the same float
        on every rank. ``only``: of those parameters alone (indices into
        :attr:`named_params`, the same on every rank: LoRA's adapters)."""
        keep = set(only) if only is not None else None
        pairs = [(i, r) for i, r in zip(self._counted, self._replicas) if keep is None or i in keep]
        return grad_norm([grads[i] for i, _ in pairs], self.mesh.group("world"), [r for _, r in pairs])

    def finish_step(self) -> None:
        """After the optimizer updated :attr:`named_params`: with ZeRO-1/2 all-gather the
        updated shards into the full weights; drop the gradients."""
        if self.fsdp is not None:
            self.fsdp.finish_step()
        self.ep.zero_grad()

    # ------------------------------------------------------------------ full state
    def _tp_or_none(self):
        return self.tp if self.tp.size > 1 else None

    def to_full(self, tensors: Sequence[Tensor]) -> dict[str, np.ndarray]:
        """Full-shape arrays, keyed by name, of tensors laid out like :attr:`named_params`
        (the weights or optimizer moments): undo FSDP, TP and EP. A collective over the
        groups holding this rank's pieces."""
        return self._gather(list(zip(self.param_names, tensors)))

    def gather_own(self, named: Sequence[tuple[str, Tensor]]) -> dict[str, np.ndarray]:
        """See :meth:`mindtrain.parallel.layout.Layout.gather_own`."""
        return self._gather(list(named))

    def _gather(self, named: list) -> dict[str, np.ndarray]:
        experts = set(self.expert_names)
        dense = [(n, t) for n, t in named if n not in experts]
        if self.fsdp is not None and dense:
            arrays = self.fsdp.gather_full([t for _, t in dense], [n for n, _ in dense])
        else:
            arrays = [t.asnumpy().copy() for _, t in dense]
        tp = self._tp_or_none()
        out = {n: (tp.full_param(n, a) if tp is not None else a) for (n, _), a in zip(dense, arrays)}
        for n, t in named:
            if n in experts:
                out[n] = self.ep.full_value(n, t)
        return {n: out[n] for n, _ in named}

    def to_local(self, full: Mapping[str, Any]) -> list[Tensor]:
        """This rank's pieces of full-shape arrays, aligned with :attr:`named_params` (the
        inverse of :meth:`to_full`, no communication)."""
        return self.scatter_own({n: full[n] for n in self.param_names})

    def scatter_own(self, full: Mapping[str, Any]) -> list[Tensor]:
        """See :meth:`mindtrain.parallel.layout.Layout.scatter_own`."""
        experts = set(self.expert_names)
        names = list(full)
        dense = [n for n in names if n not in experts]
        tp = self._tp_or_none()
        arrays = [tp.local_param(n, full[n]) if tp is not None else np.asarray(full[n]) for n in dense]
        if self.fsdp is not None and dense:
            local = dict(zip(dense, self.fsdp.shard_full(arrays, dense)))
        else:
            local = {n: Tensor(np.ascontiguousarray(a)) for n, a in zip(dense, arrays)}
        for n in names:
            if n in experts:
                local[n] = Tensor(self.ep.local_value(n, full[n]))
        return [local[n] for n in names]

    def shards(self) -> list[Shard]:
        """Where each of :attr:`named_params` sits in its full array (no communication): the
        TP split, then FSDP's dim-0 shard of the TP piece; for expert weights EP's narrowing."""
        tp = self._tp_or_none()
        out = []
        for name in self.param_names:
            full = self._shapes[name]
            offset, shape = [0] * len(full), list(full)
            if name in self.expert_names:
                self.ep.narrow(name, offset, shape)
            else:
                if tp is not None:
                    tp.narrow(name, offset, shape)
                if self.fsdp is not None:
                    self.fsdp.narrow(name, offset, shape)
            out.append(Shard(name, tuple(full), tuple(offset), tuple(shape)))
        return out

    def load_params(self, pieces: Iterable[np.ndarray]) -> None:
        """Write this rank's pieces (aligned with :attr:`named_params`, each of its tensor's
        shape; an iterator is consumed one piece at a time) into the weights: FSDP's shards
        (then its gathered copies), the others in place or, without storage yet, as their
        first storage."""
        pieces = iter(pieces)
        n = len(self.dense_names)
        dense = itertools.islice(pieces, n)
        if self.fsdp is not None:
            self.fsdp.load_shards(dense, self.dense_names)
        else:
            for (_, p), a in zip(self.named_dense, dense):
                write_param(p, a)
        for (_, p), a in zip(self.named_params[n:], pieces):
            write_param(p, a)

    def memory_bytes(self) -> int:
        """Bytes of parameters resident on this rank between steps: FSDP shards plus the full
        weights kept gathered (ZeRO-1/2 keep all of them, ZeRO-3 none), TP / EP pieces."""
        experts = self.ep.param_bytes(self.expert_names)
        if self.fsdp is not None:
            return int(self.fsdp.memory_bytes()["params"] + experts)
        return int(sum(p.size * p.itemsize for p in self.stage_params) + experts)

    def ep_sent_bytes(self) -> int:
        """See :meth:`mindtrain.parallel.layout.Layout.ep_sent_bytes`."""
        return int(self.ep.sent_bytes)


def _sum_over(grads: list, idx: Iterable[int], group: Group) -> list:
    """``grads`` with the entries ``idx`` summed over ``group`` (one all-reduce)."""
    idx = list(idx)
    sizes = [int(np.prod(grads[i].shape)) for i in idx]
    total = C.all_reduce(ops.cat([grads[i].reshape(-1) for i in idx]), group)
    out = list(grads)
    for i, t in zip(idx, ops.split(total, sizes)):
        out[i] = t.reshape(grads[i].shape)
    return out


__all__ = ["ModelShare", "zero3_units"]
