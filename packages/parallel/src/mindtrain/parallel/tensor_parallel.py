"""Tensor parallelism with sequence parallelism, applied to a model by module surgery.

Driven by the model's plan (plain data, see ``mindtrain.models.parallel_plan``): every
"column" weight keeps this rank's rows of its split dim, every "row" weight its columns,
the "vocab" embedding its vocabulary rows. Between the TP regions (attention, dense MLP,
MoE) the hidden states are split along the sequence (dim 1): norms, residuals, the router
and the MTP projections run on ``S / tp`` positions. Each region all-gathers its input
along the sequence and reduce-scatters its partial output back (and the reverse in the
backward). The embedding is vocab-parallel (masked lookup, reduce-scatter) and the head
computes vocab-parallel cross-entropy, so the full logits never exist on one rank: the
model's own head + loss cell runs, with its sequence-gather hook set and its per-token
cross-entropy component swapped for :class:`_VocabParallelCE`.

Every TP rank computes the same loss. Sharded parameters then get their exact gradient;
replicated ones get a partial gradient (their share of the sequence, or of the heads),
which :meth:`TensorParallel.sync_grads` sums over the TP group.

Order: ``apply_tensor_parallel`` -> ``apply_expert_parallel`` -> ``fully_shard`` (over the
mesh's ``dp`` group) -> optimizer on the resulting parameters.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

import mindspore as ms
from mindspore import Parameter, Tensor, nn, ops

from mindtrain.config import ConfigError
from mindtrain.config.plan import Region
from mindtrain.parallel import collectives as C
from mindtrain.parallel import functional as F
from mindtrain.parallel.layout import narrow_even, narrow_param, split_piece
from mindtrain.parallel.mesh import DeviceMesh, Group

SEQ_DIM = 1


def _divisible(value: int, tp: int, field: str) -> None:
    if value % tp:
        raise ConfigError(field, f"{value} is not divisible by parallelism.tensor_parallel={tp}; "
                                 f"choose a tensor_parallel degree that divides it")


def _cells(model: nn.Cell) -> dict[str, nn.Cell]:
    return dict(model.cells_and_names())


def _owner(cells: dict[str, nn.Cell], pname: str) -> tuple[nn.Cell, str]:
    path, _, attr = pname.rpartition(".")
    return cells[path], attr


def _override(cell: nn.Cell, fn) -> None:
    """Replace this instance's forward (parameter names and the class stay untouched)."""
    object.__setattr__(cell, "construct", fn)


def _shard(p: Parameter, dim: int, tp: int, index: int) -> None:
    narrow_param(p, dim, tp, index)


class _VocabParallelCE(nn.Cell):
    """Per-token cross-entropy of vocab-sharded logits ``[T, V/tp]`` against global labels.

    Forward: max and sum-exp over the vocabulary through the TP group. Backward: the local
    slice of ``softmax - one_hot`` (no communication beyond recomputing the two reductions).
    """

    def __init__(self, group: Group, start: int):
        super().__init__()
        self.comm_group, self.start = group, start

    def _stats(self, logits, labels):
        g = self.comm_group
        vl = logits.shape[-1]
        local_max = ops.stop_gradient(ops.amax(logits, -1))
        gmax = ops.amax(C.all_gather(ops.expand_dims(local_max, 0), g, 0), 0)
        shifted = logits - ops.expand_dims(gmax, -1)
        exp = ops.exp(shifted)
        sumexp = C.all_reduce(exp.sum(-1), g)
        local = labels - self.start
        inside = ops.logical_and(local >= 0, local < vl)
        safe = ops.select(inside, local, ops.zeros_like(local))
        return gmax, shifted, exp, sumexp, inside, safe

    def construct(self, logits, labels):
        gmax, shifted, _, sumexp, inside, safe = self._stats(logits, labels)
        picked = ops.gather_elements(shifted, 1, ops.expand_dims(safe, -1)).squeeze(-1)
        target = C.all_reduce(picked * inside.astype(logits.dtype), self.comm_group)
        return ops.log(sumexp) - target

    def bprop(self, logits, labels, out, dout):
        _, _, exp, sumexp, inside, safe = self._stats(logits, labels)
        vl = logits.shape[-1]
        onehot = ops.one_hot(safe, vl, Tensor(1.0, logits.dtype), Tensor(0.0, logits.dtype))
        onehot = onehot * ops.expand_dims(inside.astype(logits.dtype), -1)
        grad = (exp / ops.expand_dims(sumexp, -1) - onehot) * ops.expand_dims(dout, -1)
        return grad, ops.zeros_like(labels)


