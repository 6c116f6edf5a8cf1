"""Context parallelism: each sequence split over the CP group in load-balanced causal chunks.

The sequence is cut into ``2 * cp`` chunks; CP rank ``i`` holds chunks ``i`` and
``2 * cp - 1 - i`` so every rank gets the same share of the causal attention work. Attention
stays exact over the whole sequence: each attention layer all-gathers its per-token key/value
state (MLA: the compressed latent, ``kv_lora_rank`` normalised latent + ``qk_rope_head_dim``
roped key per token, from which it rebuilds the keys and values of the whole sequence
locally; grouped-query attention: its ``num_key_value_heads`` keys and values). A MoE balance loss sums its routing counts over the group (DeepSeek-V3's
per sequence, Qwen3-MoE's over the micro-batch), and every loss is this rank's share (token sums divided by the whole
micro-batch's token count), so the shares of the CP ranks add up to the single-process loss
and their gradients add up to its gradient.

Ulysses (``context_parallel_method: ulysses``) trades each attention core's sequence chunks for
head groups by all-to-all instead; hybrid runs Ulysses inside groups of ``ulysses_degree_in_cp``
consecutive CP ranks and all-gathers keys and values between the groups that hold the same heads.
An attention that runs its own core (a ``head_exchange`` hook) gets the all-to-all as a
:class:`_HeadExchange` and keeps the all-gather over the whole CP group for what its heads
share (e.g. one shared key/value head).

The model is duck-typed: each attention Cell with a ``kv_exchange`` attribute and each MoE
Cell with a ``sequence_reduce`` attribute gets the hook (see the models package).
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Optional

import numpy as np

import mindspore as ms
from mindspore import Tensor, ops

from mindtrain.config import ConfigError
from mindtrain.parallel import collectives as C
from mindtrain.parallel import functional as F
from mindtrain.parallel.mesh import Group

def chunk_indices(seq_length: int, cp: int, rank: int) -> np.ndarray:
    """Sequence positions held by CP rank ``rank``: chunk ``rank`` then chunk ``2*cp-1-rank``."""
    check_seq_length(seq_length, cp)
    c = seq_length // (2 * cp)
    first, second = rank, 2 * cp - 1 - rank
    return np.concatenate([np.arange(first * c, (first + 1) * c), np.arange(second * c, (second + 1) * c)])


def check_seq_length(seq_length: int, cp: int) -> None:
    """One-line error unless ``seq_length`` splits into ``2 * cp`` equal chunks."""
    if cp > 1 and seq_length % (2 * cp):
        raise ConfigError("model.seq_length", f"{seq_length} must be divisible by 2 x context_parallel = "
                                              f"{2 * cp} (each CP rank holds two equal causal chunks)")


def _gathered_order(seq_length: int, cp: int) -> np.ndarray:
    """``natural[j] = gathered[perm[j]]`` for keys all-gathered from every rank's local order."""
    gathered = np.concatenate([chunk_indices(seq_length, cp, r) for r in range(cp)])
    perm = np.empty(seq_length, np.int32)
    perm[gathered] = np.arange(seq_length, dtype=np.int32)
    return perm


def _valid_tokens(labels: np.ndarray, loss_mask: np.ndarray) -> float:
    return float(((labels >= 0) * loss_mask.astype(np.float32)).sum())


