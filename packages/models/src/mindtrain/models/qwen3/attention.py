"""Qwen3's attention: grouped-query attention with per-head RMSNorm on queries and keys."""

from __future__ import annotations

import mindspore as ms
import numpy as np
from mindspore import Tensor, ops

from mindtrain.config.families import head_dim
from mindtrain.config.plan import Region
from mindtrain.models.attention import CoreAttention, attention_keep, note_max_logits, take_max_logits
from mindtrain.models.blocks import Block, overridden
from mindtrain.models.linear import Linear, linear
from mindtrain.models.norm import RMSNorm
from mindtrain.models.precision import to_compute


def rotate_half_matrix(d: int) -> np.ndarray:
    """[d, d] float32 ``R`` with ``x @ R == rotate_half(x) == concat(-x[d/2:], x[:d/2])``: one
    matmul with exact 0/±1 entries instead of strided slices of the activations (slow on CPU)."""
    half = d // 2
    r = np.zeros((d, d), np.float32)
    r[np.arange(half) + half, np.arange(half)] = -1.0
    r[np.arange(half), np.arange(half) + half] = 1.0
    return r


class Qwen3Attention(Block):
    """HF Qwen3Attention's math and parameter names: ``q_proj``, ``k_proj``, ``v_proj`` and
    ``o_proj`` (with biases under ``attention_bias``), ``q_norm`` and ``k_norm`` (RMSNorm over
    ``head_dim``, applied per head before rope; neither under ``qk_layernorm: false``, as
    MindFormers builds it).

    ``construct(x [B,S,H], cos, sin [B,1,S,head_dim], mask_add [B,N,S,Sk] additive)`` -> [B,S,H].
    ``num_key_value_heads`` heads of keys and values each serve ``num_attention_heads /
    num_key_value_heads`` query heads (HF's ``repeat_kv``): the queries of a group are laid
    out as one block of ``group x S`` rows against their key/value head, so keys and values
    are never copied. The softmax scale ``head_dim**-0.5`` is folded into the ``q_norm``
    weight (a [head_dim] product instead of scaling the [S, Sk] scores; without the norms, into
    the queries).

    ``kv_exchange`` (None by default) is a context-parallel hook as in MLA: a callable taking
    this rank's roped keys and values ``[B, Nkv, S, head_dim]`` and returning those of the
    whole sequence (the context-parallel layout sets it).
    """

    REGION = Region.declare("attention")  # its region in the parallel plan (mindtrain.models.parallel_plan)

    matmul_dtype = None
    fast_kernels = False
    track_max_logits = False  # see mindtrain.models.attention.track_max_attention_logits
    PIECES = ("project", "attend", "output")

    def __init__(self, cfg):
        super().__init__()
        std = cfg.initializer_range
        h = cfg.hidden_size
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = head_dim(cfg)
        n, kv, d = self.num_heads, self.num_kv_heads, self.head_dim
        bias = bool(cfg.attention_bias)
        self.attention_bias = bias
        self.q_proj = Linear(h, n * d, bias=bias, init_std=std)
        self.k_proj = Linear(h, kv * d, bias=bias, init_std=std)
        self.v_proj = Linear(h, kv * d, bias=bias, init_std=std)
        self.o_proj = Linear(n * d, h, bias=bias, init_std=std)
        self.qk_layernorm = bool(getattr(cfg, "qk_layernorm", True))
        if self.qk_layernorm:  # MindFormers' qk_layernorm: false builds neither (its IdentityOp)
            self.q_norm = RMSNorm(d, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.scaling = float(d) ** -0.5
        self.core_attention = CoreAttention()
        self.kv_exchange = None
        self.matmul = ops.MatMul()
        self._rotate = Tensor(rotate_half_matrix(d), ms.float32)
        self.n_project = len(self.piece_weights("project"))

    def piece_weights(self, name: str) -> tuple:
        if name == "project":
            out: tuple = ()
            for proj in (self.q_proj, self.k_proj, self.v_proj):
                out += (proj.merged_weight(),) + self._bias(proj)
            return out + ((self.q_norm.weight, self.k_norm.weight) if self.qk_layernorm else ())
        if name in ("output", "attend"):
            return (self.o_proj.merged_weight(),) + self._bias(self.o_proj)
        return self.piece_weights("project") + self.piece_weights("attend")  # "forward": the whole

    @staticmethod
    def _bias(linear_cell) -> tuple:
        return () if linear_cell.bias is None else (linear_cell.bias,)

    head_offset = 0
    """The global index of this cell's first query head (tensor parallelism sets it)."""

    def construct(self, x, cos, sin, mask_add):
        q, k, v = self.run("project", x, cos, sin)
        if self.kv_exchange is not None:  # context parallelism: the whole sequence's keys and values
            k, v = self.kv_exchange(k, v)
        keep = attention_keep(self, self.num_heads, mask_add.shape[-1])  # every key of the sequence
        if keep is not None:  # attention dropout: an eager core over the repeated keys and values
            g = self.num_heads // self.num_kv_heads
            k, v = self._repeat_kv(k, g), self._repeat_kv(v, g)
            if self.track_max_logits:
                self.note_max_logits(self.core_attention.head_max_eager(q, k, mask_add))
            out = self.core_attention(q, k, v, mask_add, keep)
            return self.run("output", out[0] if isinstance(out, tuple) else out)
        if overridden(self.core_attention):  # the core runs eager (in blocks of rows): the pieces around it
            if self.track_max_logits:
                g = self.num_heads // self.num_kv_heads
                self.note_max_logits(self.core_attention.head_max_eager(q, self._repeat_kv(k, g), mask_add))
            return self.run("output", self.grouped_core(q, k, v, mask_add))
        return take_max_logits(self, self.run("attend", q, k, v, mask_add))

    def note_max_logits(self, head_max) -> None:
        """Fold one forward's per-head max logits ([N] of this rank's heads) into the step's."""
        note_max_logits(self, head_max)

    def forward(self, x, cos, sin, mask_add, *w):
        """:meth:`construct`'s math on the weights ``w`` (``piece_weights("forward")``), as one
        piece of a layer compiled whole."""
        q, k, v = self.project(x, cos, sin, *w[:self.n_project])
        return self.attend(q, k, v, mask_add, *w[self.n_project:])

    def project(self, x, cos, sin, *w):
        """Queries [B,N,S,d] (normed, softmax scale folded in, roped), keys [B,Nkv,S,d] (normed,
        roped) and values [B,Nkv,S,d] of ``x`` [B,S,H]."""
        b, s, _ = x.shape
        n, kv, d = self.num_heads, self.num_kv_heads, self.head_dim
        cd = self.matmul_dtype
        x2 = x.reshape(b * s, -1)
        xq = xk = xv = x2
        if self.q_proj.lora_dropout:  # LoRA dropout: each adapter's own input (Linear.lora_input)
            xq = self.q_proj.lora_input(x2)
        if self.k_proj.lora_dropout:
            xk = self.k_proj.lora_input(x2)
        if self.v_proj.lora_dropout:
            xv = self.v_proj.lora_input(x2)
        if self.attention_bias:
            q = linear(xq, w[0], w[1], cd)
            k = linear(xk, w[2], w[3], cd)
            v = linear(xv, w[4], w[5], cd)
        else:
            q = linear(xq, w[0], None, cd)
            k = linear(xk, w[1], None, cd)
            v = linear(xv, w[2], None, cd)
        if self.qk_layernorm:
            q = self.q_norm.apply(q.reshape(b * s * n, d), w[-2] * self.scaling)   # float32
            k = self.k_norm.apply(k.reshape(b * s * kv, d), w[-1])
        else:  # no norms (qk_layernorm: false): the scale alone, float32 as the norms' output
            q = ops.cast(q.reshape(b * s * n, d), ms.float32) * self.scaling
            k = ops.cast(k.reshape(b * s * kv, d), ms.float32)
        cos = cos.reshape(b, s, 1, d)
        sin = sin.reshape(b, s, 1, d)
        q = ops.transpose(self._rope(q, cos, sin, b, s, n), (0, 2, 1, 3))
        k = ops.transpose(self._rope(k, cos, sin, b, s, kv), (0, 2, 1, 3))
        v = ops.transpose(v.reshape(b, s, kv, d), (0, 2, 1, 3))
        return to_compute(q, cd), to_compute(k, cd), v

    def _rope(self, x, cos, sin, b: int, s: int, heads: int):
        """``x * cos + rotate_half(x) * sin`` of ``x`` [B*S*heads, d] -> [B, S, heads, d]."""
        d = self.head_dim
        rotated = self.matmul(x, self._rotate).reshape(b, s, heads, d)
        return x.reshape(b, s, heads, d) * cos + rotated * sin

    def attend(self, q, k, v, mask_add, *w):
        """Attention of the queries ``q`` over the keys ``k`` and values ``v`` of their groups,
        through ``o_proj`` (weight, then bias): [B,S,H]."""
        out = self.grouped_core(q, k, v, mask_add)
        if self.track_max_logits:  # (output, per-query-head max logit [N])
            out, head_max = out
            return self.output(out, *w), head_max
        return self.output(out, *w)

    def grouped_core(self, q, k, v, mask_add):
        """softmax(q kᵀ + mask) v with each key/value head serving its group of query heads:
        q [B,N,S,d], k and v [B,Nkv,Sk,d] -> [B,N,S,d]. A group's queries are one block of
        ``group x S`` rows (a reshape, as are the mask's), so the core sees Nkv heads and
        keys and values are not copied."""
        b, n, s, d = q.shape
        sk = k.shape[2]
        kv = self.num_kv_heads
        g = n // kv
        if g == 1:
            out = self.core_attention(q, k, v, mask_add)
            if self.track_max_logits and not overridden(self.core_attention):  # an eager core: the output only
                return out[0], ops.amax(out[1], (0, 2))
            return out
        if overridden(self.core_attention):
            # an eager core in causal row blocks (recompute): per-head square blocks keep its
            # skipping of the keys the mask blocks, so each key/value head is repeated instead
            return self.core_attention(q, self._repeat_kv(k, g), self._repeat_kv(v, g), mask_add)
        if mask_add.shape[0] != b or mask_add.shape[1] != n:
            mask_add = ops.broadcast_to(mask_add, (b, n, s, sk))
        out = self.core_attention(q.reshape(b, kv, g * s, d), k, v, mask_add.reshape(b, kv, g * s, sk))
        if self.track_max_logits:  # row maxima [B, Nkv, g * S]: query head kv_head * g + j
            out, rows = out
            return out.reshape(b, n, s, d), ops.amax(rows.reshape(b, kv, g, s), (0, 3)).reshape(n)
        return out.reshape(b, n, s, d)

    @staticmethod
    def _repeat_kv(x, g: int):
        """[B, Nkv, Sk, d] -> [B, Nkv * g, Sk, d], each head repeated g times (HF's repeat_kv)."""
        b, kv, sk, d = x.shape
        return ops.broadcast_to(x.reshape(b, kv, 1, sk, d), (b, kv, g, sk, d)).reshape(b, kv * g, sk, d)

    def output(self, out, o_w, o_b=None):
        """The heads' outputs [B,N,S,d] through ``o_proj`` (weight ``o_w``, bias ``o_b``): [B,S,H]."""
        b, n, s = out.shape[0], out.shape[1], out.shape[2]
        out = ops.transpose(out, (0, 2, 1, 3)).reshape(b, s, n * self.head_dim)
        if self.o_proj.lora_dropout:
            out = self.o_proj.lora_input(out)
        return linear(out, o_w, o_b, self.matmul_dtype)
