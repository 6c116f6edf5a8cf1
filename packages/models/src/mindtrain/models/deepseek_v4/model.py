"""DeepSeek-V4 for causal LM training: HF DeepseekV4ForCausalLM's math and parameter names.

The causal-LM machinery (embedding, the head + loss cell, expert-load bookkeeping, checkpoints)
is :class:`~mindtrain.models.deepseek_v3.DeepseekV3ForCausalLM`'s; V4 gives it its decoder
layers (hybrid attention, hyper-connection streams, hash / learned mixtures of experts), the
streams' final collapse (``hc_head``) before the norm, and its rope tables and masks. It runs
eagerly (the indexer's choice is a host-side top-k). MindFormers' attention variant ``mla``
(``mla.py``) and its MTP modules (``mtp.py``; HF builds none) are built too.
"""

from __future__ import annotations

from typing import Optional

import mindspore as ms
import numpy as np
from mindspore import Tensor, nn, ops

from mindtrain.config import ModelConfig, RecomputePlan
from mindtrain.config.families import v4_attention_kinds
from mindtrain.config.plan import MOE_BLOCK
from mindtrain.models import kernels
from mindtrain.models.deepseek_v3 import DeepseekV3ForCausalLM, Embedding, _HeadLoss
from mindtrain.models.dropout import HIDDEN_ATTENTION, HIDDEN_MLP, hidden_dropout, token_keys
from mindtrain.models.deepseek_v4.attention import NEG, DeepseekV4Attention, causal_entry_bias
from mindtrain.models.deepseek_v4.hyper import HyperConnection, HyperHead, StreamMean, hyper_update, plain_residual
from mindtrain.models.deepseek_v4.mla import DeepseekV4MLALayer, mla_tables
from mindtrain.models.deepseek_v4.mtp import mtp_forward, mtp_layer
from mindtrain.models.deepseek_v4.moe import DeepseekV4MoE
from mindtrain.models.deepseek_v4.rope import compress_scaling, pair_rotation, rope_tables
from mindtrain.models.linear import Linear
from mindtrain.models.norm import RMSNorm
from mindtrain.models.precision import check_param_dtype, current_device, resolve_compute_dtype
from mindtrain.models.rope import RotaryEmbedding


class DeepseekV4DecoderLayer(nn.Cell):
    """``self_attn``, ``mlp``, ``input_layernorm``, ``post_attention_layernorm``, ``attn_hc``,
    ``ffn_hc``. ``construct(streams [B,S,N,H], ids [B,S], *tables)`` -> (streams, tokens per
    expert [E], zero balance). In a training step hidden dropout is on the attention and MoE
    outputs [B,S,H] before each update of the streams (one mask for every stream: MindFormers'
    ``HyperConnectionTransformerLayer``, ``hidden_states_dropout`` before ``output_cell``)."""

    def __init__(self, cfg, layer_idx: int, moe_block: int = MOE_BLOCK):
        super().__init__()
        # an MTP module (layer_idx >= num_hidden_layers) is sliding-window (validate.py)
        ratio = int(cfg.compress_ratios[layer_idx]) if layer_idx < cfg.num_hidden_layers else 0
        self.kind = v4_attention_kinds(cfg)[layer_idx] if layer_idx < cfg.num_hidden_layers else "sliding"
        self.is_moe = True
        self.self_attn = DeepseekV4Attention(cfg, self.kind, ratio)
        self.mlp = DeepseekV4MoE(cfg, hashed=layer_idx < cfg.num_hash_layers, block=moe_block)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hc = bool(cfg.enable_hyper_connections)
        if self.hc:  # false: plain residual adds (MindFormers' TransformerLayer), no parameters
            self.attn_hc = HyperConnection(cfg)
            self.ffn_hc = HyperConnection(cfg)

    def construct(self, streams, ids, *tables):
        """``tables``: the model's tables of the sequence length as flat tensors in the order
        of ``table_keys`` (flat, so a recompute wrapper sees each input tensor)."""
        if not self.hc:
            return plain_residual(self, streams, ids, lambda x: self.self_attn(x, *tables),
                                  lambda out, k: hidden_dropout(self, out, (HIDDEN_ATTENTION, HIDDEN_MLP)[k]))
        post, comb, x = self.attn_hc(streams)
        a = hidden_dropout(self, self.self_attn(self.input_layernorm(x), *tables), HIDDEN_ATTENTION)
        streams = hyper_update(streams, post, comb, a)
        post, comb, x = self.ffn_hc(streams)
        y, counts, balance = self.mlp(self.post_attention_layernorm(x), ids)
        return hyper_update(streams, post, comb, hidden_dropout(self, y, HIDDEN_MLP)), counts, balance


