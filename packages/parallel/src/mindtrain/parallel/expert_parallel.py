"""Expert parallelism: routed experts split over the mesh's ``ep`` group, tokens moved by
all-to-all with unequal splits, expert weights sharded over the ``edp`` group.

Each EP rank holds ``E / ep`` consecutive experts. A MoE forward sorts its (token, choice)
pairs by expert, sends each pair's token row to the rank that holds the expert (all-to-all
with the per-rank counts), runs the local experts, sends the outputs back by the reverse
all-to-all and combines them with the router weights. The router, shared experts and the
balance loss stay on the routing rank; the per-expert token counts are the routing rank's
own, so :func:`global_expert_load` (a sum over the data-parallel ranks) gives the
single-process counts for the aux-loss-free bias update.

Expert weights are owned here, not by autograd or FSDP: they are marked
``requires_grad=False`` so neither ``ms.value_and_grad(model.trainable_params())`` nor
``fully_shard`` touches them, and the local-experts step has a custom backward that
computes their gradients, reduce-scatters them over the expert-data-parallel group
(``edp``: the ranks with the same experts) and keeps the shard. With ``edp`` > 1 only
``1 / edp`` of the local experts stays resident; the step all-gathers them for its
forward and backward (ZeRO-3 over edp). Gradients are scaled like FSDP's ``avg``: the
mean over the dp x cp ranks of each rank's (already micro-batch-scaled) loss.

With tensor parallelism as well (``tp`` > 1) the experts keep TP's split of their
intermediate dimension (expert tensor parallelism equal to TP, as Megatron-Core's
default): the MoE region all-gathers its tokens over TP, every TP rank dispatches them
over its own EP group (same TP index), runs its slice of each local expert and the region's
reduce-scatter sums the partial outputs. Expert weights are then split three ways: experts
over ``ep``, their rows over ``edp`` and their intermediate dimension over ``tp``.

Order: ``apply_tensor_parallel`` -> ``apply_expert_parallel`` -> ``fully_shard`` (over
``dp``) -> the optimizer on ``fsdp.named_parameters() + ep.named_parameters()``; each
step add ``ep.grads`` to the FSDP gradients and call ``ep.zero_grad()`` after the update.
"""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np

import mindspore as ms
from mindspore import Parameter, Tensor, nn, ops

from mindtrain.config import ConfigError
from mindtrain.parallel import collectives as C
from mindtrain.parallel import functional as F
from mindtrain.parallel.layout import narrow_even, narrow_param, split_piece
from mindtrain.parallel.mesh import DeviceMesh, Group

_WEIGHTS = ("gate_proj", "up_proj", "down_proj")


class _ExpertSlot:
    """One stacked expert weight of one MoE layer: the module Parameter holds this rank's
    shard; ``grad`` accumulates its gradient shard."""

    def __init__(self, name: str, param: Parameter, local_experts: int, tp_dim: Optional[int] = None):
        self.name = name
        self.param = param
        self.local_experts = local_experts
        self.tp_dim = tp_dim  # the dim tensor parallelism split (None: not split)
        self.grad: Optional[Tensor] = None


class _LocalExperts(nn.Cell):
    """Runs this rank's experts on received rows; the backward computes the weight
    gradients itself (they are not autograd leaves) and returns the rows' gradient."""

    def __init__(self, owner: "ExpertParallel", slots: list[_ExpertSlot], activation=None):
        super().__init__()
        # a list keeps the Parameters out of this Cell; the experts cell's gated activation
        # (its ``activation(gate, up)``, e.g. a clamped SwiGLU), or silu(gate) * up
        self._ctx = [owner, slots, activation or _silu_gate]

    def construct(self, rows, ids):
        owner, slots, act = self._ctx
        w = owner.full_weights(slots)
        return _ffn(rows, ids.asnumpy(), *w, act)

    def bprop(self, rows, ids, out, dout):
        owner, slots, act = self._ctx
        w = owner.full_weights(slots)
        ids_np = ids.asnumpy()

        def replay(r, g, u, d):
            return (_ffn(r, ids_np, g, u, d, act) * dout).sum()

        grads = ms.grad(replay, grad_position=(0, 1, 2, 3))(rows, *w)
        owner.accumulate(slots, grads[1:])
        return grads[0], ops.zeros_like(ids)


