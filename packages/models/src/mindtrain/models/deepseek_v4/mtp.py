"""DeepSeek-V4's multi-token prediction, as MindFormers' PyNative ``MultiTokenPredictionLayer``
combines it with the hyper-connection streams (``mindformers/pynative/transformers/
multi_token_prediction.py``; HF's DeepseekV4ForCausalLM builds no MTP modules).

Depth k (1 .. num_nextn_predict_layers) takes the previous depth's output ``h`` (for k = 1 the
main trunk's streams collapsed and through the final norm, as MindFormers' GPTModel hands its
decoder output to the MTP block) and the embeddings of the tokens shifted left by k:

    x = eh_proj([enorm(embed(ids_k)); hnorm(h)])          # [B, S, H]
    streams = x copied onto the hc_mult streams             # [B, S, N, H]
    streams = one V4 decoder layer (its attention variant; learned routing, never hashed)
    h_k = shared_head.norm(collapse(streams))               # hc_head, or the streams' mean

and the shared output head predicts the labels shifted left by k from ``h_k``; the training
loss adds ``mtp_loss_scaling_factor x mean_k(loss_k)`` (MindFormers' ``process_mtp_loss``:
scale / depths per depth). Parameter names: ``model.layers.{num_hidden_layers + k - 1}.*``,
the decoder layer's plus ``enorm``, ``hnorm``, ``eh_proj``, ``shared_head.norm`` (MindFormers'
``final_layernorm``) and, with ``enable_hc_head``, ``hc_head``.
"""

from __future__ import annotations

from mindspore import nn, ops

from mindtrain.config.plan import MOE_BLOCK
from mindtrain.models.deepseek_v4.hyper import HyperHead, StreamMean
from mindtrain.models.deepseek_v4.mla import DeepseekV4MLALayer
from mindtrain.models.linear import Linear
from mindtrain.models.mtp import SharedHead
from mindtrain.models.norm import RMSNorm


class _MTPParts:
    """What a V4 MTP module adds to its decoder layer."""

    def _add_mtp_parts(self, cfg) -> None:
        self.enorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hnorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.eh_proj = Linear(2 * cfg.hidden_size, cfg.hidden_size, init_std=cfg.initializer_range)
        self.shared_head = SharedHead(cfg.hidden_size, cfg.rms_norm_eps)
        self.hc_mult = cfg.hc_mult if cfg.enable_hyper_connections else 0  # 0: no streams (plain residual)
        if self.hc_mult:
            self.hc_head = HyperHead(cfg) if cfg.enable_hc_head else StreamMean()

    def predict(self, h_prev, emb_next, ids_next, *tables):
        """One depth: ``(the streams collapsed [B,S,H] (before shared_head.norm), the same
        through shared_head.norm (the next depth's input), tokens per expert, balance)``.
        The layer's ``construct`` (so that what wraps a layer's call, a ZeRO-3 unit or a
        recompute, wraps it)."""
        x = self.eh_proj(ops.concat((self.enorm(emb_next), self.hnorm(h_prev)), -1))
        b, s, d = x.shape
        streams = ops.broadcast_to(ops.expand_dims(x, 2), (b, s, self.hc_mult, d)) if self.hc_mult else x
        streams, counts, balance = self.block(streams, ids_next, *tables)
        collapsed = self.hc_head(streams) if self.hc_mult else streams
        return collapsed, self.shared_head.norm(collapsed), counts, balance


def mtp_layer(cfg, layer_idx: int, moe_block: int, hybrid_layer: type) -> nn.Cell:
    """The MTP module at ``model.layers[layer_idx]`` (``layer_idx >= num_hidden_layers``):
    the mla variant's, or one on ``hybrid_layer`` (the model's hybrid decoder layer class,
    given by the model so this module does not import it)."""
    if cfg.experimental_attention_variant == "mla":
        return DeepseekV4MLAMTPLayer(cfg, layer_idx, moe_block)
    return _hybrid_mtp_class(hybrid_layer)(cfg, layer_idx, moe_block)


_HYBRID_MTP: dict = {}


def _hybrid_mtp_class(base: type) -> type:
    if base not in _HYBRID_MTP:
        class DeepseekV4MTPLayer(_MTPParts, base):
            """An MTP module of the hybrid variant (its attention sliding-window)."""

            def __init__(self, cfg, layer_idx, moe_block):
                base.__init__(self, cfg, layer_idx, moe_block)
                self._add_mtp_parts(cfg)

            def block(self, streams, ids, *tables):
                return base.construct(self, streams, ids, *tables)

            def construct(self, h_prev, emb_next, ids_next, *tables):
                return self.predict(h_prev, emb_next, ids_next, *tables)

        _HYBRID_MTP[base] = DeepseekV4MTPLayer
    return _HYBRID_MTP[base]


class DeepseekV4MLAMTPLayer(_MTPParts, DeepseekV4MLALayer):
    """An MTP module of the ``mla`` variant."""

    def __init__(self, cfg, layer_idx: int, moe_block: int = MOE_BLOCK):
        DeepseekV4MLALayer.__init__(self, cfg, layer_idx, moe_block)
        self._add_mtp_parts(cfg)

    def block(self, streams, ids, *tables):
        return DeepseekV4MLALayer.construct(self, streams, ids, *tables)

    def construct(self, h_prev, emb_next, ids_next, *tables):
        return self.predict(h_prev, emb_next, ids_next, *tables)


def mtp_forward(model, h, depths, tables: dict):
    """MTP depths 1..len(depths) after the main trunk (``h``: its streams [B,S,N,H]);
    ``depths[k - 1]`` = depth k's (input_ids, labels, loss_mask) shifted left by k. Returns
    ``(losses per depth, counts, balances)``."""
    keys = tuple(tables)
    values = tuple(tables[k] for k in keys)
    n = model.num_layers
    h = model.model.norm(model.collapse(h))
    losses, counts, balances = [], [], []
    for k, (ids_k, labels_k, mask_k) in enumerate(depths, 1):
        layer = model.model.layers[n + k - 1]
        layer.self_attn.table_keys = keys
        c_k, h, c, bal = model._layer(n + k - 1)(h, model.model.embed_tokens(ids_k),
                                                 ids_k, *values)
        counts.append(c)
        balances.append(bal)
        norm = layer.shared_head.norm
        losses.append(model.head_loss(c_k, norm.weight, norm.eps, model.lm_head.merged_weight(), labels_k, mask_k))
    return losses, counts, balances


__all__ = ["DeepseekV4MLAMTPLayer", "mtp_forward", "mtp_layer"]