def split_batch(batch: Mapping[str, Any], cp: int = 1, rank: int = 0, num_heads: int = 1,
                mtp_depths: int = 0, *, inputs: Callable[[Mapping[str, Any], int], dict]) -> dict[str, Any]:
    """This CP rank's part of one micro-batch, with everything the stage forward needs.

    ``batch`` holds numpy ``input_ids``, ``labels`` and optionally ``loss_mask``,
    ``position_ids`` and ``attention_mask`` of whole sequences [B, S]. ``inputs`` is the
    model's own rule for what a forward reads (``model.whole_sequence_inputs``: called as
    ``inputs(batch, mtp_depths)``, it returns numpy ``input_ids``, ``labels``,
    ``loss_mask``, ``position_ids``, the additive ``mask_add`` [B, 1, S, S] and per MTP
    depth the shifted ``input_ids``/``labels``/``loss_mask``, all of whole sequences); this
    function only chunks them. Returns Tensors ``input_ids``, ``labels``, ``loss_mask``,
    ``position_ids`` (of the local tokens), ``mask_add`` [B, heads, S_local, S] (local
    queries against all keys), the float ``lm_scale`` (local / whole valid-token count,
    turning the local mean loss into this rank's share), and per MTP depth ``k`` the targets
    shifted by ``k`` on the whole sequence (``mtp`` list of dicts with ``input_ids``,
    ``labels``, ``loss_mask``, ``scale``). Works for ``cp == 1`` too (then nothing is split).
    """
    s = np.asarray(batch["input_ids"]).shape[1]
    check_seq_length(s, cp)
    whole = inputs(batch, mtp_depths)
    b = whole["input_ids"].shape[0]
    idx = chunk_indices(s, cp, rank) if cp > 1 else np.arange(s)
    add = whole["mask_add"][:, :, idx, :]
    add = np.ascontiguousarray(np.broadcast_to(add, (b, num_heads) + add.shape[2:]))

    def local(x, dtype):
        return Tensor(np.ascontiguousarray(x[:, idx]).astype(dtype))

    def scale(lab, msk):
        whole_count = _valid_tokens(lab, msk)
        part = _valid_tokens(lab[:, idx], msk[:, idx])
        return max(part, 1.0) / max(whole_count, 1.0)

    labels, loss_mask = whole["labels"], whole["loss_mask"]
    out = {"input_ids": local(whole["input_ids"], np.int32), "labels": local(labels, np.int32),
           "loss_mask": local(loss_mask, np.float32), "position_ids": local(whole["position_ids"], np.int32),
           "mask_add": Tensor(add), "lm_scale": scale(labels, loss_mask), "mtp": []}
    if "token_keys" in whole:  # the model's per-token dropout identities (numpy), chunked like the tokens
        out["token_keys"] = np.ascontiguousarray(whole["token_keys"][:, idx])
        out["whole_token_keys"] = whole["token_keys"]  # the rows of a layer that runs on gathered keys
    for t in whole["mtp"]:
        out["mtp"].append({"input_ids": local(t["input_ids"], np.int32), "labels": local(t["labels"], np.int32),
                           "loss_mask": local(t["loss_mask"], np.float32), "scale": scale(t["labels"], t["loss_mask"])})
    return out


class _KVExchange:
    """All-gathers an attention layer's per-token key/value state over the CP group, in
    sequence order, in one collective. Called with any number of pieces whose sequence axis
    is their second-to-last (MLA: the latent ``[B, S, kv_lora]`` and the roped key
    ``[B, 1, S, rope]``; grouped-query attention: keys and values ``[B, Nkv, S, d]``); returns
    them with the whole sequence on that axis.

    Any sequence cut into the same ``2 * cp`` chunks works, whatever its length: the tokens,
    one entry per ``r`` tokens (``r`` dividing the chunk length), or one row per chunk (local
    length 2: e.g. each chunk's last tokens, which the next chunk's rank needs). ``chunks``
    (this rank's chunk numbers, in its local order) and ``num_chunks`` say how the sequence
    is cut, for a model that builds its tables or masks per chunk."""

    def __init__(self, group: Group, seq_length: int):
        self.group = group
        self.seq_length = seq_length
        self.chunks = (group.index, 2 * group.size - 1 - group.index)
        self.num_chunks = 2 * group.size
        self.perm = Tensor(_gathered_order(seq_length, group.size))
        self._perms = {seq_length: self.perm}

    def _perm(self, n: int) -> Tensor:
        perm = self._perms.get(n)
        if perm is None:
            perm = self._perms[n] = Tensor(_gathered_order(n, self.group.size))
        return perm

    def _gather(self, local):
        """Every member's rows, in group order (one all-gather; gradients summed back)."""
        return F.all_gather(local, self.group, 0)

    def __call__(self, *pieces):
        flat, shapes = [], []
        for x in pieces:  # sequence first, everything else as columns
            axes = (x.ndim - 2,) + tuple(i for i in range(x.ndim) if i != x.ndim - 2)
            t = ops.transpose(x, axes) if x.ndim > 2 else x
            shapes.append((axes, t.shape))
            flat.append(t.reshape(t.shape[0], -1))
        local = flat[0] if len(flat) == 1 else ops.concat(flat, 1)
        whole = ops.gather(self._gather(local), self._perm(local.shape[0] * self.group.size), 0)
        n = whole.shape[0]
        out, start = [], 0
        for (axes, shape), f in zip(shapes, flat):
            width = f.shape[1]
            t = whole[:, start:start + width].reshape((n,) + tuple(shape[1:]))
            start += width
            back = tuple(axes.index(i) for i in range(len(axes)))
            out.append(ops.transpose(t, back) if len(axes) > 2 else t)
        return tuple(out)


