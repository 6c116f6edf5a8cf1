"""One DeepSeek-V3 decoder layer: pre-norm MLA attention, then a dense MLP or a MoE."""

from __future__ import annotations

import mindspore as ms
from mindtrain.config.plan import MOE_BLOCK
from mindspore import ops

from mindtrain.models.attention import MLAttention, take_max_logits
from mindtrain.models.blocks import Block, call_graph, overridden
from mindtrain.models.dropout import HIDDEN_ATTENTION, HIDDEN_MLP, dropout_of, hidden_dropout
from mindtrain.models.mlp import MLP
from mindtrain.models.moe import MoE
from mindtrain.models.norm import RMSNorm


class DecoderLayer(Block):
    """``construct(h, cos, sin, mask_add)`` -> (h, tokens per expert [E] or [1], balance loss).

    Dense layers return a zero balance loss and a dummy count so all layers have one signature
    (which keeps each layer a single ms.jit graph).

    Two ways to run, one math: :meth:`construct` goes through the sub-cells (each may be
    compiled on its own, or wrapped by a layout); :meth:`forward` is the same math on the
    weights it is given (``piece_weights("forward")``), which a compiled layer runs whole.
    """

    PIECES = ("forward",)

    def __init__(self, cfg, layer_idx: int, moe_block: int = MOE_BLOCK):
        super().__init__()
        self.is_moe = layer_idx >= cfg.first_k_dense_replace
        self.self_attn = MLAttention(cfg)
        if self.is_moe:
            self.mlp = MoE(cfg, block=moe_block)
        else:
            self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size, init_std=cfg.initializer_range)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.n_attention = len(self.self_attn.piece_weights("forward"))

    def _parts(self) -> tuple:
        return (self.input_layernorm, self.self_attn, self.post_attention_layernorm, self.mlp)

    def piece_weights(self, name: str) -> tuple:
        return sum((cell.piece_weights("forward") for cell in self._parts()), ())

    def can_run_whole(self) -> bool:
        """True while nothing inside the layer is wrapped by a layout or runs eager by design
        (an eager attention core, a context-parallel exchange, a sequence reduction): then
        :meth:`forward` computes what :meth:`construct` does."""
        attn, mlp = self.self_attn, self.mlp
        return (attn.kv_exchange is None and dropout_of(self) is None and not self.has_lora_dropout()
                and getattr(mlp, "sequence_reduce", None) is None
                and not any(overridden(c) for name, c in self.cells_and_names() if name))

    def whole_graph(self):
        """The layer's compiled :meth:`forward` while it may run (:meth:`can_run_whole`), else None."""
        return self.graph("forward") if self.can_run_whole() else None

    def functional(self):
        if not self.can_run_whole() or any(getattr(c, "lora_scaling", None) is not None
                                           for _, c in self.cells_and_names()):
            # LoRA: the weights it would run on are merged (W + s * B @ A), not Parameters
            return None
        return self.graph("forward") or self.forward, self.piece_weights("forward")

    def construct(self, h, cos, sin, mask_add):
        whole = self.whole_graph()
        if whole is not None:
            return take_max_logits(self.self_attn, call_graph(whole, h, cos, sin, mask_add,
                                                              *self.piece_weights("forward")))
        return self.compose(h, cos, sin, mask_add)

    def forward(self, h, cos, sin, mask_add, *w):
        """The layer's math on its weights ``w``."""
        return self.block(h, cos, sin, mask_add, *w)

    def block(self, h, cos, sin, mask_add, *w):
        """Attention and MLP/MoE with their norms and residuals, on the weights ``w``; while
        the attention tracks its max logits, they come last (``construct`` takes them)."""
        cos, sin, mask_add = ops.stop_gradient(cos), ops.stop_gradient(sin), ops.stop_gradient(mask_add)
        a = self.n_attention
        x = self.input_layernorm.apply(h, w[0])
        if self.self_attn.track_max_logits:
            attn, head_max = self.self_attn.forward(x, cos, sin, mask_add, *w[1:a + 1])
            h, counts, balance = self._mlp_block(h + attn, *w[a + 1:])
            return h, counts, balance, head_max
        return self._mlp_block(h + self.self_attn.forward(x, cos, sin, mask_add, *w[1:a + 1]), *w[a + 1:])

    def _mlp_block(self, h, *w):
        """The MLP/MoE half of :meth:`block` on ``w`` (its norm's weight, then the MLP's)."""
        x = self.post_attention_layernorm.apply(h, w[0])
        if self.is_moe:
            y, counts, balance = self.mlp.forward(x, *w[1:])
            return h + y, counts, balance
        y = self.mlp.forward(x, *w[1:])
        return h + y, ops.zeros((1,), ms.int32), ops.zeros((), h.dtype)

    def compose(self, h, cos, sin, mask_add):
        """The layer through its sub-cells."""
        # no gradient flows to the rope tables or the mask; saying so keeps the compiled
        # backward from materialising their (large) zero gradients
        cos, sin, mask_add = ops.stop_gradient(cos), ops.stop_gradient(sin), ops.stop_gradient(mask_add)
        h = h + self.hidden_dropout(self.self_attn(self.input_layernorm(h), cos, sin, mask_add), HIDDEN_ATTENTION)
        if self.is_moe:
            y, counts, balance = self.mlp(self.post_attention_layernorm(h))
            return h + self.hidden_dropout(y, HIDDEN_MLP), counts, balance
        y = self.mlp(self.post_attention_layernorm(h))
        return h + self.hidden_dropout(y, HIDDEN_MLP), ops.zeros((1,), ms.int32), ops.zeros((), h.dtype)

    def hidden_dropout(self, y, site: int):
        """``y`` [B, S, H] (a residual branch's output) with hidden dropout applied in a
        training step (MindFormers' ``hidden_states_dropout`` before the residual add), else
        ``y``; the mask is :class:`~mindtrain.models.dropout.Dropout`'s, the same in every layout."""
        return hidden_dropout(self, y, site)
