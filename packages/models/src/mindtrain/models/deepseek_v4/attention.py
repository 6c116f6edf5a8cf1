"""DeepSeek-V4's attention (HF DeepseekV4Attention's math and parameter names): one shared
key/value head, queries through a low-rank projection, learnable per-head sinks, a grouped
low-rank output projection, and per layer one of three kinds of keys:

- ``sliding``: the last ``sliding_window`` tokens (itself included);
- ``hca`` (heavily compressed): the sliding keys plus one entry per ``ratio`` tokens, a
  softmax-gated pooling of non-overlapping windows (:class:`Compressor`);
- ``csa`` (compressed sparse, ratio 4): the sliding keys plus overlapping pooled entries (two
  series per token, each entry pooling 2 x ratio tokens), of which a lightning indexer
  (:class:`Indexer`) keeps ``index_topk`` per query.

Runs eagerly: the indexer's top-k and the variable entry counts are host-side shapes. A
compressed entry ``w`` (tokens ``w*ratio .. (w+1)*ratio - 1``) is visible to query ``t`` when
``w < (t + 1) // ratio``, as HF's ``block_bias``.

Context parallelism (MindFormers' ``csa_context_parallel.py`` scheme on the parallel
package's load-balanced chunks: each rank holds chunks ``i`` and ``2 * cp - 1 - i`` of the
``2 * cp`` equal chunks). The layout sets ``kv_exchange``, an all-gather over the CP group
that returns pieces of any sequence cut into those chunks in sequence order. Queries stay
local; per layer and per local chunk:

- the sliding keys: the chunk's own keys after a halo of the ``sliding_window - 1`` keys
  before it, taken from the all-gathered last keys of every chunk (MindFormers' window halo);
- the compressed entries: each rank pools its own chunks' windows (chunk lengths are
  multiples of the ratio); ratio 4's overlapping pooling takes its first window's other
  series from the chunk before (the all-gathered last window of every chunk: MindFormers'
  boundary halo); the pooled entries of all ranks are all-gathered, so every query sees the
  whole sequence's entries under the causal entry bias;
- the lightning indexer: its own pooled keys are gathered the same way (no gradient), its
  queries and top-k are the local queries' over all entries.

Every gather is an all-gather, its gradient summed back to the rank that made the piece.

Ulysses and hybrid context parallelism (the layout also sets ``head_exchange``: the
all-to-all over the Ulysses group, of ``u`` consecutive CP ranks; ``u`` = CP under Ulysses):
the compressed entries and the indexer's choice are made as above (this rank's queries, every
entry of the sequence), and around the attention core the queries trade this rank's chunks of
every head for ``heads / u`` heads of the Ulysses group's chunks (one all-to-all, the output
back the same way). The one shared key/value head is not split: it is all-gathered over the
whole CP group (under hybrid the all-gather between the Ulysses groups too), so each query
row sees every key of the sequence under the one-process sliding mask (its rows of this
rank's tokens gathered over the Ulysses group with the entry bias), and its head's sink.
"""

from __future__ import annotations

import mindspore as ms
import numpy as np
from mindspore import Tensor, nn, ops

from mindtrain.config.plan import Region
from mindtrain.models.dropout import ENTRY_KEYS, dropout_of
from mindtrain.models.linear import Linear, linear
from mindtrain.models.norm import RMSNorm, rms_norm
from mindtrain.models.weights import Init, new_weight

NEG = -1e30  # a blocked key / empty pooling slot (exp() of it is exactly 0, as HF's -inf)


def unweighted_rms_norm(x, eps: float):
    """``x / sqrt(mean(x^2) + eps)`` over the last axis (HF DeepseekV4UnweightedRMSNorm)."""
    return x * ops.rsqrt(ops.mean(ops.square(x), -1, keep_dims=True) + eps)


