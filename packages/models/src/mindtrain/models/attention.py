"""Multi-head latent attention (MLA) of DeepSeek-V2/V3 with decoupled rope keys."""

from __future__ import annotations

import weakref
import zlib

import mindspore as ms
import numpy as np
from mindspore import Tensor, nn, ops
from mindspore.common._grad_function import _Function  # MindSpore's custom autograd function (pinned 2.10)

from mindtrain.config.recompute import ROW_BLOCK_ELEMENTS
from mindtrain.config.plan import Region, causal_block_rows
from mindtrain.models import kernels
from mindtrain.models.inputs import NEG
from mindtrain.models.attention_eager import BMM_TA, BMM_TB, EagerSoftmax, eager_mla, eager_mla_ready
from mindtrain.models.blocks import Block, overridden
from mindtrain.models.dropout import dropout_of
from mindtrain.models.linear import Linear, linear
from mindtrain.models.norm import RMSNorm
from mindtrain.models.precision import to_compute
from mindtrain.models.recompute import grad_recording, in_first_pass
from mindtrain.models.rope import softmax_scale
from mindtrain.models.softmax import Softmax


class CoreAttention(nn.Cell):
    """softmax(q k^T + mask) v: ``construct(q [B,N,S,d], k [B,N,Sk,d], v [B,N,Sk,dv], mask_add)``
    -> [B,N,S,dv]. Its own cell so it can be recomputed alone (``recompute.select_module``):
    the probabilities [B,N,S,Sk] are most of an attention layer's activations.

    :meth:`recompute_in_row_blocks` (the model calls it for eager layers whose attention is
    recomputed): the core runs in blocks of query rows of one sequence and head, each over
    the keys its mask leaves open (a causal block stops at its last row: about half the
    scores of a long sequence are never computed; blocked keys' probabilities are exactly 0,
    so skipping them changes no probability). A recompute's first pass runs the blocks
    without gradients and keeps only the output ([B,N,S,dv], small), keyed by its inputs'
    CRC-32; the replay takes it, and each block goes through :class:`_RowBlock` (nothing
    of it kept but its inputs and output; its backward computes its probabilities again),
    so neither pass ever holds more than one block's scores. The outputs are the same
    numbers up to the softmax's row-sum order; the key and value gradients are sums over
    blocks, so they may differ from one pass in the last bits."""

    matmul_dtype = None
    fast_kernels = False
    causal_blocks = None
    """The row blocks of the causal mask this core's next calls get (:func:`causal_blocks`;
    set by :func:`plan_causal_blocks` before a forward's layers run), or None. With them
    :meth:`attend` computes a square causal attention by blocks of query rows, each over
    the keys up to its last row only (masked keys' probabilities are exactly 0: the same
    numbers up to the softmax's row-sum order). A tuple of Tensors whose values follow from
    their shapes, so a compiled piece may read it as a constant (:func:`~mindtrain.models.blocks.constants`
    keys it by identity; equal shapes reuse one tuple). Bench size (seq 512, 4 blocks), one
    process, compiled forward + backward: op time 302 against 383 ms a step (MindSpore's
    profiler), wall 334-367 against 358-372 ms (min of 5 steps, 3 rounds in turns)."""
    row_block_elements = ROW_BLOCK_ELEMENTS
    """Score elements per block of rows (:data:`mindtrain.config.recompute.ROW_BLOCK_ELEMENTS`):
    attention whose scores hold more runs in blocks of one sequence and head,
    ``row_block_elements // Sk`` rows each."""

    def __init__(self):
        super().__init__()
        self.softmax = Softmax()
        self.eager_softmax = EagerSoftmax()  # attend_heads_major's
        self.bmm_t = ops.BatchMatMul(transpose_b=True)
        self.bmm = ops.BatchMatMul()

    track_max_logits = False
    """Also return each row's largest logit (see :meth:`attend_tracked`); set with
    :func:`track_max_attention_logits` before the first (possibly compiled) call."""

    def construct(self, q, k, v, mask_add, keep=None, heads_major=False):
        if heads_major:
            return self.attend_heads_major(q, k, v, mask_add)
        if self.track_max_logits:
            return self.attend_tracked(q, k, v, mask_add, keep)
        return self.untracked(q, k, v, mask_add, keep)

    def untracked(self, q, k, v, mask_add, keep=None):
        """The attention output alone, whatever :attr:`track_max_logits` says. ``keep``
        [B,N,S,Sk]: attention dropout's keep-and-scale mask on the probabilities (or None)."""
        cd = self.matmul_dtype
        if self.fast_kernels and cd is not None and keep is None:
            return kernels.fast_attention(q, k, v, mask_add)
        return self.attend(q, k, v, mask_add, keep)

    def attend_tracked(self, q, k, v, mask_add, keep=None):
        """``(output, row maxima [B, N, S])``: the output and, per query row, the largest
        pre-softmax logit (the scaled ``q.k``; the mask's blocked keys, ``NEG`` added, never
        win), the quantity MindFormers' flash attention reports as ``softmax_max``. The
        maxima carry no gradient."""
        scores = self.bmm_t(q, k) + mask_add
        if self.fast_kernels and self.matmul_dtype is not None and keep is None:
            out = kernels.fast_attention(q, k, v, mask_add)
        else:
            probs = self.softmax(scores)
            out = self.bmm(to_compute(probs if keep is None else probs * keep, self.matmul_dtype), v)
        return out, ops.amax(ops.stop_gradient(scores), -1)

    def attend_heads_major(self, q_t, k_t, v_t, mask_add):
        """Eager attention of queries and keys given transposed, ``q_t`` [B,N,d,S] and ``k_t``
        [B,N,d,Sk], with values ``v_t`` [B,N,dv,Sk]: the heads' outputs transposed, [B,N,dv,S]
        (:mod:`mindtrain.models.attention_eager`: no operand is a transposed view)."""
        probs = self.eager_softmax(BMM_TA(q_t, k_t) + mask_add)
        return BMM_TB(v_t, probs)

    def head_max_eager(self, q, k, mask_add):
        """Per head ([N]) the largest pre-softmax logit of ``q`` [B,N,S,d] over ``k``
        [B,N,Sk,d] with ``mask_add`` [B,N|1,S,Sk], one head at a time (an eager core in
        row blocks never holds a whole head's scores with gradients; this holds one without)."""
        q, k = ops.stop_gradient(q), ops.stop_gradient(k)
        out = []
        for h in range(q.shape[1]):
            hm = h if mask_add.shape[1] > 1 else 0
            s = self.bmm_t(q[:, h:h + 1], k[:, h:h + 1]) + mask_add[:, hm:hm + 1]
            out.append(ops.amax(s, (0, 1, 2, 3)).reshape(1))
        return ops.concat(out, 0)

    def attend(self, q, k, v, mask_add, keep=None):
        blocks = self.causal_blocks
        s = q.shape[2]
        if blocks is not None and keep is None and k.shape[2] == s and tuple(mask_add.shape) == blocks[0].shape[:2] + (s, s) \
                and blocks[-1].shape[3] == s:
            return self._attend_causal(q, k, v, blocks)
        # scores in the matmul dtype; adding the float32 mask makes them float32 for the softmax
        probs = self.softmax(self.bmm_t(q, k) + mask_add)
        if keep is not None:  # attention dropout (mindtrain.models.dropout)
            probs = probs * keep
        return self.bmm(to_compute(probs, self.matmul_dtype), v)

    def _attend_causal(self, q, k, v, blocks):
        """:meth:`attend` of a square causal attention by the row blocks of its mask
        (``blocks[j]`` [B, mask heads, rows, keys]: rows ``[i, i + rows)`` over keys ``[0, keys)``,
        where ``keys = i + rows``). A slice covering a whole tensor is not taken: on CPU a
        compiled StridedSlice over every element ran ~10x slower than one over part of them."""
        s = q.shape[2]
        outs = []
        start = 0
        for block in blocks:
            end = block.shape[3]
            kj, vj = (k, v) if end == s else (k[:, :, :end], v[:, :, :end])
            probs = self.softmax(self.bmm_t(q[:, :, start:end], kj) + block)
            outs.append(self.bmm(to_compute(probs, self.matmul_dtype), vj))
            start = end
        return ops.concat(outs, 2)

    def recompute_in_row_blocks(self, enabled: bool) -> None:
        """Run eagerly in recomputed blocks of query rows (see the class doc), or not. A
        Python ``construct`` on the instance: only for cells no graph compiles."""
        object.__setattr__(self, "_first_pass_outputs", {})
        wrapper = self.__dict__.get("construct")
        if wrapper is not None and hasattr(wrapper, "inner"):
            # a layout's wrapper runs this core inside (Ulysses context parallelism: around
            # the head groups' core); the row blocks become what it runs
            wrapper.inner = self._row_blocks if enabled else self.untracked
            return
        if enabled:
            object.__setattr__(self, "construct", self._row_blocks)
        elif self.__dict__.get("construct") == self._row_blocks:
            object.__delattr__(self, "construct")

    def _row_blocks(self, q, k, v, mask_add, keep=None, heads_major=False):
        if heads_major:  # only at sizes that are one block (attention_eager.eager_mla_ready)
            return self.attend_heads_major(q, k, v, mask_add)
        b, n, s, sk = q.shape[0], q.shape[1], q.shape[2], k.shape[2]
        fast = self.fast_kernels and self.matmul_dtype is not None
        if fast or keep is not None or b * n * s * sk <= self.row_block_elements:
            return self.untracked(q, k, v, mask_add, keep)
        rows = max(1, self.row_block_elements // sk)
        extents = _key_extents(mask_add, rows, s == sk)
        kept = self._first_pass_outputs
        if not grad_recording():  # no backward of this call: the blocks' outputs, nothing kept
            out = self._blockwise(q, k, v, mask_add, rows, extents, None)
            if in_first_pass():  # the replay will want this output again
                if len(kept) >= 16:  # replays that never came (a failed step): drop the oldest
                    kept.pop(next(iter(kept)))
                kept[_fingerprint(q, k, v)] = out
            return out
        out = kept.pop(_fingerprint(q, k, v), None) if kept else None
        return self._blockwise(q, k, v, mask_add, rows, extents, out)

    def _blockwise(self, q, k, v, mask_add, rows: int, extents, out):
        """Attention by blocks of ``rows`` query rows of one sequence and head, each over the
        keys its mask leaves open (``extents``); through :class:`_RowBlock` while gradients
        are recorded (``out``: the whole output when already known)."""
        b, n, s = q.shape[0], q.shape[1], q.shape[2]
        recording = grad_recording()
        per_batch = []
        for x in range(b):
            per_head = []
            for h in range(n):
                hm = h if mask_add.shape[1] > 1 else 0
                blocks = []
                for i in range(0, s, rows):
                    r = min(rows, s - i)
                    ke = int(extents[x, hm, i // rows])
                    qb = q[x:x + 1, h:h + 1, i:i + r]
                    kb, vb = k[x:x + 1, h:h + 1, :ke], v[x:x + 1, h:h + 1, :ke]
                    at = (x, hm, i, ke)
                    if recording:
                        blocks.append(_RowBlock.apply(self, qb, kb, vb, mask_add, at,
                                                      None if out is None else out[x:x + 1, h:h + 1, i:i + r]))
                    else:
                        blocks.append(self.attend(qb, kb, vb, _mask_block(mask_add, at, r)))
                per_head.append(blocks[0] if len(blocks) == 1 else ops.concat(blocks, 2))
            per_batch.append(ops.concat(per_head, 1))
        return ops.concat(per_batch, 0)


_CAUSAL_BLOCKS: dict = {}  # (mask shape, rows) -> the blocks: one tuple per shape (a graph constant)
_CAUSAL_SEEN: dict = {}  # id(mask) -> (weak reference to it, its blocks or None)


def causal_blocks(mask_add):
    """The row blocks of ``mask_add`` [B, H, S, S] when it is exactly the causal mask (0 on
    and below the diagonal, :data:`~mindtrain.models.inputs.NEG` above it, every sequence and
    head), else None: a tuple of contiguous [B, H, rows, i + rows] Tensors, block j holding
    rows ``[i, i + rows)`` (``i = j * rows``) over keys ``[0, i + rows)``
    (:func:`causal_block_rows`). Equal shapes give the same tuple; checked once per mask
    object (the model's cached causal mask: once per shape)."""
    hit = _CAUSAL_SEEN.get(id(mask_add))
    if hit is not None and hit[0]() is mask_add:
        return hit[1]
    shape = tuple(mask_add.shape)
    blocks = None
    rows = causal_block_rows(shape[2]) if len(shape) == 4 and shape[2] == shape[3] else 0
    if rows:
        m = mask_add.asnumpy()  # no copy on CPU
        s = shape[2]
        plane = np.triu(np.full((s, s), NEG, np.float32), 1)
        if m.dtype == np.float32 and bool((m == plane).all()):
            key = shape + (rows,)
            blocks = _CAUSAL_BLOCKS.get(key)
            if blocks is None:
                if len(_CAUSAL_BLOCKS) >= 4:  # other shapes (evaluation lengths): memory stays bounded
                    _CAUSAL_BLOCKS.clear()
                blocks = tuple(Tensor(np.ascontiguousarray(m[:, :, i:min(i + rows, s), :min(i + rows, s)]))
                               for i in range(0, s, rows))
                _CAUSAL_BLOCKS[key] = blocks
    if len(_CAUSAL_SEEN) >= 16:
        _CAUSAL_SEEN.clear()
    _CAUSAL_SEEN[id(mask_add)] = (weakref.ref(mask_add), blocks)
    return blocks


def plan_causal_blocks(attentions, mask_add) -> None:
    """Before layers holding ``attentions`` (cells with a :class:`CoreAttention` as
    ``core_attention``) run on ``mask_add``: each core that a compiled piece runs on that mask
    gets its causal blocks (:func:`causal_blocks`; None unless it is the causal mask). None for
    a core that runs eagerly (its attention's pieces not compiled, or run eagerly for LoRA
    dropout: eager slices of the query rows ran their matmuls on strided views ~3x slower, a
    loss), for one that runs the device's fused attention kernel (``fast_kernels``; the blocks
    would be memory it never reads) and for one a layout runs in its own way (its forward
    replaced: Ulysses context parallelism, whose mask holds other ranks' rows; recompute in
    row blocks, which skips blocked keys by itself). The blocks hold (G + 1) / 2G of the mask
    again (0.625 at 4 blocks; the mask is materialised per head, as adding a broadcast one is
    3-13x slower on CPU); they are built only when a core takes them (an eager model holds
    none; :func:`mindtrain.config.plan.causal_block_elements` is mindtrain-estimate's count)."""
    wanted = []
    for attn in attentions:
        core = attn.core_attention
        compiled = bool(attn.compiled_pieces) and not attn.has_lora_dropout()
        fused = core.fast_kernels and core.matmul_dtype is not None  # the device's fused attention instead
        wanted.append(compiled and not fused and not overridden(core))
    blocks = causal_blocks(mask_add) if any(wanted) else None  # no core reads them: none built
    for attn, want in zip(attentions, wanted):
        core = attn.core_attention
        mine = blocks if want else None
        if core.causal_blocks is not mine:
            object.__setattr__(core, "causal_blocks", mine)


def _fingerprint(*tensors) -> tuple:
    """Shapes and CRC-32 of the bytes: the same inputs (a recompute's replay computes them
    again, bit for bit) give the same key (a float sum need not: its order may vary)."""
    key = []
    for t in tensors:
        a = np.ascontiguousarray(t.asnumpy())
        key.append((a.shape, str(a.dtype), zlib.crc32(a.view(np.uint8))))
    return tuple(key)


_MASKED = NEG / 2  # a mask entry below this blocks its key: exp(NEG + score - max) is exactly 0 in float32
_EXTENTS: dict = {}  # id(mask) -> (weak reference to it, block rows, extents): one step's mask, shared by its layers


def _key_extents(mask_add, rows: int, square: bool) -> np.ndarray:
    """Keys each block of ``rows`` query rows attends to: ``[B, mask heads, blocks]``, the
    block's causal end (``i + rows``, square masks) where every later key of its rows is
    blocked and each of its rows has its own position open (a row with no open key
    attends to all of them), else every key. Skipping blocked keys changes no probability:
    theirs are exactly 0. Computed once per mask (each layer gets the same one)."""
    hit = _EXTENTS.get(id(mask_add))
    if hit is not None and hit[0]() is mask_add and hit[1] == rows:
        return hit[2]
    m = mask_add.asnumpy()  # no copy on CPU
    b, hm, s, sk = m.shape
    starts = range(0, s, rows)
    ext = np.full((b, hm, len(starts)), sk, np.int64)
    if square:
        for x in range(b):
            for h in range(hm):
                plane = m[x, h]
                for j, i in enumerate(starts):
                    end = min(i + rows, sk)
                    if end < sk and plane[i:end, end:].max() < _MASKED and \
                            np.diagonal(plane[i:end, i:end]).min() >= _MASKED:
                        ext[x, h, j] = end
    _EXTENTS.clear()
    _EXTENTS[id(mask_add)] = (weakref.ref(mask_add), rows, ext)
    return ext


def _mask_block(mask_add, at, rows: int):
    """The mask of block ``at = (x, h, i, keys)``: rows ``[i, i + rows)`` of sequence x and
    head h over its first ``keys`` keys, contiguous (adding a strided slice of the mask was
    ~15x slower than the add itself on CPU; numpy copies it at memory speed)."""
    x, h, i, ke = at
    if ke == mask_add.shape[3]:
        return mask_add[x:x + 1, h:h + 1, i:i + rows]
    return Tensor.from_numpy(np.ascontiguousarray(mask_add.asnumpy()[x:x + 1, h:h + 1, i:i + rows, :ke]))


class _RowBlock(_Function):  # pylint: disable=abstract-method
    """Attention of the query rows ``q`` (block ``at = (x, h, i, keys)``: rows i onwards of
    sequence x, head h, over the first ``keys`` keys), keeping only its inputs and output;
    its backward computes the block's probabilities again and its gradients.
    ``out``: the block's output when it is already known (a recompute's first pass)."""

    @staticmethod
    def forward(ctx, core, q, k, v, mask_add, at, out=None):  # pylint: disable=arguments-differ
        ctx.core, ctx.at = core, at
        if out is not None:  # the block's output from the first pass
            out = ops.deepcopy(out)
        else:
            out = core.attend(q, k, v, _mask_block(mask_add, at, q.shape[2]))
        ctx.save_for_backward(q, k, v, mask_add, out)
        return out

    @staticmethod
    def backward(ctx, dout):  # pylint: disable=arguments-differ
        # the block's probabilities again, then its gradients written out (what autograd
        # computes for CoreAttention.attend; a nested ms.grad here ran several times slower).
        # The softmax backward P * (dP - rowsum(dP * P)) takes the row sums as
        # rowsum(dout * out) ([rows, dv], not [rows, keys]), and the products with a
        # transposed [rows, keys] operand run as transposed products of the thin ones
        # (BatchMatMul with transpose_a on CPU was ~1.7x slower).
        q, k, v, mask_add, out = ctx.saved_tensors
        core = ctx.core
        cd = core.matmul_dtype
        rows, keys = q.shape[2], k.shape[2]
        scores = core.bmm_t(q, k) + _mask_block(mask_add, ctx.at, rows)
        probs = core.softmax.softmax(scores)
        dout = to_compute(dout, cd)
        dv = ops.transpose(core.bmm(ops.transpose(dout, _T), to_compute(probs, cd)), _T)
        dprobs = core.bmm_t(dout, v)
        if dprobs.dtype != probs.dtype:
            dprobs = ops.cast(dprobs, probs.dtype)
        row = (ops.cast(dout, ms.float32) * ops.cast(out, ms.float32)).sum(-1, keepdims=True)  # [1, 1, rows, 1]
        row = core.bmm(row, ops.ones((1, 1, 1, keys), row.dtype))
        dscores = to_compute((dprobs - row) * probs, cd)
        dq = core.bmm(dscores, k)
        dk = ops.transpose(core.bmm(ops.transpose(q, _T), dscores), _T)
        return None, dq, dk, dv, None, None, None


_T = (0, 1, 3, 2)


class MLAttention(Block):
    """HF DeepseekV3Attention's math and parameter names (q_a_proj/q_a_layernorm/q_b_proj or
    q_proj, kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj, o_proj); under ``qk_layernorm:
    false`` neither latent norm (MindFormers' MLA with IdentityOp norms).

    ``construct(x [B,S,H], cos, sin [B,1,S,rope], mask_add [B,N|1,S,Sk] additive)`` -> [B,S,H].

    ``kv_exchange`` (None by default) is the context-parallel hook: a callable taking this
    rank's latent ``kv_lat [B,S,kv_lora]`` and roped ``k_rot [B,1,S,rope]`` and returning
    those of the whole sequence (``Sk`` keys); the mask then has ``Sk`` columns.
    """

    REGION = Region.declare("attention")  # its region in the parallel plan (mindtrain.models.parallel_plan)

    # mixed precision: the dtype of every matmul here (None = float32, no casts); rope,
    # latent norms and softmax stay float32. Set by the model before the first call.
    matmul_dtype = None
    fast_kernels = False
    track_max_logits = False  # see track_max_attention_logits
    PIECES = ("project", "attend", "keys_values", "output")

    def __init__(self, cfg):
        super().__init__()
        std = cfg.initializer_range
        h = cfg.hidden_size
        self.num_heads = cfg.num_attention_heads
        self.q_lora_rank = cfg.q_lora_rank
        self.kv_lora_rank = cfg.kv_lora_rank
        self.nope = cfg.qk_nope_head_dim
        self.rope = cfg.qk_rope_head_dim
        self.v_dim = cfg.v_head_dim
        self.qk_head_dim = self.nope + self.rope
        self.rope_interleave = bool(cfg.rope_interleave)
        bias = bool(cfg.attention_bias)
        self.attention_bias = bias
        # MindFormers' qk_layernorm: false builds the latents without their norms (IdentityOp)
        self.qk_layernorm = bool(getattr(cfg, "qk_layernorm", True))
        if self.q_lora_rank is None:
            self.q_proj = Linear(h, self.num_heads * self.qk_head_dim, init_std=std)
        else:
            self.q_a_proj = Linear(h, self.q_lora_rank, bias=bias, init_std=std)
            if self.qk_layernorm:
                self.q_a_layernorm = RMSNorm(self.q_lora_rank, cfg.rms_norm_eps)
            self.q_b_proj = Linear(self.q_lora_rank, self.num_heads * self.qk_head_dim, init_std=std)
        self.kv_a_proj_with_mqa = Linear(h, self.kv_lora_rank + self.rope, bias=bias, init_std=std)
        if self.qk_layernorm:
            self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, cfg.rms_norm_eps)
        self.kv_b_proj = Linear(self.kv_lora_rank, self.num_heads * (self.nope + self.v_dim), init_std=std)
        self.o_proj = Linear(self.num_heads * self.v_dim, h, bias=bias, init_std=std)
        self.n_project = len(self.piece_weights("project"))
        self.scaling = softmax_scale(self.qk_head_dim, cfg.rope_scaling)
        self.core_attention = CoreAttention()
        self.kv_exchange = None
        self.matmul_t = ops.MatMul(transpose_b=True)
        half = self.rope // 2
        # de-interleave: new dim j holds old dim 2j (first half) / 2(j - half) + 1 (second half)
        self._deinterleave_idx = Tensor(np.concatenate([np.arange(0, self.rope, 2), np.arange(1, self.rope, 2)]),
                                        ms.int32)
        # rotate_half(y) = (-y[half:], y[:half])
        self._half_idx = Tensor(np.concatenate([np.arange(half, self.rope), np.arange(half)]), ms.int32)
        self._half_sign = Tensor(np.concatenate([-np.ones(half), np.ones(half)]).reshape(1, self.rope, 1),
                                 ms.float32)

    def _rope_rows(self, w, n: int):
        """Rows of a projection's rope part [n, rope, in] -> (rows giving the de-interleaved
        rope dims, rows giving rotate_half of them), both [n * rope, in]. Applying the
        permutation and the signed half-rotation to the (small) weight instead of the
        activations avoids strided slices of [B, N, S, d] tensors, which are slow on CPU."""
        if self.rope_interleave:
            w = ops.gather(w, self._deinterleave_idx, 1)
        w_half = ops.gather(w, self._half_idx, 1) * self._half_sign
        return w.reshape(n * self.rope, -1), w_half.reshape(n * self.rope, -1)

    def note_max_logits(self, head_max) -> None:
        """Fold one forward's per-head max logits ([N] of this rank's heads) into the step's."""
        note_max_logits(self, head_max)

    def piece_weights(self, name: str) -> tuple:
        if name == "project":
            if self.q_lora_rank is None:
                q = (self.q_proj.merged_weight(),)
            else:
                q = (self.q_a_proj.merged_weight(),) + self._bias(self.q_a_proj) + self._norm("q_a_layernorm") \
                    + (self.q_b_proj.merged_weight(),)
            kv = self.kv_a_proj_with_mqa
            return q + (kv.merged_weight(),) + self._bias(kv) + self._norm("kv_a_layernorm")
        if name == "keys_values":
            return (self.kv_b_proj.merged_weight(),)
        if name == "output":
            return (self.o_proj.merged_weight(),) + self._bias(self.o_proj)
        if name == "attend":
            return self.piece_weights("keys_values") + self.piece_weights("output")
        return self.piece_weights("project") + self.piece_weights("attend")  # "forward": the whole

    @staticmethod
    def _bias(linear_cell) -> tuple:
        return () if linear_cell.bias is None else (linear_cell.bias,)

    def _norm(self, name: str) -> tuple:
        """The latent norm ``name``'s weight, none without the norms (``qk_layernorm: false``)."""
        return (getattr(self, name).weight,) if self.qk_layernorm else ()

    head_offset = 0
    """The global index of this cell's first head (tensor parallelism sets it): attention
    dropout's mask is drawn per global head."""

    def construct(self, x, cos, sin, mask_add):
        if eager_mla_ready(self, mask_add) and attention_keep(self, self.num_heads, mask_add.shape[-1]) is None:
            return eager_mla(self, x, cos, sin, mask_add, *self.piece_weights("forward"))
        q, kv_lat, k_rot = self.run("project", x, cos, sin)
        if self.kv_exchange is not None:
            kv_lat, k_rot = self.kv_exchange(kv_lat, k_rot)
        keep = attention_keep(self, q.shape[1], mask_add.shape[-1])  # every key of the sequence
        if keep is not None or overridden(self.core_attention):  # the core runs eager: the pieces around it
            k, v = self.run("keys_values", q, kv_lat, k_rot)
            if self.track_max_logits:
                self.note_max_logits(self.core_attention.head_max_eager(q, k, mask_add))
            core = self.core_attention(q, k, v, mask_add) if keep is None else \
                self.core_attention(q, k, v, mask_add, keep)
            return self.run("output", core[0] if isinstance(core, tuple) else core)
        return take_max_logits(self, self.run("attend", q, kv_lat, k_rot, mask_add))

    def forward(self, x, cos, sin, mask_add, *w):
        """:meth:`construct`'s math on the weights ``w`` (``piece_weights("forward")``), as one
        piece of a layer compiled whole (no context-parallel exchange, no eager core)."""
        q, kv_lat, k_rot = self.project(x, cos, sin, *w[:self.n_project])
        return self.attend(q, kv_lat, k_rot, mask_add, *w[self.n_project:])

    # ``construct`` in pieces around the context-parallel exchange and an eager core.
    def project(self, x, cos, sin, *w):
        """Queries [B,N,S,qk_head_dim] (softmax scale folded in), the normed latent
        ``kv_lat`` [B,S,kv_lora] and the roped key ``k_rot`` [B,1,S,rope] of ``x`` [B,S,H]."""
        b, s, _ = x.shape
        n = self.num_heads
        t = b * s
        cd = self.matmul_dtype
        x2 = x.reshape(t, -1)
        xc = to_compute(x2, cd)
        cos = cos.reshape(b, s, 1, self.rope)
        sin = sin.reshape(b, s, 1, self.rope)

        if self.q_lora_rank is None:
            q_in, wq, i = xc, w[0], 1
            if self.q_proj.lora_dropout:  # LoRA dropout: each adapter's own input (Linear.lora_input)
                q_in = self.q_proj.lora_input(xc)
        else:
            j = 2 if self.attention_bias else 1
            q_x = self.q_a_proj.lora_input(x2) if self.q_a_proj.lora_dropout else x2
            q_lat = linear(q_x, w[0], w[1] if self.attention_bias else None, cd)
            if self.qk_layernorm:
                q_in, wq, i = to_compute(self.q_a_layernorm.apply(q_lat, w[j]), cd), w[j + 1], j + 2
            else:
                q_in, wq, i = to_compute(q_lat, cd), w[j], j + 1
            if self.q_b_proj.lora_dropout:
                q_in = self.q_b_proj.lora_input(q_in)
        # the softmax scale is folded into the query weights (cheaper than scaling [S, S])
        wq = wq.reshape(n, self.qk_head_dim, -1) * self.scaling
        wq_nope = wq[:, :self.nope].reshape(n * self.nope, -1)
        wq_rot, wq_half = self._rope_rows(wq[:, self.nope:], n)
        q_nope = self.matmul_t(q_in, to_compute(wq_nope, cd)).reshape(b, s, n, self.nope)
        q_rot = (self.matmul_t(q_in, to_compute(wq_rot, cd)).reshape(b, s, n, self.rope) * cos
                 + self.matmul_t(q_in, to_compute(wq_half, cd)).reshape(b, s, n, self.rope) * sin)
        q = ops.transpose(ops.concat((q_nope, to_compute(q_rot, cd)), -1), (0, 2, 1, 3))

        wkv = w[i]
        if self.kv_a_proj_with_mqa.lora_dropout:
            xc = self.kv_a_proj_with_mqa.lora_input(xc)
        kv_lat = self.matmul_t(xc, to_compute(wkv[:self.kv_lora_rank], cd))
        wk_rot, wk_half = self._rope_rows(wkv[self.kv_lora_rank:].reshape(1, self.rope, -1), 1)
        k_rot = self.matmul_t(xc, to_compute(wk_rot, cd))
        k_half = self.matmul_t(xc, to_compute(wk_half, cd))
        if self.attention_bias:
            bkv = w[i + 1]
            kv_lat = kv_lat + bkv[:self.kv_lora_rank]
            brot, bhalf = self._rope_rows(bkv[self.kv_lora_rank:].reshape(1, self.rope, 1), 1)
            k_rot = k_rot + brot.reshape(-1)
            k_half = k_half + bhalf.reshape(-1)
        if self.qk_layernorm:
            kv_lat = self.kv_a_layernorm.apply(kv_lat, w[-1])
        kv_lat = kv_lat.reshape(b, s, self.kv_lora_rank)
        k_rot = (k_rot.reshape(b, s, self.rope) * cos.reshape(b, s, self.rope)
                 + k_half.reshape(b, s, self.rope) * sin.reshape(b, s, self.rope)).reshape(b, 1, s, self.rope)
        return q, kv_lat, k_rot

    def attend(self, q, kv_lat, k_rot, mask_add, *w):
        """Attention of the queries ``q`` over the keys and values made from ``kv_lat``
        [B,Sk,kv_lora] and ``k_rot`` [B,1,Sk,rope], through ``o_proj``: [B,S,H]; ``w`` is
        ``kv_b_proj``'s weight, then ``o_proj``'s."""
        k, v = self.keys_values(q, kv_lat, k_rot, w[0])
        out = self.core_attention(q, k, v, mask_add)
        if self.track_max_logits:  # (output, per-head max logit [N]): see track_max_attention_logits
            out, rows = out
            return self.output(out, *w[1:]), ops.amax(rows, (0, 2))
        return self.output(out, *w[1:])

    def keys_values(self, q, kv_lat, k_rot, kv_b):
        """Keys [B,N,Sk,qk_head_dim] and values [B,N,Sk,dv] of the latent and roped key."""
        b, n = q.shape[0], self.num_heads
        cd = self.matmul_dtype
        sk = kv_lat.shape[1]
        wkvb = kv_b.reshape(n, self.nope + self.v_dim, -1)
        lat2 = to_compute(kv_lat.reshape(b * sk, self.kv_lora_rank), cd)
        if self.kv_b_proj.lora_dropout:
            lat2 = self.kv_b_proj.lora_input(lat2)
        k_nope = self.matmul_t(lat2, to_compute(wkvb[:, :self.nope].reshape(n * self.nope, -1), cd))
        v = self.matmul_t(lat2, to_compute(wkvb[:, self.nope:].reshape(n * self.v_dim, -1), cd))
        k_nope = ops.transpose(k_nope.reshape(b, sk, n, self.nope), (0, 2, 1, 3))
        v = ops.transpose(v.reshape(b, sk, n, self.v_dim), (0, 2, 1, 3))
        k = ops.concat((k_nope, ops.broadcast_to(to_compute(k_rot, cd), (b, n, sk, self.rope))), -1)
        return k, v

    def output(self, out, o_w, o_b=None):
        """The heads' outputs [B,N,S,dv] through ``o_proj`` (weight ``o_w``, bias ``o_b``): [B,S,H]."""
        b, n, s = out.shape[0], out.shape[1], out.shape[2]
        out = ops.transpose(out, (0, 2, 1, 3)).reshape(b, s, n * self.v_dim)
        if self.o_proj.lora_dropout:
            out = self.o_proj.lora_input(out)
        return linear(out, o_w, o_b, self.matmul_dtype)


def attention_keep(cell, heads: int, keys: int):
    """Attention dropout's keep-and-scale mask [B, heads, S, keys] for ``cell``'s core in
    this forward, or None when attention dropout is off (see :mod:`mindtrain.models.dropout`)."""
    state = dropout_of(cell)
    if state is None or not state.attention_on():
        return None
    return state.attention_mask(cell.__dict__["_layer_index"], heads, cell.head_offset, keys)


# ---------------------------------------------------------------------- max attention logits
# MindFormers' ``track_max_attention_logit`` (its flash attention's ``max_logits_val``): per
# layer and head, the largest pre-softmax logit of the step's forwards, which Muon's QK-clip
# and the MaxLogitsMonitor callback read. Here a compiled piece returns the maxima as one
# more output; the eager code that called it folds them into the attention cell's running
# maximum (a Python attribute, no Parameter, nothing written inside a graph).


def note_max_logits(cell, head_max) -> None:
    """Running maximum of ``cell``'s per-head max logits over the step's forwards."""
    prev = cell.__dict__.get("_max_logits")
    object.__setattr__(cell, "_max_logits", head_max if prev is None else ops.maximum(prev, head_max))


def take_max_logits(cell, out):
    """``out`` of a piece or layer that returns the max logits last while ``cell`` tracks
    them: folds them in (:func:`note_max_logits`) and returns the rest (one item: itself)."""
    if not cell.track_max_logits:
        return out
    note_max_logits(cell, out[-1])
    return out[0] if len(out) == 2 else out[:-1]


def attention_cells(model) -> list:
    """``(layer index, attention cell)`` of every decoder layer (and MTP module: its index in
    ``model.layers``) whose attention can track its max logits."""
    out = []
    for i, layer in enumerate(model.model.layers):
        attn = getattr(layer, "self_attn", None)
        if attn is not None and hasattr(type(attn), "track_max_logits"):
            out.append((i, attn))
    return out


def track_max_attention_logits(model, enabled: bool = True) -> None:
    """Make every attention of ``model`` record its per-head max pre-softmax logit
    (MindFormers' ``track_max_attention_logit``); off (the default) costs nothing. Set it
    before the model's first call: a compiled piece keeps the graph of its first call
    (MindSpore caches it by cell and method)."""
    for _, attn in attention_cells(model):
        attn.track_max_logits = bool(enabled)
        attn.core_attention.track_max_logits = bool(enabled)
        object.__setattr__(attn, "_max_logits", None)


def max_attention_logits(model, reset: bool = True) -> dict:
    """``{layer index: float32 array [local heads]}``: the max logits recorded since the
    last reset, of the layers that ran on this rank (this rank's heads under tensor
    parallelism); ``reset`` starts the next step's record."""
    out = {}
    for i, attn in attention_cells(model):
        m = attn.__dict__.get("_max_logits")
        if m is not None:
            out[i] = m.asnumpy().astype(np.float32).reshape(-1)
        if reset:
            object.__setattr__(attn, "_max_logits", None)
    return out