class DeepseekV4Model(nn.Cell):
    """``embed_tokens``, ``layers`` (decoder layers, then the MTP modules), ``norm``, ``hc_head``
    (the learned head, or the streams' mean without ``enable_hc_head``) and, in the ``mla``
    variant, ``rotary_emb`` (DeepSeek-V3's)."""

    def __init__(self, cfg: ModelConfig, moe_block: int = MOE_BLOCK):
        super().__init__()
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size, cfg.initializer_range)
        layer = DeepseekV4MLALayer if cfg.experimental_attention_variant == "mla" else DeepseekV4DecoderLayer
        layers = [layer(cfg, i, moe_block) for i in range(cfg.num_hidden_layers)]
        layers += [mtp_layer(cfg, cfg.num_hidden_layers + k, moe_block, DeepseekV4DecoderLayer)
                   for k in range(cfg.num_nextn_predict_layers)]
        self.layers = nn.CellList(layers)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if cfg.enable_hyper_connections:  # false: one residual, nothing to collapse
            self.hc_head = HyperHead(cfg) if cfg.enable_hc_head else StreamMean()
        if cfg.experimental_attention_variant == "mla":
            self.rotary_emb = RotaryEmbedding(cfg.qk_rope_head_dim, cfg.rope_theta, cfg.rope_scaling,
                                              cfg.max_position_embeddings)


