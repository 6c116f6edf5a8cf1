"""MLA's eager forward in a heads-major layout: no transposed views.

On MindSpore's CPU backend an eager op on a transposed or sliced view first copies it into
a contiguous buffer, at ~1 GB/s (measured: 1.5-1.8 ms for the [2, 8, 512, 48] queries, more
than the matmul that reads them); the eager attention of :class:`~mindtrain.models.attention.MLAttention`
paid four such copies a layer forward (queries, keys, values, the heads' outputs) and as
many backward. Here every projection writes its heads already laid out for the attention
matmuls: the weight ``[M, K]`` (tiled over the batch, a few thousand floats) times the
activations ``[B, S, K]`` with ``transpose_b`` gives ``[B, M, S]`` = ``[B, N, d, S]``, the
queries and keys transposed. Scores are ``q^T k`` (``transpose_a``), the heads' outputs come
out ``[B, N, dv, S]`` and ``o_proj`` reads them with ``transpose_a``: the same numbers as
the compiled pieces, in the same order of summation per dot product, with no view copied.
Rope uses cos/sin transposed once per forward (cached by the tensors' identity) and tiled
over the heads, so no multiply broadcasts (an eager broadcasting multiply ran 5-10x
slower than one of equal shapes). The softmax's backward sums rows with ``mint.sum`` and
expands them with ``tile``: on eager tensors those beat the matmuls with ones vectors that
compiled graphs use (``mindtrain.models.softmax``).

Used by eager cells only, when nothing asks for the general path: no context-parallel
exchange, attention dropout, replaced core (or one recomputed in row blocks of a size
that blocks), max-logit tracking, LoRA dropout, biases or mixed precision
(:func:`eager_mla_ready`). A recomputed core runs through its recompute route
(:meth:`CoreAttention.attend_heads_major`), so recompute changes no number here either.
"""

from __future__ import annotations

import numpy as np
from mindspore import Tensor, mint, ops

from mindtrain.models.blocks import overridden
from mindtrain.models.eager_reshape import plain, reshape
from mindtrain.models.linear import linear
from mindtrain.models.softmax import Softmax

BMM_TA = ops.BatchMatMul(transpose_a=True)
BMM_TB = ops.BatchMatMul(transpose_b=True)
_BMM_TA_TB = ops.BatchMatMul(transpose_a=True, transpose_b=True)


class EagerSoftmax(Softmax):
    """``softmax(x, -1)`` whose backward ``y * (dy - sum(dy * y))`` takes the row sums with
    ``mint.sum`` and expands them with ``tile`` (eager only: a compiled last-axis ReduceSum
    is the slow one, see :class:`~mindtrain.models.softmax.Softmax`)."""

    def bprop(self, x, out, dout):
        shape = out.shape
        n = shape[-1]
        prod = plain(dout * out, (-1, n))
        row = ops.tile(mint.sum(prod, -1, keepdim=True), (1, n))
        return plain(prod - plain(out, (-1, n)) * row, shape),


def eager_mla_ready(cell, mask_add) -> bool:
    """True when ``cell`` (an MLAttention whose pieces run eagerly) may run :func:`eager_mla`
    on ``mask_add``: the general path is needed for anything a layout or a feature hooks."""
    core = cell.core_attention
    return (len(mask_add.shape) == 4 and mask_add.shape[1] == cell.num_heads
            and mask_add.shape[2] == mask_add.shape[3]
            and cell.kv_exchange is None and not cell.attention_bias and cell.matmul_dtype is None
            and not cell.fast_kernels and not cell.track_max_logits and not core.track_max_logits
            and _plain_core(core, mask_add) and not cell.has_lora_dropout() and cell.graph("project") is None)


def _plain_core(core, mask_add) -> bool:
    """True if ``core`` computes plain attention on ``mask_add``: not replaced, or in
    recomputed row blocks (:meth:`CoreAttention.recompute_in_row_blocks`) at a size it runs
    whole anyway."""
    if not overridden(core):
        return True
    if core.__dict__.get("construct") != core._row_blocks:  # pylint: disable=protected-access
        return False
    b, n, s, sk = mask_add.shape
    return b * n * s * sk <= core.row_block_elements


def _selection(cell, kind: str, n: int):
    """A constant [rows out, rows in] matrix whose product with a projection's weight picks
    (and scales, signs) its rows for :func:`eager_mla`: ``"q"``: the query weight's nope rows,
    then the de-interleaved rope rows, then their rotate_half (sign folded in), all times the
    softmax scale; ``"k"``: the latent projection's rope rows, de-interleaved, then their
    rotate_half; ``"kv"``: ``kv_b_proj``'s key rows, then its value rows. One matmul in place
    of strided slices, gathers and a broadcasting multiply (each an eager op and a backward
    one): every entry is 0 or +-scale, so the rows are the same numbers. Cached per shape."""
    nope, rope, dv = cell.nope, cell.rope, cell.v_dim
    key = (kind, n, nope, rope, dv, cell.rope_interleave, float(cell.scaling))
    cache = _SELECTIONS.get(key)
    if cache is not None:
        return cache
    half = rope // 2
    deint = (np.concatenate([np.arange(0, rope, 2), np.arange(1, rope, 2)]) if cell.rope_interleave
             else np.arange(rope))
    half_src = np.concatenate([np.arange(half, rope), np.arange(half)])
    half_sign = np.concatenate([-np.ones(half), np.ones(half)])
    if kind == "kv":
        width = nope + dv
        picks = [(h * width + c, 1.0) for h in range(n) for c in range(nope)] + \
                [(h * width + nope + c, 1.0) for h in range(n) for c in range(dv)]
        cols = n * width
    else:
        width, base, scale = (nope + rope, nope, float(cell.scaling)) if kind == "q" else (rope, 0, 1.0)
        picks = [(h * width + c, scale) for h in range(n) for c in range(nope)] if kind == "q" else []
        picks += [(h * width + base + deint[j], scale) for h in range(n) for j in range(rope)]
        picks += [(h * width + base + deint[half_src[j]], scale * half_sign[j]) for h in range(n) for j in range(rope)]
        cols = n * width
    m = np.zeros((len(picks), cols), np.float32)
    for row, (col, value) in enumerate(picks):
        m[row, col] = value
    out = Tensor(m)
    _SELECTIONS[key] = out
    return out


