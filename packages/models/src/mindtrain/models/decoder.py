"""One DeepSeek-V3 decoder layer: pre-norm MLA attention, then a dense MLP or a MoE."""

from __future__ import annotations

import mindspore as ms
from mindspore import Tensor, nn, ops

from mindtrain.models.attention import MLAttention
from mindtrain.models.mlp import MLP
from mindtrain.models.moe import MoE
from mindtrain.models.norm import RMSNorm


class DecoderLayer(nn.Cell):
    """``construct(h, cos, sin, mask_add)`` -> (h, tokens per expert [E] or [1], balance loss).

    Dense layers return a zero balance loss and a dummy count so all layers have one signature
    (which keeps each layer a single ms.jit graph).
    """

    def __init__(self, cfg, layer_idx: int, moe_block: int = 32):
        super().__init__()
        self.layer_idx = layer_idx
        self.is_moe = layer_idx >= cfg.first_k_dense_replace
        self.self_attn = MLAttention(cfg)
        if self.is_moe:
            self.mlp = MoE(cfg, block=moe_block)
        else:
            self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size, init_std=cfg.initializer_range)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def construct(self, h, cos, sin, mask_add):
        # no gradient flows to the rope tables or the mask; saying so keeps the compiled
        # backward from materialising their (large) zero gradients
        cos, sin, mask_add = ops.stop_gradient(cos), ops.stop_gradient(sin), ops.stop_gradient(mask_add)
        h = h + self.self_attn(self.input_layernorm(h), cos, sin, mask_add)
        if self.is_moe:
            y, counts, balance = self.mlp(self.post_attention_layernorm(h))
            return h + y, counts, balance
        y = self.mlp(self.post_attention_layernorm(h))
        return h + y, ops.zeros((1,), ms.int32), ops.zeros((), h.dtype)