def _silu_gate(gate, up):
    return ops.silu(gate) * up


def _ffn(rows, ids_np: np.ndarray, gate, up, down, act=_silu_gate):
    """The gated FFN (``act(gate, up)``: SwiGLU by default) of each row with its local expert
    ``ids_np[i]``: rows sorted by expert, one matmul chain per expert, then put back in order."""
    n, h = rows.shape
    if n == 0:
        return rows * 0
    e_local = gate.shape[0]
    perm = np.argsort(ids_np, kind="stable").astype(np.int32)
    counts = np.bincount(ids_np, minlength=e_local)
    xs = ops.gather(rows, Tensor(perm), 0)
    outs, off = [], 0
    for e in range(e_local):
        c = int(counts[e])
        if not c:
            continue
        xe = xs[off:off + c]
        off += c
        g = ops.matmul(xe, gate[e].T)
        u = ops.matmul(xe, up[e].T)
        outs.append(ops.matmul(act(g, u), down[e].T))
    y = ops.concat(outs, 0) if len(outs) > 1 else outs[0]
    inv = np.empty_like(perm)
    inv[perm] = np.arange(n, dtype=np.int32)
    return ops.gather(y, Tensor(inv), 0)


class ExpertParallel:
    """Expert weights split over ``ep`` and sharded over ``edp``; see the module docstring."""

    def __init__(self, mesh: DeviceMesh, n_experts: int):
        self.mesh = mesh
        self.ep_group = mesh.group("ep")
        self.edp_group = mesh.group("edp")
        # when the local experts do not divide over edp they stay whole on every edp rank,
        # replicated; their gradients are then summed over this group instead
        self.edp_replicas: Group = Group("edp", (mesh.global_rank,), 0, None)
        self.tp_group = mesh.group("tp")
        self.dp_size = mesh.size("dp_cp")
        self.n_experts = n_experts
        self.local_experts = n_experts // self.ep_group.size
        self.first_expert = self.ep_group.index * self.local_experts
        self.slots: dict[str, _ExpertSlot] = {}
        self.tp_whole = False
        """The experts are whole on every TP rank (``expert_tensor_parallel: 1``), each TP rank
        dispatching its own sequence shard: their gradients are summed over TP."""
        self.sent_bytes = 0
        """Bytes this rank sent to the other EP ranks in dispatch and combine (forward), so far."""

    # ---- optimizer-facing API ---------------------------------------------------------------
    @property
    def params(self) -> list[Parameter]:
        """This rank's expert weight shards (the module Parameters themselves)."""
        return [s.param for s in self.slots.values()]

    def named_parameters(self) -> list[tuple[str, Parameter]]:
        return [(n, s.param) for n, s in self.slots.items()]

    @property
    def grads(self) -> list[Tensor]:
        """Gradient shards aligned with :attr:`params` (zeros before any backward)."""
        return [s.grad if s.grad is not None else ops.zeros(s.param.shape, s.param.dtype)
                for s in self.slots.values()]

    def zero_grad(self) -> None:
        for s in self.slots.values():
            s.grad = None

    @property
    def replicas(self) -> int:
        """How many ranks hold the same expert gradient (local experts that do not divide
        over ``edp`` stay whole on every ``edp`` rank; whole experts on every TP rank)."""
        return self.edp_replicas.size * (self.tp_group.size if self.tp_whole else 1)

    def param_bytes(self, names: Optional[Sequence[str]] = None) -> int:
        """Bytes of this rank's pieces of the expert weights ``names`` (default: all)."""
        names = list(self.slots) if names is None else names
        return int(sum(self.slots[n].param.size * self.slots[n].param.itemsize for n in names))

    def full_value(self, name: str, local: Tensor) -> np.ndarray:
        """The full ``[E, ...]`` array of expert weight ``name`` from this rank's piece
        ``local`` (the weight itself or a tensor laid out like it, e.g. an optimizer
        moment). A collective over edp, ep and tp: every member calls it for the same name."""
        s = self.slots[name]
        t = C.all_gather(local, self.edp_group) if self.edp_group.size > 1 else local
        t = C.all_gather(t, self.ep_group)
        if s.tp_dim is not None:
            t = C.all_gather(t, self.tp_group, s.tp_dim)
        return t.asnumpy()

    def local_value(self, name: str, full: np.ndarray) -> np.ndarray:
        """This rank's piece of the full array of expert weight ``name`` (no communication)."""
        s = self.slots[name]
        a = np.asarray(full)
        if s.tp_dim is not None:
            a = split_piece(a, s.tp_dim, self.tp_group.size, self.tp_group.index)
        a = a[self.first_expert:self.first_expert + self.local_experts]
        if self.edp_group.size > 1:
            n = self.local_experts // self.edp_group.size
            a = a[self.edp_group.index * n:(self.edp_group.index + 1) * n]
        return np.ascontiguousarray(a)

    def narrow(self, name: str, offset: list, shape: list) -> None:
        """Narrow the box of expert weight ``name`` (full ``[E, ...]`` coordinates) to this
        rank's piece: its TP split, its experts, their ``edp`` rows (as :meth:`local_value`)."""
        s = self.slots[name]
        if s.tp_dim is not None:
            narrow_even(offset, shape, s.tp_dim, self.tp_group.size, self.tp_group.index)
        offset[0] += self.first_expert
        shape[0] = self.local_experts
        if self.edp_group.size > 1:
            narrow_even(offset, shape, 0, self.edp_group.size, self.edp_group.index)

    def full_state(self) -> dict[str, np.ndarray]:
        """Every expert weight at its full ``[E, ...]`` shape (collective over ep, edp, tp)."""
        return {name: self.full_value(name, s.param) for name, s in self.slots.items()}

    def memory_bytes(self) -> int:
        return self.param_bytes()

    # ---- used by the local-experts step ---------------------------------------------------
    def full_weights(self, slots: list[_ExpertSlot]) -> list[Tensor]:
        if self.edp_group.size == 1:
            return [C.fresh(s.param) for s in slots]
        return [C.all_gather(s.param, self.edp_group) for s in slots]

    def accumulate(self, slots: list[_ExpertSlot], grads: Sequence[Tensor]) -> None:
        for s, g in zip(slots, grads):
            if self.tp_whole:  # each TP rank ran its own tokens through the same experts
                g = C.all_reduce(g, self.tp_group)
            if self.edp_group.size > 1:
                g = C.reduce_scatter(g, self.edp_group)
            elif self.edp_replicas.size > 1:
                g = C.all_reduce(g, self.edp_replicas)
            g = g / self.dp_size
            s.grad = g if s.grad is None else s.grad + g