_SELECTIONS: dict = {}


def _per_batch(w, b: int):
    """``w`` [M, K] as [B, M, K] (a batched matmul's weight; the gradient sums the copies)."""
    w3 = w.reshape((1,) + tuple(w.shape))
    return w3 if b == 1 else ops.tile(w3, (b, 1, 1))


def _rope_transposed(cell, cos, sin, b: int, s: int):
    """(cos, sin) for the queries [B, N, rope, S] and for the key [B, rope, S], from the
    [B, 1, S, rope] tables; cached on the class by the tables' storage (the layers get
    ``stop_gradient`` views of one forward's tables, and steps at the default positions share
    them; the cache holds the tables, so no other tensor can have that storage meanwhile)."""
    n, rope = cell.num_heads, cell.rope
    key = (cos.data_ptr(), sin.data_ptr(), tuple(cos.shape), tuple(sin.shape), n)
    cache = type(cell).__dict__.get("_eager_rope_cache")
    if cache is not None and cache[0] == key:
        return cache[2]
    ck = ops.transpose(cos.reshape(b, s, rope), (0, 2, 1)).contiguous()
    sk = ops.transpose(sin.reshape(b, s, rope), (0, 2, 1)).contiguous()
    cq = ops.tile(ck.reshape(b, 1, rope, s), (1, n, 1, 1))
    sq = ops.tile(sk.reshape(b, 1, rope, s), (1, n, 1, 1))
    out = (cq, sq, ck, sk)
    type(cell)._eager_rope_cache = (key, (cos, sin), out)
    return out


def eager_mla(cell, x, cos, sin, mask_add, *w):
    """:meth:`MLAttention.forward`'s math on ``x`` [B, S, H] with the weights ``w``
    (``piece_weights("forward")``, no biases), in the heads-major layout (module doc)."""
    b, s, _ = x.shape
    n, nope, rope, dv = cell.num_heads, cell.nope, cell.rope, cell.v_dim
    kv_lora = cell.kv_lora_rank
    x2 = reshape(x, (b * s, -1))
    x3 = reshape(x2, (b, s, -1))
    cq, sq, ck, sk = _rope_transposed(cell, cos, sin, b, s)

    if cell.q_lora_rank is None:
        q_in, wq, i = x3, w[0], 1
    else:
        q_lat = linear(x2, w[0])
        if cell.qk_layernorm:
            q_lat, wq, i = cell.q_a_layernorm.apply(q_lat, w[1]), w[2], 3
        else:
            wq, i = w[1], 2
        q_in = reshape(q_lat, (b, s, -1))
    # the nope rows, the de-interleaved rope rows and their rotate_half, the softmax scale
    # folded in (as MLAttention.project does), by one matmul with a constant selection
    wq_nope, wq_rot, wq_half = ops.split(ops.matmul(_selection(cell, "q", n), wq), [n * nope, n * rope, n * rope])
    q_nope = reshape(BMM_TB(_per_batch(wq_nope, b), q_in), (b, n, nope, s))
    q_rot = (reshape(BMM_TB(_per_batch(wq_rot, b), q_in), (b, n, rope, s)) * cq
             + reshape(BMM_TB(_per_batch(wq_half, b), q_in), (b, n, rope, s)) * sq)
    q_t = ops.concat((q_nope, q_rot), 2)                                          # [B, N, qk, S]

    wkv = w[i]
    w_lat, w_rope = ops.split(wkv, [kv_lora, rope])
    kv_lat = linear(x2, w_lat)                                                    # [T, kv_lora]
    wk_rot, wk_half = ops.split(ops.matmul(_selection(cell, "k", 1), w_rope), rope)
    k_rot = BMM_TB(_per_batch(wk_rot, b), x3) * ck + BMM_TB(_per_batch(wk_half, b), x3) * sk  # [B, rope, S]
    if cell.qk_layernorm:
        kv_lat, j = cell.kv_a_layernorm.apply(kv_lat, w[i + 1]), i + 2
    else:
        j = i + 1
    lat = reshape(kv_lat, (b, s, kv_lora))
    wk_nope, wv = ops.split(ops.matmul(_selection(cell, "kv", n), w[j]), [n * nope, n * dv])  # key rows, value rows
    k_nope = reshape(BMM_TB(_per_batch(wk_nope, b), lat), (b, n, nope, s))
    v_t = reshape(BMM_TB(_per_batch(wv, b), lat), (b, n, dv, s))
    k_t = ops.concat((k_nope, ops.tile(reshape(k_rot, (b, 1, rope, s)), (1, n, 1, 1))), 2)

    core = cell.core_attention
    if core.__dict__.get("_recompute_cell") is not None:  # recomputed: through the core's call route
        out_t = core(q_t, k_t, v_t, mask_add, None, True)
    else:
        out_t = core.attend_heads_major(q_t, k_t, v_t, mask_add)                  # [B, N, dv, S]
    out_t = reshape(out_t, (b, n * dv, s))
    return _BMM_TA_TB(out_t, _per_batch(w[j + 1], b))                              # [B, S, H]
