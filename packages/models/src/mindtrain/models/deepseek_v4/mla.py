"""DeepSeek-V4's ``mla`` attention variant (MindFormers' ``experimental_attention_variant:
"mla"``): every layer's attention is DeepSeek-V3's multi-latent attention (the package's
:class:`~mindtrain.models.attention.MLAttention`, HF DeepseekV3Attention's math and names, so
its parallel-plan region and QK-clip carry over) inside V4's layer: hyper-connection streams
around it and the hash / learned mixture of experts after it, as MindFormers'
``get_gpt_layer_local_spec`` builds a ``HyperConnectionTransformerLayer`` with
``MLASelfAttention`` when ``multi_latent_attention`` is set and the variant is not
``dsv4_hybrid``. Attention is causal over the whole sequence (no sliding window, no
compressed entries); rope (and YaRN) is DeepSeek-V3's on the qk_rope_head_dim channels.
"""

from __future__ import annotations

import numpy as np
from mindspore import Tensor, nn, ops

from mindtrain.config.plan import MOE_BLOCK
from mindtrain.models.attention import MLAttention
from mindtrain.models.deepseek_v4.hyper import HyperConnection, hyper_update, plain_residual
from mindtrain.models.deepseek_v4.moe import DeepseekV4MoE
from mindtrain.models.dropout import HIDDEN_ATTENTION, HIDDEN_MLP, hidden_dropout
from mindtrain.models.inputs import additive, blocked_matrix
from mindtrain.models.norm import RMSNorm

TABLE_KEYS = ("mla_cos", "mla_sin", "mla_mask")


class DeepseekV4MLALayer(nn.Cell):
    """``self_attn`` (DeepSeek-V3's MLA), ``mlp`` (V4's), ``input_layernorm``,
    ``post_attention_layernorm``, ``attn_hc``, ``ffn_hc``: the parameter names of the hybrid
    layer but for the attention's. ``construct(streams [B,S,N,H], ids [B,S], *tables)`` ->
    (streams, tokens per expert [E], balance loss), the tables named by
    ``self_attn.table_keys`` (the model sets them) among which :data:`TABLE_KEYS`."""

    kind = "mla"

    def __init__(self, cfg, layer_idx: int, moe_block: int = MOE_BLOCK):
        super().__init__()
        self.is_moe = True
        self.self_attn = MLAttention(cfg)
        self.mlp = DeepseekV4MoE(cfg, hashed=layer_idx < cfg.num_hash_layers, block=moe_block)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hc = bool(cfg.enable_hyper_connections)
        if self.hc:  # false: plain residual adds (MindFormers' TransformerLayer)
            self.attn_hc = HyperConnection(cfg)
            self.ffn_hc = HyperConnection(cfg)

    def attention(self, x, tables: dict):
        b, s, _ = x.shape
        cos = ops.broadcast_to(tables["mla_cos"], (b,) + tuple(tables["mla_cos"].shape[1:]))
        sin = ops.broadcast_to(tables["mla_sin"], (b,) + tuple(tables["mla_sin"].shape[1:]))
        return self.self_attn(x, cos, sin, tables["mla_mask"])

    def construct(self, streams, ids, *values):
        tables = dict(zip(self.self_attn.table_keys, values))
        if not self.hc:
            return plain_residual(self, streams, ids, lambda x: self.attention(x, tables),
                                  lambda out, k: hidden_dropout(self, out, (HIDDEN_ATTENTION, HIDDEN_MLP)[k]))
        post, comb, x = self.attn_hc(streams)
        a = hidden_dropout(self, self.attention(self.input_layernorm(x), tables), HIDDEN_ATTENTION)
        streams = hyper_update(streams, post, comb, a)
        post, comb, x = self.ffn_hc(streams)
        y, counts, balance = self.mlp(self.post_attention_layernorm(x), ids)
        return hyper_update(streams, post, comb, hidden_dropout(self, y, HIDDEN_MLP)), counts, balance


def mla_tables(model, s: int, chunks=None, num_chunks: int = 1) -> dict:
    """The ``mla`` variant's tables of sequence length ``s``: DeepSeek-V3's cos / sin [1, 1,
    L, rope] of the tokens' positions (``model.model.rotary_emb``) and the causal additive
    mask [1, 1, L, S] of their queries against every key in sequence order (each broadcast
    over the batch). Without ``chunks`` the tokens are positions 0..S-1 (L = S); with
    ``chunks`` (context parallelism: this rank's chunk numbers of the ``num_chunks`` equal
    chunks) they are those chunks' tokens, and the keys are the whole sequence's, as
    DeepSeek-V3's attention all-gathers them (its ``kv_exchange``): DeepSeek-V3's colossal
    context parallelism, rows of the one-process mask."""
    key = ("v4-mla", s, chunks, num_chunks)
    cache = model._rope_mask_cache
    if key not in cache:
        c = s // num_chunks
        pos = np.concatenate([np.arange(k * c, (k + 1) * c) for k in (chunks or (0,))]).astype(np.int32)
        cos, sin = model.model.rotary_emb(Tensor(pos.reshape(1, -1)))
        if len(cache) > 8:
            cache.clear()
        mask = additive(blocked_matrix(None, 1, s), 1)[:, :, pos, :]
        cache[key] = {"mla_cos": ops.expand_dims(cos, 1), "mla_sin": ops.expand_dims(sin, 1),
                      "mla_mask": Tensor(np.ascontiguousarray(mask))}
    return cache[key]


__all__ = ["DeepseekV4MLALayer", "TABLE_KEYS", "mla_tables"]
