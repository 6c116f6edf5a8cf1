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
No concat or tile builds a head either (their backward hands strided slices on, and each is
copied): the queries' nope and rope rows come out of one matmul, their rotate_half out of
another, and each head's key is its nope rows plus the shared rope key placed in its rope
rows by a constant 0/1 matmul (zeros where the other part is: exact sums). Rope uses cos/sin
transposed once per forward (cached by the tensors' identity) and tiled over the heads, so
no multiply broadcasts (an eager broadcasting multiply ran 5-10x slower than one of equal
shapes). Reshapes go through :mod:`mindtrain.models.eager_reshape` (no view). The softmax's backward sums rows with ``mint.sum`` and
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
    (and scales, signs) its rows for :func:`eager_mla`, per head in the ``[nope | rope]`` order
    of the scores' operands (``qk = nope + rope`` rows a head):

    - ``"q"``: the query weight's nope rows, then its de-interleaved rope rows;
    - ``"q_half"``: nope zero rows, then the rope rows' rotate_half (sign folded in); both
      query kinds carry the softmax scale;
    - ``"k"`` / ``"k_half"``: the latent projection's rope rows, de-interleaved / their
      rotate_half (one head: the rope key is shared);
    - ``"k_nope"``: ``kv_b_proj``'s key rows, then rope zero rows; ``"v"``: its value rows.

    One matmul in place of strided slices, gathers and a broadcasting multiply (each an eager
    op and a backward one): every entry is 0 or +-scale, so the rows are the same numbers, and
    a zero row gives an exact zero. Cached per shape."""
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
    zeros = lambda count: [(None, 0.0)] * count  # noqa: E731
    if kind in ("k_nope", "v"):
        width = nope + dv
        if kind == "k_nope":
            rows = [r for h in range(n) for r in [(h * width + c, 1.0) for c in range(nope)] + zeros(rope)]
        else:
            rows = [(h * width + nope + c, 1.0) for h in range(n) for c in range(dv)]
    elif kind in ("q", "q_half"):
        width, scale = nope + rope, float(cell.scaling)
        if kind == "q":
            head = lambda h: ([(h * width + c, scale) for c in range(nope)]  # noqa: E731
                              + [(h * width + nope + deint[j], scale) for j in range(rope)])
        else:
            head = lambda h: zeros(nope) + [(h * width + nope + deint[half_src[j]], scale * half_sign[j])  # noqa: E731
                                            for j in range(rope)]
        rows = [r for h in range(n) for r in head(h)]
    else:
        width = rope
        rows = ([(deint[j], 1.0) for j in range(rope)] if kind == "k"
                else [(deint[half_src[j]], half_sign[j]) for j in range(rope)])
    m = np.zeros((len(rows), n * width), np.float32)
    for row, (col, value) in enumerate(rows):
        if col is not None:
            m[row, col] = value
    out = Tensor(m)
    _SELECTIONS[key] = out
    return out


def _rope_placement(cell, b: int):
    """[B, N * qk, rope]: row ``h * qk + nope + j`` picks column ``j``, the others are zero.
    Its product with the shared rope key [B, rope, S] puts that key in every head's rope rows
    (a matmul of 0s and 1s: the same numbers), where a tile and a concat would hand the
    backward strided slices to copy. Cached per shape."""
    n, nope, rope = cell.num_heads, cell.nope, cell.rope
    key = ("place", b, n, nope, rope)
    cache = _SELECTIONS.get(key)
    if cache is None:
        m = np.zeros((n, nope + rope, rope), np.float32)
        m[:, nope:, :] = np.eye(rope, dtype=np.float32)
        cache = _SELECTIONS[key] = Tensor(np.ascontiguousarray(np.broadcast_to(m.reshape(1, -1, rope), (b, n * (nope + rope), rope))))
    return cache


_SELECTIONS: dict = {}


def _per_batch(w, b: int):
    """``w`` [M, K] as [B, M, K] (a batched matmul's weight; the gradient sums the copies)."""
    w3 = w.reshape((1,) + tuple(w.shape))
    return w3 if b == 1 else ops.tile(w3, (b, 1, 1))


def _rope_transposed(cell, cos, sin, b: int, s: int):
    """(cos, sin) for the queries [B, N, qk, S] (1 and 0 in each head's nope rows) and for the
    shared rope key [B, rope, S], from the [B, 1, S, rope] tables; cached on the class by the
    tables' storage (the layers get ``stop_gradient`` views of one forward's tables, and steps
    at the default positions share them; the cache holds the tables, so no other tensor can
    have that storage meanwhile)."""
    n, nope, rope = cell.num_heads, cell.nope, cell.rope
    key = (cos.data_ptr(), sin.data_ptr(), tuple(cos.shape), tuple(sin.shape), n, nope)
    cache = type(cell).__dict__.get("_eager_rope_cache")
    if cache is not None and cache[0] == key:
        return cache[2]
    ck = ops.transpose(cos.reshape(b, s, rope), (0, 2, 1)).contiguous()
    sk = ops.transpose(sin.reshape(b, s, rope), (0, 2, 1)).contiguous()
    cq = ops.concat((ops.ones((b, nope, s), ck.dtype), ck), 1).reshape(b, 1, nope + rope, s)
    sq = ops.concat((ops.zeros((b, nope, s), sk.dtype), sk), 1).reshape(b, 1, nope + rope, s)
    out = (ops.tile(cq, (1, n, 1, 1)), ops.tile(sq, (1, n, 1, 1)), ck, sk)
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
    # per head the nope rows, then the de-interleaved rope rows (times cos) plus their
    # rotate_half (times sin; nope rows 0 there), the softmax scale folded in (as
    # MLAttention.project does), by matmuls with constant selections: no slice, no concat
    qk = nope + rope
    q_main = reshape(BMM_TB(_per_batch(ops.matmul(_selection(cell, "q", n), wq), b), q_in), (b, n, qk, s))
    q_half = reshape(BMM_TB(_per_batch(ops.matmul(_selection(cell, "q_half", n), wq), b), q_in), (b, n, qk, s))
    q_t = q_main * cq + q_half * sq                                              # [B, N, qk, S]

    wkv = w[i]
    w_lat, w_rope = ops.split(wkv, [kv_lora, rope])
    kv_lat = linear(x2, w_lat)                                                    # [T, kv_lora]
    wk_rot = ops.matmul(_selection(cell, "k", 1), w_rope)
    wk_half = ops.matmul(_selection(cell, "k_half", 1), w_rope)
    k_rot = BMM_TB(_per_batch(wk_rot, b), x3) * ck + BMM_TB(_per_batch(wk_half, b), x3) * sk  # [B, rope, S]
    if cell.qk_layernorm:
        kv_lat, j = cell.kv_a_layernorm.apply(kv_lat, w[i + 1]), i + 2
    else:
        j = i + 1
    lat = reshape(kv_lat, (b, s, kv_lora))
    # each head's key: its nope rows (rope rows 0) plus the shared rope key placed in its
    # rope rows (nope rows 0): exact sums, no tile or concat
    wk_nope = ops.matmul(_selection(cell, "k_nope", n), w[j])
    wv = ops.matmul(_selection(cell, "v", n), w[j])
    k_t = reshape(BMM_TB(_per_batch(wk_nope, b), lat) + ops.bmm(_rope_placement(cell, b), k_rot), (b, n, qk, s))
    v_t = reshape(BMM_TB(_per_batch(wv, b), lat), (b, n, dv, s))

    core = cell.core_attention
    if core.__dict__.get("_recompute_cell") is not None:  # recomputed: through the core's call route
        out_t = core(q_t, k_t, v_t, mask_add, None, True)
    else:
        out_t = core.attend_heads_major(q_t, k_t, v_t, mask_add)                  # [B, N, dv, S]
    out_t = reshape(out_t, (b, n * dv, s))
    return _BMM_TA_TB(out_t, _per_batch(w[j + 1], b))                              # [B, S, H]