class DeepseekV4ForCausalLM(DeepseekV3ForCausalLM):
    """DeepSeek-V4 causal LM (model_type ``deepseek_v4``). ``model(ids)`` -> float32 logits,
    ``model(ids, labels=, loss_mask=)`` -> ``(loss, metrics)`` as DeepSeek-V3's. Positions are
    0..S-1 of each row and attention is causal within the row: other ``position_ids`` and an
    ``attention_mask`` (packed documents) are refused."""

    def __init__(self, cfg: ModelConfig, moe_block: int = MOE_BLOCK, compute_dtype: Optional[str] = None):
        nn.Cell.__init__(self)  # pylint: disable=non-parent-init-called
        check_param_dtype(cfg.param_init_dtype, current_device())
        self.compute_dtype = resolve_compute_dtype(cfg.compute_dtype, compute_dtype, current_device())
        self.fast_kernels = kernels.fast_kernels_enabled()
        self.config = cfg
        self.model = DeepseekV4Model(cfg, moe_block)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, init_std=cfg.initializer_range)
        self.head_loss = _HeadLoss()
        self.num_layers = cfg.num_hidden_layers
        self.num_mtp = cfg.num_nextn_predict_layers
        self.moe_layer_ids = list(range(cfg.num_hidden_layers + self.num_mtp))
        self._expert_load = None
        self._rope_mask_cache: dict = {}
        self._stage_ids = None  # the micro-batch's input ids of begin_forward (the pipeline stage's call)
        self.context_chunks = None  # context parallelism: this rank's (chunk numbers, number of chunks) (the layout's)
        self._configure_cells()
        self.layer_runners: dict = {}
        self.recompute_plan = RecomputePlan()
        self.recompute_wrappers: dict = {}

    def construct(self, input_ids, labels=None, loss_mask=None, position_ids=None, attention_mask=None):
        b, s = input_ids.shape
        if position_ids is not None:  # accepted when they are the default 0..S-1 of every row
            pos = position_ids.asnumpy() if isinstance(position_ids, Tensor) else np.asarray(position_ids)
            if not (pos == np.arange(s)).all():
                raise ValueError("DeepSeek-V4: position_ids other than 0..S-1 per row (packed documents) are not "
                                 "supported; each row is one sequence from position 0")
        if attention_mask is not None:
            raise ValueError("DeepSeek-V4: attention_mask (packed documents) is not supported; each row is one "
                             "causal sequence")
        if self._chunks() is not None:
            raise RuntimeError("DeepSeek-V4 laid out for context parallelism runs through the layout's stage "
                               "(its pieces on this rank's chunks), not model(...)")
        if self.dropout.enabled:  # whole sequences here: each token's identity for the dropout masks
            self.dropout.set_tokens(token_keys(input_ids.asnumpy() if isinstance(input_ids, Tensor) else input_ids))
        tables = self.tables(s)
        h = self.embed(input_ids)
        h, counts, balances = self.run_layers(h, range(self.num_layers), tables, input_ids=input_ids)
        if labels is None:
            return self.logits(h)
        if loss_mask is None:
            loss_mask = ops.ones(labels.shape, ms.float32)
        mtp_losses = []
        if self.num_mtp:
            mtp_losses, c, bal = mtp_forward(self, h, self.mtp_inputs(input_ids, labels, loss_mask), tables)
            counts += c
            balances += bal
        if not self.config.aux_loss_alpha:
            balances = []  # HF's V4 adds no balance loss (aux_loss_alpha 0 from its config.json)
        loss, metrics = self.combine_losses(self.lm_loss(h, labels, loss_mask), mtp_losses, balances)
        if counts:
            load = ops.stack([c.astype(ms.float32) for c in counts])
            self._expert_load = load if self._expert_load is None else self._expert_load + load
        return loss, metrics

    def embed(self, input_ids):
        """The embeddings [B, S, H] copied onto the ``hc_mult`` streams: [B, S, N, H] (without
        hyper-connections the embeddings [B, S, H] themselves)."""
        h = self.model.embed_tokens(input_ids)
        if not self.config.enable_hyper_connections:
            return h
        b, s, d = h.shape
        return ops.broadcast_to(ops.expand_dims(h, 2), (b, s, self.config.hc_mult, d))

    def run_layers(self, h, layer_ids, tables, sin=None, mask_add=None, input_ids=None):
        """The decoder layers ``layer_ids`` -> ``(h, counts, balances)``. ``tables`` from
        :meth:`tables` (or :meth:`rope`); ``input_ids`` [B, S] of the tokens in ``h`` (hash
        routing), by default those of :meth:`begin_forward`. ``sin`` and ``mask_add`` (the
        pipeline stage's call, DeepSeek-V3's) are not used: V4 builds its masks from the
        positions in its tables."""
        if input_ids is None:
            input_ids = self._stage_ids
        counts, balances = [], []
        keys = tuple(tables)
        values = tuple(tables[k] for k in keys)
        for i in layer_ids:
            self.model.layers[i].self_attn.table_keys = keys
            h, c, bal = self._layer(i)(h, input_ids, *values)
            counts.append(c)
            balances.append(bal)
        return h, counts, balances

    # The pipeline stage's protocol (mindtrain.parallel's ModelStage, which context parallelism
    # runs too): ``begin_forward(micro-batch)``, ``rope(position_ids)``, ``run_layers(h, ids,
    # cos, sin, mask_add)``, with this rank's part of each sequence.
    def mtp_forward(self, h, depths, tables, sin=None, mask_add=None):
        """The pipeline stage's call of the MTP depths (DeepSeek-V3's signature: ``tables``
        from :meth:`rope`; ``sin`` and ``mask_add`` unused, as in :meth:`run_layers`)."""
        return mtp_forward(self, h, depths, tables)

    def begin_forward(self, inputs) -> None:
        """Before the stage's forward of one micro-batch: keep its (local) ``input_ids`` for
        the hash-routed layers."""
        super().begin_forward(inputs)
        self._stage_ids = inputs["input_ids"]

    def _chunks(self):
        """Context parallelism's ``(this rank's chunk numbers, number of chunks)``, or None:
        from the all-gather on every attention cell (``kv_exchange``; colossal, and the
        hybrid attention's Ulysses) or the layout's ``context_chunks`` (the mla variant's
        Ulysses, whose cells all-to-all instead)."""
        ex = self.model.layers[0].self_attn.kv_exchange if self.num_layers else None
        if ex is not None:
            return tuple(ex.chunks), ex.num_chunks
        return self.context_chunks

    def _ulysses(self) -> bool:
        """The hybrid attention runs Ulysses (its cells' ``head_exchange``, set by the layout)."""
        return bool(self.num_layers) and getattr(self.model.layers[0].self_attn, "head_exchange", None) is not None

    def rope(self, position_ids):
        """``(tables, None)``: the tables (:meth:`tables`) of the tokens at ``position_ids``
        [B, S] (this rank's chunks under context parallelism), which must be each row's
        default positions; the second is the stage protocol's ``sin`` (V4 keeps its tables
        in one dict)."""
        pos = position_ids.asnumpy() if isinstance(position_ids, Tensor) else np.asarray(position_ids)
        layout = self._chunks()
        local = pos.shape[1]
        if layout is None:
            s, chunks, n = local, None, 1
        else:
            chunks, n = layout
            s = local // len(chunks) * n
        tables = self.tables(s, chunks, n, self._ulysses())
        want = np.arange(s) if layout is None else np.concatenate(
            [np.arange(k * (s // n), (k + 1) * (s // n)) for k in chunks])
        if not (pos == want).all():
            raise ValueError("DeepSeek-V4: position_ids other than 0..S-1 per row (packed documents) are not "
                             "supported; each row is one sequence from position 0")
        return tables, None

    def whole_sequence_inputs(self, batch, mtp_depths: Optional[int] = None) -> dict:
        """DeepSeek-V3's (:meth:`DeepseekV3ForCausalLM.whole_sequence_inputs`), refusing an
        ``attention_mask`` (packed documents) as :meth:`construct` does."""
        if batch.get("attention_mask") is not None:
            raise ValueError("DeepSeek-V4: attention_mask (packed documents) is not supported; each row is one "
                             "causal sequence")
        return super().whole_sequence_inputs(batch, mtp_depths)

    def collapse(self, h):
        """The streams [B,S,N,H] collapsed by ``hc_head``: [B,S,H] (before the final norm);
        without hyper-connections ``h`` [B,S,H] itself."""
        if not self.config.enable_hyper_connections:
            return h
        return self.model.hc_head(h)

    def logits(self, h):
        logits = self.lm_head(self.model.norm(self.collapse(h)))
        return logits if logits.dtype == ms.float32 else ops.cast(logits, ms.float32)

    def lm_loss(self, h, labels, loss_mask):
        norm = self.model.norm
        return self.head_loss(self.collapse(h), norm.weight, norm.eps, self.lm_head.merged_weight(), labels, loss_mask)

    def tables(self, s: int, chunks: Optional[tuple] = None, num_chunks: int = 1, rows: bool = False) -> dict:
        """Rope tables, pair rotations and masks of sequence length ``s`` (cached). With
        ``chunks`` (context parallelism: this rank's chunk numbers of the ``num_chunks`` equal
        chunks of the sequence), of this rank's tokens: their rows of the query tables, their
        own entries' rope tables, the causal entry bias of their queries against every entry,
        per local chunk the sliding mask against its halo and own keys ([chunks, c, halo + c])
        and ``halo_index`` (see :meth:`DeepseekV4Attention._window_keys`). Without, one chunk
        of the whole sequence and no halo. With ``rows`` (Ulysses CP) also ``window_rows``
        [L, S]: the sliding mask of this rank's tokens against every key of the sequence, in
        order. The ``mla`` variant's: :func:`mla_tables`."""
        cfg = self.config
        if cfg.experimental_attention_variant == "mla":
            return mla_tables(self, s, chunks, num_chunks)
        key = ("v4", s, chunks, num_chunks, rows)
        if key in self._rope_mask_cache:
            return self._rope_mask_cache[key]
        d, rd, ci = cfg.head_dim, cfg.qk_rope_head_dim, cfg.index_head_dim
        max_pos = cfg.max_position_embeddings
        scaling = compress_scaling(cfg.rope_scaling)
        c = s // num_chunks
        chunks = chunks or (0,)
        pos = np.concatenate([np.arange(k * c, (k + 1) * c) for k in chunks])
        out: dict = {"rotation": pair_rotation(d, rd)}
        out["main_cos"], out["main_sin"] = rope_tables(pos, d, rd, cfg.rope_theta, None, max_pos)
        out["compress_cos"], out["compress_sin"] = rope_tables(pos, d, rd, cfg.compress_rope_theta, scaling, max_pos)
        window = cfg.sliding_window
        halo = window - 1 if num_chunks > 1 else 0
        masks = []
        for k in chunks:
            q_idx = np.arange(k * c, (k + 1) * c)[:, None]
            key_pos = np.arange(k * c - halo, (k + 1) * c)[None, :]
            masks.append(np.where((key_pos >= 0) & (key_pos <= q_idx) & (key_pos > q_idx - window), 0.0, NEG))
        out["sliding_mask"] = np.stack(masks).astype(np.float32)
        if rows:
            q_idx, key_pos = pos[:, None], np.arange(s)[None, :]
            out["window_rows"] = np.where((key_pos <= q_idx) & (key_pos > q_idx - window), 0.0, NEG).astype(np.float32)
        if num_chunks > 1:
            h = min(halo, c)
            out["halo_index"] = np.stack([k * h + np.arange(halo) for k in chunks]).astype(np.int32)
        kinds = v4_attention_kinds(cfg)
        for kind, ratio in zip(kinds, cfg.compress_ratios):
            ratio = int(ratio)
            nw = c // ratio if ratio else 0  # windows per chunk
            if kind == "sliding" or nw == 0 or f"entry_cos.{ratio}" in out:
                continue
            entry_pos = np.concatenate([np.arange(k * nw, (k + 1) * nw) for k in chunks]) * ratio
            out[f"entry_cos.{ratio}"], out[f"entry_sin.{ratio}"] = rope_tables(
                entry_pos, d, rd, cfg.compress_rope_theta, scaling, max_pos)
            out[f"entry_bias.{ratio}"] = causal_entry_bias(pos, ratio, nw * num_chunks)
            if kind == "csa":
                out["index_rotation"] = pair_rotation(ci, rd)
                out["index_entry_cos"], out["index_entry_sin"] = rope_tables(
                    entry_pos, ci, rd, cfg.compress_rope_theta, scaling, max_pos)
                cos, sin = rope_tables(pos, ci, rd, cfg.compress_rope_theta, scaling, max_pos)
                out["index_q_cos"], out["index_q_sin"] = cos.reshape(1, len(pos), 1, ci), sin.reshape(1, len(pos), 1, ci)
        tables = {k: Tensor(v) for k, v in out.items()}
        if len(self._rope_mask_cache) > 8:
            self._rope_mask_cache = {}
        self._rope_mask_cache[key] = tables
        return tables

    def update_expert_bias(self, load) -> None:
        """``bias += bias_update_speed * sign(mean(load) - load)`` for the learned routers;
        the hash-routed layers have no bias (their rows of ``load`` are skipped)."""
        speed = self.config.bias_update_speed
        if not speed:
            return
        load = load.asnumpy() if isinstance(load, Tensor) else np.asarray(load)
        for row, idx in zip(load.astype(np.float64), self.moe_layer_ids):
            gate = self.model.layers[idx].mlp.gate
            if not hasattr(gate, "e_score_correction_bias"):
                continue
            bias = gate.e_score_correction_bias
            new = bias.asnumpy() + speed * np.sign(row.mean() - row)
            ops.assign(bias, Tensor(new.astype(np.float32)))

    def indexers(self) -> dict:
        """The lightning indexer of each compressed-sparse layer, by layer index."""
        return {i: layer.self_attn.compressor.indexer for i, layer in enumerate(self.model.layers)
                if layer.kind == "csa"}

    def record_routing(self, enabled: bool = True) -> None:
        """Keep each router's top-k expert ids and each indexer's kept entries ([B, S, T] bool
        per call, ``indexer.recorded``)."""
        super().record_routing(enabled)
        for indexer in self.indexers().values():
            indexer.recorded = [] if enabled else None


__all__ = ["DeepseekV4DecoderLayer", "DeepseekV4ForCausalLM", "DeepseekV4Model"]