def global_expert_load(load: Tensor, mesh: DeviceMesh) -> Tensor:
    """Tokens per expert summed over the data-parallel ranks (dp x cp): what one process
    with the whole global batch would count. Use it before ``model.update_expert_bias``."""
    return C.all_reduce(load.astype(ms.float32), mesh.group("dp_cp"))


def apply_expert_parallel(model: nn.Cell, plan: dict, mesh: DeviceMesh, dispatcher: str = "alltoall",
                          split_experts: bool = True) -> ExpertParallel:
    """Keep this rank's experts of every MoE layer and route tokens to the others by
    all-to-all. Duck-typed: the plan flags expert weights (``expert``: True, stacked on dim
    0); their Cell has ``gate_proj``, ``up_proj``, ``down_proj`` and is called as
    ``experts(x [T, H], topk_idx [T, K], topk_weight [T, K]) -> (y [T, H], counts [E])``;
    its ``activation(gate, up)`` (when it has one: e.g. a clamped SwiGLU) is the gated
    activation the local experts run, else ``silu(gate) * up``.

    ``dispatcher`` (``parallelism.moe_token_dispatcher_type``): "alltoall" sends one row per
    (token, chosen expert) and weights the returned outputs on the sending rank;
    "alltoall_deredundancy" sends each token once to each rank holding any of its experts,
    with its local expert ids and routing weights, and that rank returns one row: the
    weighted sum of its experts' outputs (the same result, fewer rows each way;
    :attr:`ExpertParallel.sent_bytes` counts both).

    ``split_experts=False`` (``expert_tensor_parallel: 1`` under TP): the experts stay whole on
    every TP rank (no TP split); each TP rank dispatches the tokens of its own sequence shard
    over its EP group, and the experts' gradients are summed over TP.

    Raises ConfigError when ``n_routed_experts`` does not divide by ``expert_parallel``.
    With EP of 1 the experts stay as they are (FSDP shards them with the rest; the
    returned object holds none). After ``apply_tensor_parallel`` the experts keep their
    TP split (see the module docstring).
    """
    n_experts = int(plan.get("num_experts") or 0)
    ep = ExpertParallel(mesh, max(n_experts, 1))
    if mesh.size("ep") == 1 or not n_experts:
        return ep
    n_ep = mesh.size("ep")
    if n_experts % n_ep:
        raise ConfigError("model.n_routed_experts", f"{n_experts} is not divisible by "
                          f"parallelism.expert_parallel={n_ep}; choose a degree that divides it")
    ep.tp_whole = not split_experts and mesh.size("tp") > 1
    n_edp = mesh.size("edp")
    shard_edp = ep.local_experts % n_edp == 0
    if not shard_edp:
        ep.edp_replicas = ep.edp_group
        ep.edp_group = Group("edp", (mesh.global_rank,), 0, None)  # keep whole local experts
    cells = dict(model.cells_and_names())
    params = {p.name: p for p in model.get_parameters()}
    by_cell: dict[str, list[str]] = {}
    for name, info in plan["params"].items():
        if info.get("expert"):
            path, _, attr = name.rpartition(".")
            by_cell.setdefault(path, []).append(name)
    for path, names in by_cell.items():
        cell = cells[path]
        slots = []
        for attr in _WEIGHTS:
            name = f"{path}.{attr}"
            p = params[name]
            narrow_param(p, 0, ep.ep_group.size, ep.ep_group.index)  # this rank's experts
            if ep.edp_group.size > 1:  # their rows over edp
                narrow_param(p, 0, ep.edp_group.size, ep.edp_group.index)
            p.requires_grad = False
            info = plan["params"][name]
            split = split_experts and mesh.size("tp") > 1 and info.get("tp", "replicated") != "replicated"
            slot = _ExpertSlot(name, p, ep.local_experts, info["tp_dim"] if split else None)
            ep.slots[name] = slot
            slots.append(slot)
        forward = _dedup_dispatch_forward if dispatcher == "alltoall_deredundancy" else _dispatch_forward
        local = _LocalExperts(ep, slots, getattr(cell, "activation", None))
        object.__setattr__(cell, "construct", forward(ep, local))
    return ep


