"""Multi-token prediction module of DeepSeek-V3 (paper section 2.2).

Depth k combines the previous depth's hidden state h (the main model's last decoder output for
k = 1) with the embedding of token i+k: ``h' = eh_proj([enorm(emb); hnorm(h)])``, runs one
decoder block on it, and predicts token i+k+1 with the shared output head after its own
``shared_head.norm``. Embedding and output head are shared with the main model. Parameter
names follow the official checkpoint: ``model.layers.{num_hidden_layers + k - 1}.*``.
"""

from __future__ import annotations

import mindspore as ms
from mindtrain.config.plan import MOE_BLOCK
from mindspore import nn, ops

from mindtrain.models.attention import take_max_logits
from mindtrain.models.blocks import call_graph
from mindtrain.models.decoder import DecoderLayer
from mindtrain.models.linear import Linear, linear
from mindtrain.models.norm import RMSNorm


class SharedHead(nn.Cell):
    """Holds the MTP module's own final norm (``shared_head.norm``); the head weight is shared."""

    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.norm = RMSNorm(hidden_size, eps)

    def construct(self, h):
        return self.norm(h)


class MTPLayer(DecoderLayer):
    """``construct(h_prev, emb_next, cos, sin, mask_add)`` -> (h, tokens per expert, balance loss)."""

    def __init__(self, cfg, layer_idx: int, moe_block: int = MOE_BLOCK):
        super().__init__(cfg, layer_idx, moe_block)
        self.enorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hnorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.eh_proj = Linear(2 * cfg.hidden_size, cfg.hidden_size, init_std=cfg.initializer_range)
        self.shared_head = SharedHead(cfg.hidden_size, cfg.rms_norm_eps)

    def piece_weights(self, name: str) -> tuple:
        # the decoder block's, then enorm, hnorm, eh_proj (shared_head.norm runs with the head)
        return DecoderLayer.piece_weights(self, name) + (self.enorm.weight, self.hnorm.weight, self.eh_proj.merged_weight())

    def construct(self, h_prev, emb_next, cos, sin, mask_add):
        whole = self.whole_graph()
        if whole is not None:
            return take_max_logits(self.self_attn, call_graph(whole, h_prev, emb_next, cos, sin, mask_add,
                                                              *self.piece_weights("forward")))
        h = self.eh_proj(ops.concat((self.enorm(emb_next), self.hnorm(h_prev)), -1))
        if h.dtype != ms.float32:  # mixed precision: the residual stream stays float32
            h = ops.cast(h, ms.float32)
        return self.compose(h, cos, sin, mask_add)

    def forward(self, h_prev, emb_next, cos, sin, mask_add, *w):
        """The module's math on its weights ``w`` (:meth:`piece_weights`)."""
        x = ops.concat((self.enorm.apply(emb_next, w[-3]), self.hnorm.apply(h_prev, w[-2])), -1)
        if self.eh_proj.lora_dropout:  # [x, dropout(x)] for the unmerged adapter (w[-1] is [H, 4H] then)
            x = self.eh_proj.lora_input(x)
        h = linear(x, w[-1], None, self.eh_proj.matmul_dtype)
        if h.dtype != ms.float32:
            h = ops.cast(h, ms.float32)
        return self.block(h, cos, sin, mask_add, *w[:-3])