def apply_rope(x, cos, sin, rotation, inverse: bool = False):
    """``x * cos + (x @ R) * sin`` (``- ...`` with ``inverse``: HF's rope at ``-sin``) of x [..., d];
    cos/sin broadcast against x."""
    shape = x.shape
    rotated = ops.matmul(x.reshape(-1, shape[-1]), rotation).reshape(shape)
    return x * cos - rotated * sin if inverse else x * cos + rotated * sin


def _lora_linear(cell: Linear, x, cd):
    """``cell``'s product in ``cd`` with its LoRA adapter (merged, or unmerged on ``[x,
    dropout(x)]`` while LoRA dropout runs; see :meth:`Linear.merged_weight`)."""
    return linear(cell.lora_input(x), cell.merged_weight(), None, cd)


def causal_entry_bias(positions: np.ndarray, ratio: int, n_entries: int) -> np.ndarray:
    """[len(positions), T] additive bias: 0 where the query at position t may see compressed
    entry w (w < (t + 1) // ratio)."""
    t = np.asarray(positions)[:, None]
    w = np.arange(n_entries)[None, :]
    return np.where(w < (t + 1) // ratio, 0.0, NEG).astype(np.float32)


class Compressor(nn.Cell):
    """Softmax-gated pooling of every ``ratio`` tokens into one entry of ``dim`` channels
    (HF DeepseekV4HCACompressor / the pooling of DeepseekV4CSACompressor and the indexer):
    ``kv_proj``, ``gate_proj``, ``position_bias [ratio, width]`` and ``kv_norm``. With
    ``overlap`` (compressed sparse attention) each token projects two series (width 2 x dim):
    entry w pools window w-1's first series with window w's second (2 x ratio slots).
    ``construct(x [B,S,H], cos, sin [T, dim] at the entries' positions, rotation)`` -> [B, T, dim]
    (normed, roped), T = S // ratio; None when T is 0. Under context parallelism (``exchange``)
    x holds this rank's chunks and the result is every entry of the whole sequence."""

    matmul_dtype = None

    def __init__(self, hidden: int, dim: int, ratio: int, overlap: bool, eps: float, std: float):
        super().__init__()
        self.dim, self.ratio, self.overlap, self.eps = dim, ratio, overlap, float(eps)
        width = 2 * dim if overlap else dim
        self.kv_proj = Linear(hidden, width, init_std=std)
        self.gate_proj = Linear(hidden, width, init_std=std)
        self.position_bias = new_weight((ratio, width), Init("zeros"), "position_bias")
        self.kv_norm = RMSNorm(dim, eps)

    def construct(self, x, cos, sin, rotation, exchange=None, detach: bool = False):
        """Entries of ``x``'s windows; with ``exchange`` (context parallelism) of this rank's
        chunks, then all-gathered: every entry of the whole sequence, in order (``detach``:
        gathered without gradient, for the indexer)."""
        b, s, _ = x.shape
        m, d = self.ratio, self.dim
        nch = 1 if exchange is None else len(exchange.chunks)
        c = s // nch                                                       # tokens per chunk
        nw = c // m                                                        # windows per chunk
        if nw == 0:
            return None
        cd = self.matmul_dtype
        # LoRA: the adapted weights (their inputs taken before the cut: LoRA dropout's masks are per token)
        x_kv, x_gate = self.kv_proj.lora_input(x), self.gate_proj.lora_input(x)
        if nw * m != c:
            if exchange is not None:
                raise ValueError(f"DeepSeek-V4 context parallelism: a chunk of {c} tokens is not a whole number of "
                                 f"ratio-{m} windows (parallelism.context_parallel)")
            x_kv, x_gate = x_kv[:, :nw * m], x_gate[:, :nw * m]
        kv = linear(x_kv, self.kv_proj.merged_weight(), None, cd).reshape(b * nch, nw, m, -1)
        gate = linear(x_gate, self.gate_proj.merged_weight(), None, cd).reshape(b * nch, nw, m, -1) + self.position_bias
        if self.overlap:
            cur_kv, cur_gate = kv[..., d:], gate[..., d:]
            if exchange is None:
                first_kv = ops.zeros((b, 1, m, d), kv.dtype)
                first_gate = ops.fill(gate.dtype, (b, 1, m, d), NEG)
            else:
                first_kv, first_gate = self._boundary(kv, gate, exchange, b, nch, detach)
            if nw > 1:
                prev_kv = ops.concat((first_kv, kv[:, :-1, :, :d]), 1)
                prev_gate = ops.concat((first_gate, gate[:, :-1, :, :d]), 1)
            else:
                prev_kv, prev_gate = first_kv, first_gate
            kv = ops.concat((prev_kv, cur_kv), 2)
            gate = ops.concat((prev_gate, cur_gate), 2)
        pooled = (kv * ops.softmax(gate, 2)).sum(2).reshape(b, nch * nw, d)  # [B, entries, d]
        pooled = rms_norm(pooled, self.kv_norm.weight, self.eps)
        pooled = apply_rope(pooled, cos, sin, rotation)
        if exchange is None:
            return pooled
        if detach:
            pooled = ops.stop_gradient(pooled)
        return exchange(pooled)[0]

    def _boundary(self, kv, gate, exchange, b: int, nch: int, detach: bool = False):
        """The first series of the window before each local chunk's first one (that chunk's
        ``first_kv``, ``first_gate`` [B * chunks, 1, m, d]): the last window of the chunk
        before, from the all-gathered last windows of every chunk; none (empty slots) before
        chunk 0."""
        m, d = self.ratio, self.dim
        tails = ops.stack((kv[:, -1, :, :d], gate[:, -1, :, :d]), 1).reshape(b, nch, 2 * m * d)
        if detach:
            tails = ops.stop_gradient(tails)
        whole = exchange(tails)[0]                                         # [B, 2cp, 2 m d], chunk order
        empty = ops.concat((ops.zeros((b, 1, m * d), whole.dtype), ops.fill(whole.dtype, (b, 1, m * d), NEG)), 2)
        ext = ops.concat((empty, whole), 1)                                # row k: the tail of chunk k - 1
        before = ops.gather(ext, Tensor(np.asarray(exchange.chunks, np.int32)), 1)
        before = before.reshape(b * nch, 1, 2, m, d)
        return before[:, :, 0], before[:, :, 1]


class Scorer(nn.Cell):
    """HF DeepseekV4IndexerScorer's parameter: ``weights_proj`` (the per-head weights)."""

    def __init__(self, hidden: int, heads: int, std: float):
        super().__init__()
        self.weights_proj = Linear(hidden, heads, init_std=std)


class Indexer(Compressor):
    """The lightning indexer (HF DeepseekV4Indexer): its own overlapping pooling at
    ``index_head_dim`` (``kv_proj``, ``gate_proj``, ``position_bias``, ``kv_norm``),
    ``q_b_proj`` from the query latent and ``scorer.weights_proj``. Score of entry s for
    query t: ``sum_h w_{t,h} relu(q_{t,h} . k_s) / sqrt(index_head_dim)``; ``select`` returns
    the additive bias [B, S, T] keeping the ``index_topk`` best visible entries per query (no
    gradient flows through the choice, as in HF)."""

    def __init__(self, cfg, q_lora_rank: int):
        std = cfg.initializer_range
        super().__init__(cfg.hidden_size, cfg.index_head_dim, 4, True, cfg.rms_norm_eps, std)
        self.heads, self.topk = cfg.index_n_heads, cfg.index_topk
        self.recorded = None  # a list while the model's record_routing(True) is on: kept entries [B, S, T]
        self.q_b_proj = Linear(q_lora_rank, self.heads * self.dim, init_std=std)
        self.scorer = Scorer(cfg.hidden_size, self.heads, std)

    def select(self, x, q_latent, tables, seq_bias, exchange=None):
        """Additive bias [B, S, T] over the compressed entries (``seq_bias`` [S, T]: the
        causal one), or None without entries. With ``exchange`` (context parallelism), S are
        the local queries and T every entry of the sequence."""
        b, s, _ = x.shape
        keys = Compressor.construct(self, x, tables["index_entry_cos"], tables["index_entry_sin"],
                                    tables["index_rotation"], exchange, True)
        if keys is None:
            return None
        t = keys.shape[1]
        cd = self.matmul_dtype
        q = _lora_linear(self.q_b_proj, q_latent, cd).reshape(b, s, self.heads, self.dim)
        q = apply_rope(q, tables["index_q_cos"], tables["index_q_sin"], tables["index_rotation"])
        scores = ops.bmm(q.reshape(b, s * self.heads, self.dim), ops.transpose(keys, (0, 2, 1)))
        scores = ops.relu(scores.reshape(b, s, self.heads, t)) * (self.dim ** -0.5)
        weights = _lora_linear(self.scorer.weights_proj, x, cd) * (self.heads ** -0.5)
        index = (scores * ops.expand_dims(weights, -1)).sum(2)               # [B, S, T]
        index = ops.stop_gradient(index) + seq_bias
        k = min(self.topk, t)
        _, top = ops.topk(index, k)                                          # [B, S, k]
        visible = ops.gather_elements(seq_bias.reshape(1, s, t).broadcast_to((b, s, t)), 2, top) > NEG / 2
        chosen = ops.one_hot(top, t, Tensor(1.0, ms.float32), Tensor(0.0, ms.float32))
        chosen = (chosen * ops.expand_dims(visible.astype(ms.float32), -1)).sum(2)
        if self.recorded is not None:
            self.recorded.append(chosen > 0.5)
        return ops.stop_gradient(ops.select(chosen > 0.5, ops.zeros_like(chosen), ops.fill(ms.float32, chosen.shape, NEG)))


class CSACompressor(Compressor):
    """Compressed sparse attention's compressor (HF DeepseekV4CSACompressor): overlapping
    pooling at ``head_dim`` and the :class:`Indexer`."""

    def __init__(self, cfg, q_lora_rank: int):
        super().__init__(cfg.hidden_size, cfg.head_dim, 4, True, cfg.rms_norm_eps, cfg.initializer_range)
        self.indexer = Indexer(cfg, q_lora_rank)


class DeepseekV4Attention(nn.Cell):
    """HF DeepseekV4Attention: ``q_a_proj``, ``q_a_norm``, ``q_b_proj``, ``kv_proj``,
    ``kv_norm``, ``o_a_proj`` (grouped: [o_groups x o_lora_rank, heads x head_dim / o_groups]),
    ``o_b_proj``, ``sinks`` [heads] and, in compressed layers, ``compressor``. Under
    ``qk_layernorm: false`` neither ``q_a_norm`` (the query latent's, which the indexer reads
    too) nor ``kv_norm`` (MindFormers' DSv4HybridSelfAttention with IdentityOp q_layernorm /
    kv_layernorm); the fixed per-head query norm and the compressors' and indexer's norms stay.

    ``construct(x [B,S,H], *tables)`` -> [B,S,H]; ``tables`` (from the model, named by
    ``table_keys``) are the rope tables, the pair rotations and the masks of the sequence
    length, flat so that a recompute wrapper sees each tensor."""

    # its region in the parallel plan (mindtrain.models.parallel_plan): tensor parallelism splits
    # the query heads and the output projection's groups; no argument is a per-head mask
    REGION = Region.declare("attention", tp_counts=("o_groups",), head_mask_arg=None)
    matmul_dtype = None

    def __init__(self, cfg, kind: str, ratio: int):
        super().__init__()
        std = cfg.initializer_range
        h, n, d = cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim
        self.kind, self.ratio = kind, ratio
        self.num_heads, self.head_dim, self.eps = n, d, float(cfg.rms_norm_eps)
        self.o_groups, self.o_lora_rank = cfg.o_groups, cfg.o_lora_rank
        self.qk_layernorm = bool(getattr(cfg, "qk_layernorm", True))
        self.q_a_proj = Linear(h, cfg.q_lora_rank, init_std=std)
        if self.qk_layernorm:  # false: no latent / key-value norms (MindFormers' IdentityOp)
            self.q_a_norm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps)
        self.q_b_proj = Linear(cfg.q_lora_rank, n * d, init_std=std)
        self.kv_proj = Linear(h, d, init_std=std)
        if self.qk_layernorm:
            self.kv_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.o_a_proj = Linear(n * d // cfg.o_groups, cfg.o_groups * cfg.o_lora_rank, init_std=std)
        self.o_b_proj = Linear(cfg.o_groups * cfg.o_lora_rank, h, init_std=std)
        self.sinks = new_weight((n,), Init("zeros"), "sinks")
        if kind == "csa":
            self.compressor = CSACompressor(cfg, cfg.q_lora_rank)
        elif kind == "hca":
            self.compressor = Compressor(h, d, ratio, False, cfg.rms_norm_eps, std)
        else:
            self.compressor = None
        self.bmm_t = ops.BatchMatMul(transpose_b=True)
        self.kv_exchange = None  # context parallelism's all-gather over the CP group (set by the layout)
        self.head_exchange = None  # Ulysses / hybrid CP: the all-to-all over the Ulysses group (the layout's)

    table_keys: tuple = ()  # the names of the tables construct is given, in order (set by the model)

    def construct(self, x, *values):
        tables = dict(zip(self.table_keys, values))
        b, s, _ = x.shape
        n, d = self.num_heads, self.head_dim
        cd = self.matmul_dtype
        rope = "main" if self.kind == "sliding" else "compress"
        cos, sin, rot = tables[f"{rope}_cos"], tables[f"{rope}_sin"], tables["rotation"]
        q_latent = self._norm(_lora_linear(self.q_a_proj, x, cd), "q_a_norm")
        q = _lora_linear(self.q_b_proj, q_latent, cd).reshape(b, s, n, d)
        q = apply_rope(unweighted_rms_norm(q, self.eps), cos.reshape(1, s, 1, d), sin.reshape(1, s, 1, d), rot)
        kv = self._norm(_lora_linear(self.kv_proj, x, cd), "kv_norm")
        kv = apply_rope(kv, cos, sin, rot)                                    # [B, S, d]
        ex = self.kv_exchange
        entries = bias = None
        if self.compressor is not None:
            entries = self.compressor(x, tables[f"entry_cos.{self.ratio}"], tables[f"entry_sin.{self.ratio}"], rot, ex)
            if entries is not None:                                           # [B, T, d]: every entry
                seq_bias = tables[f"entry_bias.{self.ratio}"]
                if self.kind == "csa":
                    bias = self.compressor.indexer.select(x, q_latent, tables, seq_bias, ex)
                else:
                    bias = ops.broadcast_to(seq_bias, (b, s, entries.shape[1]))
        if self.head_exchange is not None:
            out = self._ulysses(q, kv, entries, bias, tables["window_rows"])
        else:
            out = self._chunked(q, kv, entries, bias, tables)                 # [B, S, N, d]
        out = apply_rope(out, cos.reshape(1, s, 1, d), sin.reshape(1, s, 1, d), rot, inverse=True)
        g = self.o_groups
        grouped = ops.transpose(out.reshape(b * s, g, n * d // g), (1, 0, 2))  # [G, BS, in]
        # never adapted: MindFormers holds it as a parameter, not a Linear (trainer/lora.py skips it)
        w = self.o_a_proj.weight.reshape(g, self.o_lora_rank, n * d // g)
        low = ops.transpose(self.bmm_t(grouped, w), (1, 0, 2)).reshape(b, s, g * self.o_lora_rank)
        return _lora_linear(self.o_b_proj, low, cd)

    def _norm(self, x, name: str):
        """The norm ``name`` of ``x`` (float32, as HF's); without the norms (``qk_layernorm:
        false``) ``x`` itself, cast to float32 as the norm's output would be."""
        if self.qk_layernorm:
            return rms_norm(x, getattr(self, name).weight, self.eps)
        return x if x.dtype == ms.float32 else ops.cast(x, ms.float32)

    def _attend(self, qh, keys, mask, sinks, keep):
        """The core: queries ``qh`` [Bq, n, c, d] (the ``n`` heads of ``sinks`` [n]) over
        ``keys`` [Bq, K, d] (the values too) under the additive ``mask`` [Bq, c, K], a sink
        column per head, attention dropout's ``keep`` [Bq, n, c, K] (or None) -> [Bq, n, c, d]."""
        bq, n, c, d = qh.shape
        sk = keys.shape[1]
        scores = self.bmm_t(qh.reshape(bq, n * c, d), keys).reshape(bq, n, c, sk) * (d ** -0.5) \
            + ops.expand_dims(mask, 1)
        sinks = ops.broadcast_to(sinks.reshape(1, n, 1, 1), (bq, n, c, 1))
        probs = ops.softmax(ops.concat((scores, sinks), -1), -1)[..., :sk]
        if keep is not None:  # attention dropout on the keys' probabilities, the sink's column gone (HF's V4)
            probs = probs * keep.astype(probs.dtype)
        return ops.bmm(probs.reshape(bq, n * c, sk), keys).reshape(bq, n, c, d)

    def _chunked(self, q, kv, entries, bias, tables):
        """One process and colossal CP: per query chunk (one: the whole sequence) its sliding
        keys (under CP after the halo) and every entry -> [B, S, N, d]."""
        b, s, n, d = q.shape
        ex = self.kv_exchange
        nch = 1 if ex is None else len(ex.chunks)  # the query chunks (one: the whole sequence)
        c, bc = s // nch, b * nch
        keys = kv.reshape(bc, c, d) if ex is None else self._window_keys(kv, tables["halo_index"], ex, nch)
        window = tables["sliding_mask"]                                       # [chunks, c, keys]
        mask = ops.broadcast_to(ops.expand_dims(window, 0), (b,) + tuple(window.shape)).reshape(bc, c, -1)
        window_keys = keys.shape[1]
        if entries is not None:
            t = entries.shape[1]
            if nch > 1:
                entries = ops.broadcast_to(ops.expand_dims(entries, 1), (b, nch, t, d)).reshape(bc, t, d)
            keys = ops.concat((keys, entries), 1)
            mask = ops.concat((mask, bias.reshape(bc, c, t)), 2)
        qh = ops.transpose(q.reshape(bc, c, n, d), (0, 2, 1, 3))
        keep = self.dropout_keep(c, window_keys, keys.shape[1] - window_keys)
        out = self._attend(qh, keys, mask, self.sinks, keep)                  # [B * chunks, N, c, d]
        return ops.transpose(out, (0, 2, 1, 3)).reshape(b, s, n, d)

    def _ulysses(self, q, kv, entries, bias, window_rows):
        """Ulysses / hybrid CP (``head_exchange``): this rank's queries [B, S_local, N, d] of
        every head go to ``N / u`` heads of the Ulysses group's rows; the shared key/value
        head is all-gathered over the CP group (``kv_exchange``: the whole sequence in order)
        and followed by every entry; the mask (``window_rows`` [S_local, S]: this rank's
        sliding rows against every key, then the entry bias) and attention dropout's keep
        mask go with the queries. -> [B, S_local, N, d]."""
        hx, ex = self.head_exchange, self.kv_exchange
        b, s, n, d = q.shape
        keys = ex(kv)[0]                                                      # [B, S_whole, d]
        mask = ops.broadcast_to(ops.expand_dims(window_rows, 0), (b,) + tuple(window_rows.shape))
        t = 0
        if entries is not None:
            t = entries.shape[1]
            keys = ops.concat((keys, entries), 1)
            mask = ops.concat((mask, bias.reshape(b, s, t)), 2)
        qh = hx.seq_to_heads(ops.transpose(q, (0, 2, 1, 3)))                 # [B, N / u, u * S_local, d]
        nh = qh.shape[1]
        keep = self.dropout_keep_rows(keys.shape[1] - t, t)
        if keep is not None:  # every head of this rank's rows: with the queries to the head groups
            keep = hx.seq_to_heads(ops.stop_gradient(keep))
        sinks = self.sinks[hx.index * nh:(hx.index + 1) * nh]
        out = self._attend(qh, keys, hx.gather_rows(mask), sinks, keep)
        return ops.transpose(hx.heads_to_seq(out), (0, 2, 1, 3))

    def dropout_keep_rows(self, tokens: int, entries: int):
        """Attention dropout's keep-and-scale mask [B, heads, S_local, tokens + entries] of
        this rank's queries against every key of the sequence (``tokens`` of them, in order)
        and every entry (Ulysses CP), or None when off."""
        state = dropout_of(self)
        if state is None or not state.attention_on():
            return None
        ids = np.concatenate((np.arange(tokens), ENTRY_KEYS + np.arange(entries))).astype(np.uint64)[None]
        return state.attention_mask_at(self.__dict__["_layer_index"], self.num_heads, self.head_offset, ids)

    head_offset = 0
    """The global index of this cell's first query head (tensor parallelism sets it):
    attention dropout's mask is drawn per global head."""

    def dropout_keep(self, c: int, window_keys: int, entries: int):
        """Attention dropout's keep-and-scale mask [B * chunks, heads, c, window_keys +
        entries] of this forward's probabilities (None when off): per query chunk of ``c``
        tokens (one without context parallelism: the whole row), its sliding keys (the
        ``window_keys - c`` halo keys before the chunk, then its own) named by their
        positions, then the compressed entries named ``ENTRY_KEYS + w``; so every layout draws
        what one process draws for a (query token, head, key)."""
        state = dropout_of(self)
        if state is None or not state.attention_on():
            return None
        ex = self.kv_exchange
        chunks = (0,) if ex is None else tuple(ex.chunks)
        halo = window_keys - c
        ids = np.stack([np.concatenate((np.maximum(np.arange(k * c - halo, (k + 1) * c), 0),
                                        ENTRY_KEYS + np.arange(entries))) for k in chunks]).astype(np.uint64)
        return state.attention_mask_at(self.__dict__["_layer_index"], self.num_heads, self.head_offset, ids)

    @staticmethod
    def _window_keys(kv, halo_index, exchange, nch: int):
        """Context parallelism's sliding keys [B * chunks, halo + c, d]: per local chunk the
        ``halo`` keys before it (zeros before the sequence start, masked) and its own. Each
        chunk's last ``min(halo, c)`` keys are all-gathered (chunk order); ``halo_index``
        [chunks, halo] picks each local chunk's halo from them after ``halo`` zero rows."""
        b, s, d = kv.shape
        c = s // nch
        own = kv.reshape(b, nch, c, d)
        halo = halo_index.shape[1]
        if halo == 0:
            return own.reshape(b * nch, c, d)
        h = min(halo, c)
        tails = own[:, :, c - h:, :].reshape(b, nch, h * d)
        whole = exchange(tails)[0].reshape(b, -1, d)                          # [B, 2cp * h, d]
        padded = ops.concat((ops.zeros((b, halo, d), kv.dtype), whole), 1)
        before = ops.gather(padded, halo_index.reshape(-1), 1).reshape(b, nch, halo, d)
        return ops.concat((before, own), 2).reshape(b * nch, halo + c, d)