class TensorParallel:
    """What :func:`apply_tensor_parallel` did to a model, and the gradient rule it needs."""

    def __init__(self, model: nn.Cell, plan: dict, mesh: DeviceMesh, split_experts: bool = True):
        self.model = model
        self.plan = plan
        self.mesh = mesh
        self.group = mesh.group("tp")
        self.size = self.group.size
        self.index = self.group.index
        self.split_experts = split_experts
        """False (``expert_tensor_parallel: 1``): routed experts stay whole on every TP rank
        and each rank runs them on its own sequence shard."""

        def whole(p) -> bool:
            return p["tp"] == "replicated" or (p.get("expert", False) and not split_experts)

        self.replicated = {n for n, p in plan["params"].items() if whole(p)}
        self.sharded = {n: (p["tp"], p["tp_dim"]) for n, p in plan["params"].items() if not whole(p)}

    def sync_grads(self, names: Sequence[str], grads: Sequence[Tensor]) -> list[Tensor]:
        """Sum the partial gradients of replicated parameters over the TP group.

        ``names`` and ``grads`` are aligned (full gradients or FSDP shards: the sum is
        elementwise, so it commutes with the data-parallel reduction).
        """
        if self.size == 1:
            return list(grads)
        return [C.all_reduce(g, self.group) if n in self.replicated else g for n, g in zip(names, grads)]

    def replicas(self, name: str) -> int:
        """How many TP ranks hold the same (synced) gradient of parameter ``name``."""
        return self.size if name in self.replicated else 1

    def local_param(self, name: str, full: np.ndarray) -> np.ndarray:
        """This rank's piece of the full array of parameter ``name`` (no communication)."""
        if name not in self.sharded or self.size == 1:
            return np.asarray(full)
        return split_piece(full, self.sharded[name][1], self.size, self.index)

    def narrow(self, name: str, offset: list, shape: list) -> None:
        """Narrow the box ``offset``/``shape`` (full coordinates) to this rank's piece."""
        if name in self.sharded and self.size > 1:
            narrow_even(offset, shape, self.sharded[name][1], self.size, self.index)

    def full_param(self, name: str, local: np.ndarray) -> np.ndarray:
        """The unsharded value of parameter ``name`` from this rank's ``local`` array
        (a collective over the TP group: every member must call it for the same name)."""
        if name not in self.sharded or self.size == 1:
            return local
        dim = self.sharded[name][1]
        return C.all_gather(Tensor(np.ascontiguousarray(local)), self.group, dim).asnumpy()