def _dispatch_forward(ep: ExpertParallel, local: "_LocalExperts"):
    group = ep.ep_group
    n_experts, per_rank = ep.n_experts, ep.local_experts

    def construct(x, topk_idx, topk_weight):
        t, h = x.shape
        k = topk_idx.shape[1]
        flat_e = topk_idx.reshape(-1).asnumpy().astype(np.int64)
        order = np.argsort(flat_e, kind="stable").astype(np.int32)
        dest = flat_e[order] // per_rank
        send = np.bincount(dest, minlength=group.size).astype(np.int64)
        table = C.all_gather(Tensor(send.reshape(1, -1)), group).asnumpy()
        recv = table[:, group.index]
        rows = ops.gather(x, Tensor(order // k), 0)
        ids = Tensor((flat_e[order] - dest * per_rank).astype(np.int32))
        got_rows = F.all_to_all(rows, group, send.tolist(), recv.tolist())
        got_ids = C.all_to_all(ids, group, send.tolist(), recv.tolist())
        out = local(got_rows, got_ids)
        back = F.all_to_all(out, group, recv.tolist(), send.tolist())
        away = int(send.sum() - send[group.index])
        ep.sent_bytes += away * (h * rows.itemsize + 4) + int(recv.sum() - recv[group.index]) * h * out.itemsize
        inv = np.empty_like(order)
        inv[order] = np.arange(order.size, dtype=np.int32)
        pairs = ops.gather(back, Tensor(inv), 0).reshape(t, k, h)
        y = (pairs * ops.expand_dims(topk_weight, -1)).sum(1)
        counts = Tensor(np.bincount(flat_e, minlength=n_experts).astype(np.int32))
        return y, counts

    return construct


def _dedup_dispatch_forward(ep: ExpertParallel, local: "_LocalExperts"):
    """``alltoall_deredundancy``: one row per (token, destination rank) instead of one per
    (token, chosen expert). The row travels with its K slots' local expert ids (-1 where the
    choice lives elsewhere) and routing weights; the receiving rank runs each valid slot
    through its expert, weights and sums them per row, and returns that one row; the sender
    adds up its rows from every rank. The routing weights' gradient comes back through the
    weights' all-to-all."""
    group = ep.ep_group
    n_experts, per_rank = ep.n_experts, ep.local_experts

    def construct(x, topk_idx, topk_weight):
        t, h = x.shape
        idx = topk_idx.asnumpy().astype(np.int64)                       # [T, K]
        dest = idx // per_rank
        need = np.zeros((group.size, t), bool)
        need[dest, np.arange(t)[:, None]] = True
        pair_rank, pair_token = np.nonzero(need)                        # by rank, then token
        send = np.bincount(pair_rank, minlength=group.size).astype(np.int64)
        table = C.all_gather(Tensor(send.reshape(1, -1)), group).asnumpy()
        recv = table[:, group.index]
        here = dest[pair_token] == pair_rank[:, None]                   # [P, K]: the slot's expert is there
        slot_ids = np.where(here, idx[pair_token] - pair_rank[:, None] * per_rank, -1).astype(np.int32)
        tokens = Tensor(pair_token.astype(np.int32))
        rows = ops.gather(x, tokens, 0)
        weights = ops.gather(topk_weight, tokens, 0) * Tensor(here.astype(np.float32)).astype(topk_weight.dtype)
        s, r = send.tolist(), recv.tolist()
        got_rows = F.all_to_all(rows, group, s, r)
        got_ids = C.all_to_all(Tensor(slot_ids), group, s, r).asnumpy()
        got_w = F.all_to_all(weights, group, s, r)
        row_of, slot_of = np.nonzero(got_ids >= 0)                      # every (row, valid slot)
        n_rows = int(recv.sum())
        out = local(ops.gather(got_rows, Tensor(row_of.astype(np.int32)), 0),
                    Tensor(got_ids[row_of, slot_of].astype(np.int32)))
        w = ops.gather(got_w.reshape(-1), Tensor((row_of * idx.shape[1] + slot_of).astype(np.int32)), 0)
        combined = ops.unsorted_segment_sum(out * ops.expand_dims(w.astype(out.dtype), -1),
                                            Tensor(row_of.astype(np.int32)), n_rows)
        back = F.all_to_all(combined, group, r, s)
        y = ops.unsorted_segment_sum(back, tokens, t)
        away = int(send.sum() - send[group.index])
        ep.sent_bytes += away * (h * rows.itemsize + idx.shape[1] * 8) + \
            int(recv.sum() - recv[group.index]) * h * combined.itemsize
        counts = Tensor(np.bincount(idx.reshape(-1), minlength=n_experts).astype(np.int32))
        return y, counts

    return construct


__all__ = ["ExpertParallel", "apply_expert_parallel", "global_expert_load"]
