"""Multi-head latent attention (MLA) of DeepSeek-V2/V3 with decoupled rope keys."""

from __future__ import annotations

from mindspore import nn, ops

from mindtrain.models.linear import Linear
from mindtrain.models.norm import RMSNorm
from mindtrain.models.rope import apply_rotary, deinterleave, softmax_scale
from mindtrain.models.softmax import Softmax


class MLAttention(nn.Cell):
    """HF DeepseekV3Attention's math and parameter names (q_a_proj/q_a_layernorm/q_b_proj or
    q_proj, kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj, o_proj).

    ``construct(x [B,S,H], cos, sin [B,1,S,rope], mask_add [B,N|1,S,Sk] additive)`` -> [B,S,H].

    ``kv_exchange`` (None by default) is the context-parallel hook: a callable taking this
    rank's latent ``kv_lat [B,S,kv_lora]`` and roped ``k_rot [B,1,S,rope]`` and returning
    those of the whole sequence (``Sk`` keys); the mask then has ``Sk`` columns.
    """

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
        if self.q_lora_rank is None:
            self.q_proj = Linear(h, self.num_heads * self.qk_head_dim, init_std=std)
        else:
            self.q_a_proj = Linear(h, self.q_lora_rank, bias=bias, init_std=std)
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, cfg.rms_norm_eps)
            self.q_b_proj = Linear(self.q_lora_rank, self.num_heads * self.qk_head_dim, init_std=std)
        self.kv_a_proj_with_mqa = Linear(h, self.kv_lora_rank + self.rope, bias=bias, init_std=std)
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, cfg.rms_norm_eps)
        self.kv_b_proj = Linear(self.kv_lora_rank, self.num_heads * (self.nope + self.v_dim), init_std=std)
        self.o_proj = Linear(self.num_heads * self.v_dim, h, bias=bias, init_std=std)
        self.scaling = softmax_scale(self.qk_head_dim, cfg.rope_scaling)
        self.softmax = Softmax()
        self.bmm_t = ops.BatchMatMul(transpose_b=True)
        self.bmm = ops.BatchMatMul()
        self.kv_exchange = None

    def construct(self, x, cos, sin, mask_add):
        b, s, _ = x.shape
        n = self.num_heads
        if self.q_lora_rank is None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        # the softmax scale is folded into q (cheaper than scaling the [S, S] scores)
        q = ops.transpose(q.reshape(b, s, n, self.qk_head_dim), (0, 2, 1, 3)) * self.scaling
        q_nope = q[..., :self.nope]
        q_rot = q[..., self.nope:]

        ckv = self.kv_a_proj_with_mqa(x)
        kv_lat = self.kv_a_layernorm(ckv[..., :self.kv_lora_rank])
        k_rot = ckv[..., self.kv_lora_rank:].reshape(b, 1, s, self.rope)
        if self.rope_interleave:
            q_rot = deinterleave(q_rot)
            k_rot = deinterleave(k_rot)
        q_rot = apply_rotary(q_rot, cos, sin)
        k_rot = apply_rotary(k_rot, cos, sin)
        if self.kv_exchange is not None:
            kv_lat, k_rot = self.kv_exchange(kv_lat, k_rot)
        sk = kv_lat.shape[1]

        kv = ops.transpose(self.kv_b_proj(kv_lat).reshape(b, sk, n, self.nope + self.v_dim), (0, 2, 1, 3))
        k_nope = kv[..., :self.nope]
        v = kv[..., self.nope:]
        k = ops.concat((k_nope, ops.broadcast_to(k_rot, (b, n, sk, self.rope))), -1)
        q = ops.concat((q_nope, q_rot), -1)

        scores = self.bmm_t(q, k) + mask_add
        probs = self.softmax(scores)
        out = self.bmm(probs, v)
        out = ops.transpose(out, (0, 2, 1, 3)).reshape(b, s, n * self.v_dim)
        return self.o_proj(out)