class _SequenceReduce:
    """Sums per-sequence routing counts over the CP group (for the sequence balance loss)."""

    def __init__(self, group: Group):
        self.group = group

    def __call__(self, counts, s):
        return F.reduce_from_group(counts, self.group), s * self.group.size


class _HeadExchange:
    """Ulysses for an attention that runs its own core (the ``head_exchange`` hook): the
    collectives over the Ulysses group that trade this rank's sequence chunks of every head
    for ``heads / size`` heads (``index``-th group of them) of the group's whole sequence.
    The rows of the group's sequence are every member's local rows in group order (member
    ``j``'s chunks ``cp_index(j)`` and ``2 * cp - 1 - cp_index(j)``). Such an attention keeps
    its ``kv_exchange`` (the colossal all-gather over the whole CP group) for what every head
    shares: its keys and values then cover the whole sequence whatever the Ulysses degree."""

    def __init__(self, group: Group, ring: Optional[Group] = None):
        self.group = group
        self.ring = ring
        """Hybrid: the CP ranks holding the same head group in the other Ulysses groups."""
        self.index = group.index
        self.size = group.size

    def _all_to_all(self, t):
        """Equal row blocks to the members in order, theirs back in order (one all-to-all)."""
        return F.all_to_all(t, self.group)

    def _gather_rows(self, t):
        """Every member's rows (dim 0), in group order; no gradient (masks)."""
        return C.all_gather(t, self.group, 0)

    def _ring_gather(self, t):
        """Every ring member's rows (dim 0), in ring order; gradients summed back."""
        return F.all_gather(t, self.ring, 0)

    def check(self, heads: int) -> None:
        if heads % self.size:
            raise ConfigError("parallelism.context_parallel",
                              f"{self.size} Ulysses ranks must divide the attention (query or key/value) heads "
                              f"each rank runs ({heads}); use context_parallel_method: colossal")

    def seq_to_heads(self, x):
        """[B, N, L, d] -> [B, N / size, size * L, d]: this rank's head group of every
        member's rows, in member order (one all-to-all)."""
        c = self.size
        b, n, s, d = x.shape
        self.check(n)
        t = ops.transpose(x.reshape(b, c, n // c, s, d), (1, 0, 2, 3, 4)).reshape(c * b, -1)
        got = self._all_to_all(t).reshape(c, b, n // c, s, d)  # member j's rows: the gathered order
        return ops.transpose(got, (1, 2, 0, 3, 4)).reshape(b, n // c, c * s, d)

    def heads_to_seq(self, y):
        """The inverse of :meth:`seq_to_heads`: [B, N / size, size * L, d] -> [B, N, L, d]."""
        c = self.size
        b, nh, s_all, d = y.shape
        s = s_all // c
        t = ops.transpose(y.reshape(b, nh, c, s, d), (2, 0, 1, 3, 4)).reshape(c * b, -1)
        got = self._all_to_all(t).reshape(c, b, nh, s, d)
        return ops.transpose(got, (1, 0, 2, 3, 4)).reshape(b, c * nh, s, d)

    def gather_rows(self, x):
        """[B, L, K] -> [B, size * L, K]: every member's rows (a mask's query rows), in the
        row order of :meth:`seq_to_heads`; no gradient."""
        b, l, k = x.shape
        t = ops.transpose(ops.stop_gradient(x), (1, 0, 2)).reshape(l, -1)
        return ops.transpose(self._gather_rows(t).reshape(self.size * l, b, k), (1, 0, 2))

    def ring_seq(self, x):
        """Hybrid: [B, N, L, d] -> [B, N, ring * L, d], every ring member's sequence piece in
        ring order (one all-gather; the gradient is summed back to each member's piece)."""
        b, n, l, d = x.shape
        t = ops.transpose(x, (2, 0, 1, 3)).reshape(l, -1)
        whole = self._ring_gather(t).reshape(self.ring.size * l, b, n, d)
        return ops.transpose(whole, (1, 2, 0, 3))


def hybrid_groups(cp: Group, ulysses: int) -> tuple[Group, Group]:
    """The two subgroups of hybrid context parallelism for this rank of ``cp``: its Ulysses
    group (``ulysses`` consecutive CP ranks, which trade sequence chunks for head groups) and
    its ring group (the CP ranks with the same place in their Ulysses group, hence the same
    head group, which exchange keys and values). Creates their backend groups (collective over
    ``cp``: every member calls it, Ulysses group first)."""
    a, j = divmod(cp.index, ulysses)
    u_ranks = cp.ranks[a * ulysses:(a + 1) * ulysses]
    r_ranks = cp.ranks[j::ulysses]
    return (Group("cp_ulysses", u_ranks, j, C.new_group(u_ranks)),
            Group("cp_ring", r_ranks, a, C.new_group(r_ranks)))


class _UlyssesCore:
    """An attention core under Ulysses context parallelism: queries, keys and values of this
    rank's sequence chunks and every head go by all-to-all to ``N / cp`` heads of the whole
    sequence, the model's own core runs on them, and the output comes back the same way. The
    mask (local query rows against every key, in sequence order) is all-gathered over the
    group and its key columns put in the gathered order.

    :attr:`inner` is the core's forward that runs on the head groups: the one already on the
    instance when installed (an eager variant: the recomputed core's row blocks), else the
    core's ``untracked`` forward (the output alone). A model that changes its core's forward
    later (``recompute_in_row_blocks``) sets :attr:`inner` instead of replacing this wrapper.

    The max attention logits (QK-clip, MaxLogitsMonitor) come from the core's
    ``head_max_eager(q, k, mask_add)``, which the model calls with this rank's query rows of
    every head and its own keys; :meth:`head_max` replaces it on the instance: it runs the
    same exchange (no gradient) and the core's own ``head_max_eager`` on ``N / cp`` heads of
    the whole sequence, then all-gathers the per-head maxima over the Ulysses group, so every
    rank gets the maxima of all its heads (hybrid: over its Ulysses group's query rows, as a
    colossal rank gets its own rows'; the trainer's table is a maximum over the ranks)."""

    def __init__(self, core, heads: _HeadExchange, seq_length: int, cp_size: Optional[int] = None):
        prior = core.__dict__.get("construct")
        if isinstance(prior, _UlyssesCore):  # installed again: wrap what the previous one ran
            prior = prior.inner
        self.inner = prior if prior is not None else getattr(core, "untracked", core.construct)
        self._head_max = getattr(type(core), "head_max_eager", None)
        self.core = core
        self.heads = heads
        self.group = heads.group
        self.ring = heads.ring
        cp = cp_size or heads.size
        order = np.concatenate([chunk_indices(seq_length, cp, r) for r in range(cp)])
        self.key_order = Tensor(order.astype(np.int32))

    def _check(self, *xs):
        for x in xs:
            self.heads.check(x.shape[1])

    def _mask(self, mask_add):
        """[B, 1, rows of the Ulysses group, S]: key columns in the gathered order of all CP ranks."""
        mask = ops.expand_dims(self.heads.gather_rows(ops.stop_gradient(mask_add[:, 0])), 1)
        return ops.gather(mask, self.key_order, 3)

    def _keys(self, x):
        x = self.heads.seq_to_heads(x)
        return self.heads.ring_seq(x) if self.ring is not None else x  # hybrid: every Ulysses group's

    def __call__(self, q, k, v, mask_add, keep=None):
        h = self.heads
        self._check(q, k)
        mask = self._mask(mask_add)
        k, v = self._keys(k), self._keys(v)
        if keep is None:
            out = self.inner(h.seq_to_heads(q), k, v, mask)
        else:
            # attention dropout's keep mask [B, N, local rows, S] (every head of this rank's
            # queries against every key, in sequence order) goes with the queries to the head
            # groups, its key columns in the gathered order: the mask of one process
            keep = ops.gather(h.seq_to_heads(ops.stop_gradient(keep)), self.key_order, 3)
            out = self.inner(h.seq_to_heads(q), k, v, mask, keep)
        return h.heads_to_seq(out)

    def head_max(self, q, k, mask_add):
        """Per head [N] the largest pre-softmax logit of this rank's queries ``q`` [B, N,
        S_local, d] over the keys of the whole sequence (``k`` [B, N, S_local, d]: this
        rank's), taken on the head groups; no gradient (see the class doc)."""
        self._check(q, k)
        with ms._no_grad():  # pylint: disable=protected-access
            q, k = ops.stop_gradient(q), ops.stop_gradient(k)
            local = self._head_max(self.core, self.heads.seq_to_heads(q), self._keys(k), self._mask(mask_add))
            return C.all_gather(local.reshape(-1), self.group, 0)


def install_ulysses(core, heads: _HeadExchange, seq_length: int,
                    cp_size: Optional[int] = None) -> _UlyssesCore:
    """Run the attention core ``core`` under Ulysses over ``heads`` (its exchange: the Ulysses
    group, and under hybrid its ring group; ``cp_size`` the whole CP degree): its forward and, if it has one, its
    ``head_max_eager`` are replaced on the instance (see :class:`_UlyssesCore`)."""
    wrapper = _UlyssesCore(core, heads, seq_length, cp_size)
    object.__setattr__(core, "construct", wrapper)
    if wrapper._head_max is not None:  # pylint: disable=protected-access
        object.__setattr__(core, "head_max_eager", wrapper.head_max)
    return wrapper


def apply_context_parallel(model, group: Group, seq_length: int, method: str = "colossal",
                           ulysses_degree: Optional[int] = None) -> int:
    """Install the CP hooks on every attention and MoE Cell of ``model``; returns how many.

    ``group`` is the mesh's ``cp`` group; a group of size 1 removes the hooks. ``method``
    (``parallelism.context_parallel_method``): "colossal" all-gathers each attention layer's
    per-token key/value state (``kv_exchange``); "ulysses" replaces each attention cell's
    ``core_attention`` forward by :class:`_UlyssesCore` (all-to-all between sequence chunks
    and head groups), so the model's pieces around the core run as they are; "hybrid" runs
    Ulysses within groups of ``ulysses_degree`` consecutive CP ranks
    (``parallelism.ulysses_degree_in_cp``) and all-gathers the keys and values between those
    groups (:func:`hybrid_groups`). MoE cells sum their routing counts over the whole group
    either way (``sequence_reduce``). An attention Cell with a ``head_exchange`` attribute
    runs its own core under Ulysses / hybrid: it gets a :class:`_HeadExchange` over its
    Ulysses group and keeps a ``kv_exchange`` over the whole CP group (its core is not
    replaced). A model with a ``context_chunks`` attribute gets this rank's ``(chunk numbers,
    number of chunks)`` (None without CP), for the tables it builds of its tokens.
    """
    check_seq_length(seq_length, group.size)
    if method not in ("colossal", "ulysses", "hybrid"):
        raise ConfigError("parallelism.context_parallel_method",
                          f"{method!r} is not a method; use colossal, ulysses or hybrid")
    ring = None
    uly_group = group
    if method == "hybrid" and group.size > 1:
        check_ulysses_degree(group.size, ulysses_degree)
        uly_group, ring = hybrid_groups(group, ulysses_degree)
    ulysses = method in ("ulysses", "hybrid") and group.size > 1
    whole = _KVExchange(group, seq_length) if group.size > 1 else None
    exchange = None if ulysses else whole
    heads = _HeadExchange(uly_group, ring) if ulysses else None
    reduce = _SequenceReduce(group) if group.size > 1 else None
    if hasattr(model, "context_chunks"):
        model.context_chunks = None if whole is None else (tuple(whole.chunks), whole.num_chunks)
    n = 0
    for _, cell in model.cells_and_names():
        if hasattr(cell, "kv_exchange"):
            if hasattr(cell, "head_exchange"):  # runs its own core: Ulysses on its queries
                cell.kv_exchange = whole
                cell.head_exchange = heads
            else:
                cell.kv_exchange = exchange
                if ulysses:
                    install_ulysses(cell.core_attention, heads, seq_length, group.size)
            n += 1
        if hasattr(cell, "sequence_reduce"):
            cell.sequence_reduce = reduce
            n += 1
    if group.size > 1 and n == 0:
        raise ValueError("apply_context_parallel: the model has no attention Cell with a kv_exchange hook")
    return n


def check_ulysses_degree(cp: int, degree: Optional[int]) -> None:
    """Hybrid context parallelism's rule (MindFormers'): ``1 < ulysses_degree_in_cp < cp``,
    dividing ``cp``."""
    if degree is None or not 1 < degree < cp or cp % degree:
        raise ConfigError("parallelism.ulysses_degree_in_cp",
                          f"hybrid context parallelism needs 1 < ulysses_degree_in_cp < context_parallel "
                          f"({cp}) dividing it, got {degree}; set one or use context_parallel_method: ulysses")