def apply_tensor_parallel(model: nn.Cell, plan: dict, mesh: DeviceMesh, split_experts: bool = True) -> TensorParallel:
    """Shard ``model`` in place over ``mesh``'s TP group, with sequence parallelism.

    The plan's regions say which cells are what (``role``): "attention" cells have
    ``num_heads`` and ``o_proj``; "moe" cells ``gate`` (router returning ``(topk_idx, weights,
    scores)``), ``experts`` (``(x, idx, w) -> (y, counts)``) and ``shared_output(x)`` (None
    without shared experts); "mlp" cells run whole on the gathered sequence. The parameter
    roles "embedding" and "head" name the vocabulary-split weights. The model has a head
    cell with a ``sequence_gather`` hook and a loss cell with a ``token_loss`` component (the
    vocabulary-parallel loss is a component swap, see :func:`_vocab_parallel_loss`). A region
    may declare more (:class:`~mindtrain.config.plan.Region`): ``tp_counts`` (cell counts
    divided beside the heads, e.g. an output projection's groups), ``head_mask_arg`` (the
    forward argument holding a per-head mask, or None) and ``token_args`` (per-token tensors
    of the whole sequence after a MoE's hidden states, e.g. token ids for hash routing: the
    router gets this shard's part). Raises ConfigError when heads, a region's ``tp_counts``,
    intermediate sizes or the vocabulary do not divide by TP, or (at the first forward) the
    sequence length. A wrapped cell's forward (possibly compiled
    pieces) runs between the collectives.
    ``split_experts=False`` (MindFormers' ``expert_tensor_parallel: 1``): the routed experts
    are not split; each TP rank runs them whole on its own sequence shard (their gradients
    are summed over TP like any replicated weight's, their token counts too).
    Returns a :class:`TensorParallel`; a TP degree of 1 changes nothing.
    """
    tp = TensorParallel(model, plan, mesh, split_experts)
    if tp.size == 1:
        return tp
    size, index, group = tp.size, tp.index, tp.group
    cells = _cells(model)
    params = {p.name: p for p in model.get_parameters()}

    # 1. check every split before touching anything
    for name, info in plan["params"].items():
        if name not in tp.sharded:
            continue
        dim = info["tp_dim"]
        field = info.get("split_field") or {"vocab": "model.vocab_size"}.get(info["tp"], f"model ({name} dim {dim})")
        _divisible(info["shape"][dim], size, field)
    heads = plan.get("num_attention_heads")
    if heads is not None:
        _divisible(heads, size, "model.num_attention_heads")
    regions = _regions(plan, cells)
    for region in regions:  # the counts a region's split divides (e.g. an output projection's groups)
        for attr in region.get("tp_counts", ()):
            _divisible(getattr(cells[region.path], attr), size, f"model.{attr}")

    # 2. shard the weights; Linear cells learn their local output size
    vocab_start = {}
    for name, info in plan["params"].items():
        if name not in tp.sharded:
            continue
        p = params[name]
        _shard(p, info["tp_dim"], size, index)
        cell, attr = _owner(cells, name)
        if info["tp"] == "column" and attr == "weight" and hasattr(cell, "out_features"):
            cell.out_features = p.shape[0]
        if info["tp"] == "row" and attr == "weight" and hasattr(cell, "in_offset"):
            cell.in_offset = index * p.shape[1]  # its first global input feature (LoRA dropout's masks)
        if info["tp"] == "column" and info.get("expert") and hasattr(cell, "intermediate_size"):
            cell.intermediate_size = p.shape[info["tp_dim"]]  # stacked experts [E, I, H]
        if info["tp"] == "vocab" or (info["tp"] == "column" and info.get("role") == "head"):
            vocab_start[name] = index * p.shape[0]

    def sp_gather(x):
        return F.all_gather(x, group, SEQ_DIM)

    def sp_scatter(y):
        return F.reduce_scatter(y, group, SEQ_DIM)

    # 3. regions, by the plan's roles: attention, dense MLPs, MoE blocks (a MoE block's own
    # forward gathers for its shared experts, which the plan lists in no region of their own)
    for region in regions:
        cell, role = cells[region.path], region.role
        tokens = int(region.get("token_args", 0))
        if role == "moe":  # the cell: gate, experts, shared_output(x), sharded_balance(...)
            _override(cell, _moe_forward(cell, group, tokens) if split_experts
                      else _moe_forward_local(cell, group, tokens))
        elif role == "attention":
            cell.num_heads = cell.num_heads // size
            if hasattr(cell, "head_offset"):  # this rank's first global head (attention dropout's masks)
                cell.head_offset = index * cell.num_heads
            if hasattr(cell, "num_kv_heads"):  # grouped-query attention: its key/value heads split too
                cell.num_kv_heads = cell.num_kv_heads // size
            for attr in region.get("tp_counts", ()):  # e.g. the groups of a grouped output projection
                setattr(cell, attr, getattr(cell, attr) // size)
            _override(cell, _attention_forward(cell, sp_gather, sp_scatter, region.get("head_mask_arg", 2)))
        elif role == "mlp":
            _override(cell, _region_forward(cell, sp_gather, sp_scatter))

    dropout = getattr(model, "dropout", None)
    if dropout is not None and hasattr(dropout, "sequence_shard"):  # the hidden states' rows this rank holds
        dropout.sequence_shard = (index, size)

    # 4. vocab-parallel embedding (reduce-scatter to sequence shards) and head + loss
    emb_path = next((n for n, i in plan["params"].items() if i["tp"] == "vocab"), None)
    if emb_path is not None:
        emb, attr = _owner(cells, emb_path)
        _override(emb, _embedding_forward(emb, getattr(emb, attr), vocab_start[emb_path], group))
    head = next((n for n in vocab_start if plan["params"][n].get("role") == "head"), None)
    if head is None and emb_path is not None and "head" in plan.get("shared", {}).get(emb_path, ()):
        head = emb_path  # tied embeddings: the head multiplies by this rank's vocabulary rows
    if head is not None:
        _vocab_parallel_loss(cells, _VocabParallelCE(group, vocab_start[head]), sp_gather)
    return tp


def _regions(plan, cells: dict[str, nn.Cell]) -> list[Region]:
    """The plan's :class:`~mindtrain.config.plan.Region` list. A plan without regions (the
    earlier dict form) gets them from the cells' interfaces: attention cells have
    ``num_heads`` and ``o_proj``, MoE cells ``gate`` and ``experts`` (their sub-cells run
    inside their own forward), dense MLP cells ``gate_proj`` and ``down_proj``."""
    regions = plan.get("regions")
    if regions is not None:
        return [r if isinstance(r, Region) else Region(r["path"], r["role"]) for r in regions]
    out: list[Region] = []
    moe_paths: list[str] = []
    for path, cell in cells.items():
        if not path or any(path.startswith(m + ".") for m in moe_paths):
            continue
        if hasattr(cell, "gate") and hasattr(cell, "experts"):
            moe_paths.append(path)
            out.append(Region(path, "moe"))
        elif hasattr(cell, "num_heads") and hasattr(cell, "o_proj"):
            out.append(Region(path, "attention"))
        elif hasattr(cell, "down_proj") and hasattr(cell, "gate_proj") and not hasattr(cell, "n_experts"):
            out.append(Region(path, "mlp"))
    return out


def _vocab_parallel_loss(cells: dict[str, nn.Cell], ce: "_VocabParallelCE", sp_gather) -> None:
    """Swap the model's loss components for their TP versions; the model's head + loss
    code runs unchanged. Cells with a ``sequence_gather`` hook gather the sequence of the
    normed hidden states before the head (whose weight now holds this rank's vocabulary
    rows); cells with a ``token_loss`` component get the vocabulary-parallel cross-entropy."""
    gathers = [c for p, c in cells.items() if p and hasattr(c, "sequence_gather")]
    losses = [c for p, c in cells.items() if p and hasattr(c, "token_loss")]
    if not gathers or not losses:
        raise ValueError("apply_tensor_parallel: the model's head has no sequence_gather hook or no "
                         "token_loss component for the vocabulary-parallel loss")
    for cell in gathers:
        cell.sequence_gather = sp_gather
    for cell in losses:
        cell.token_loss = ce


def _check_seq(s: int, size: int) -> None:
    _divisible(s, size, "model.seq_length")


def _embedding_forward(cell, weight: Parameter, start: int, group: Group):
    size = group.size

    def construct(ids):
        _check_seq(ids.shape[-1], size)
        vl = weight.shape[0]
        local = ids.astype(ms.int32) - start
        inside = ops.logical_and(local >= 0, local < vl)
        safe = ops.select(inside, local, ops.zeros_like(local))
        e = ops.gather(weight, safe, 0) * ops.expand_dims(inside.astype(weight.dtype), -1)
        return F.reduce_scatter(e, group, SEQ_DIM)

    return construct


def _attention_forward(cell, sp_gather, sp_scatter, head_mask_arg=2):
    """The attention cell on the gathered sequence; its other arguments (rope tables, masks:
    the whole sequence's) pass through, the per-head mask at ``head_mask_arg`` (the region's,
    None: none) narrowed to this rank's heads."""
    inner = cell.construct  # the model's forward as found (it may run compiled pieces)

    def construct(x, *args):
        n = cell.num_heads
        if head_mask_arg is not None and len(args) > head_mask_arg and args[head_mask_arg].shape[1] > n:
            # the model builds one mask per head of the full model; every head has the same
            args = args[:head_mask_arg] + (args[head_mask_arg][:, :n],) + args[head_mask_arg + 1:]
        return sp_scatter(inner(sp_gather(x), *args))

    return construct


def _region_forward(cell, sp_gather, sp_scatter):
    inner = cell.construct  # the model's forward as found (compiled when the model compiles regions)

    def construct(x):
        return sp_scatter(inner(sp_gather(x)))

    return construct


def _local_tokens(tokens, group: Group, s_local: int) -> list:
    """This rank's sequence shard of per-token tensors [B, S] of the whole sequence."""
    start = group.index * s_local
    return [t[:, start:start + s_local] for t in tokens]


def _moe_forward(cell, group: Group, n_tokens: int = 0):
    """The MoE block on sequence shards: route local tokens, gather tokens and choices
    along the sequence, run the TP-sharded experts, reduce-scatter the partial output.
    The cell's balance term sums its statistics over the TP group (:func:`_balance`).
    ``n_tokens`` per-token tensors of the whole sequence follow the hidden states (the
    region's ``token_args``: e.g. token ids for hash routing); the router gets this shard's."""

    def construct(x, *tokens):
        b, s_local, h = x.shape
        flat = x.reshape(b * s_local, h)
        topk_idx, topk_weight, scores = cell.gate(flat, *_local_tokens(tokens[:n_tokens], group, s_local))
        k = topk_idx.shape[1]
        full_x = F.all_gather(x, group, SEQ_DIM)
        s = full_x.shape[1]
        idx_full = C.all_gather(topk_idx.reshape(b, s_local, k), group, SEQ_DIM).reshape(b * s, k)
        w_full = F.all_gather(topk_weight.reshape(b, s_local, k), group, SEQ_DIM).reshape(b * s, k)
        y, counts = cell.experts(full_x.reshape(b * s, h), idx_full, w_full)
        y = y.reshape(b, s, h)
        shared = cell.shared_output(full_x)
        if shared is not None:
            y = y + shared
        y = F.reduce_scatter(y, group, SEQ_DIM)
        return y, counts, _balance(cell, scores, topk_idx, counts, b, s, group)

    return construct


def _moe_forward_local(cell, group: Group, n_tokens: int = 0):
    """The MoE block with whole experts (``expert_tensor_parallel: 1``): route and run the
    experts on this rank's sequence shard; only the TP-split shared experts gather the
    sequence and reduce-scatter their partial output. The token counts are summed over TP
    (the whole sequence's, as with split experts). ``n_tokens``: as :func:`_moe_forward`'s."""

    def construct(x, *tokens):
        b, s_local, h = x.shape
        flat = x.reshape(b * s_local, h)
        topk_idx, topk_weight, scores = cell.gate(flat, *_local_tokens(tokens[:n_tokens], group, s_local))
        y, counts = cell.experts(flat, topk_idx, topk_weight)
        y = y.reshape(b, s_local, h)
        counts = C.all_reduce(counts.astype(ms.float32), group).astype(counts.dtype)
        if getattr(cell, "n_shared", True):
            shared = cell.shared_output(F.all_gather(x, group, SEQ_DIM))
            if shared is not None:
                y = y + F.reduce_scatter(shared, group, SEQ_DIM)
        return y, counts, _balance(cell, scores, topk_idx, counts, b, s_local * group.size, group)

    return construct


def _balance(cell, scores, topk_idx, counts, batch: int, seq: int, group: Group):
    """The MoE cell's balance term from this rank's sequence shard (the cell's own
    ``sharded_balance``: the model owns the formula, the layout gives it the sums over TP)."""
    return cell.sharded_balance(scores, topk_idx, counts, batch, seq,
                                lambda x: C.all_reduce(x, group), lambda x: F.reduce_from_group(x, group))


def param_bytes(model: nn.Cell) -> int:
    """Bytes of every parameter this rank holds in ``model``."""
    return int(sum(p.size * p.itemsize for p in model.get_parameters()))


__all__ = ["TensorParallel", "apply_tensor_parallel", "param_bytes"]
