"""Qwen3 and Qwen3-MoE for causal LM training: HF Qwen3ForCausalLM's / Qwen3MoeForCausalLM's math
and parameter names.

The causal-LM machinery (embedding, cached rope tables and mask, the layer loop
``run_layers``, the head + loss graph, expert-load bookkeeping, checkpoints, the parallel plan)
is :class:`~mindtrain.models.deepseek_v3.DeepseekV3ForCausalLM`'s; a Qwen3 model gives it its
own decoder layers, an optionally tied head and HF's load-balancing loss.
"""

from __future__ import annotations

from typing import Optional

import mindspore as ms
from mindspore import nn, ops

from mindtrain.config import ModelConfig, RecomputePlan
from mindtrain.config.families import head_dim, moe_layer_ids
from mindtrain.config.plan import MOE_BLOCK
from mindtrain.models import kernels
from mindtrain.models.blocks import Block
from mindtrain.models.decoder import DecoderLayer
from mindtrain.models.deepseek_v3 import DeepseekV3ForCausalLM, Embedding, _HeadLoss
from mindtrain.models.linear import Linear, linear
from mindtrain.models.mlp import MLP
from mindtrain.models.norm import RMSNorm
from mindtrain.models.precision import check_param_dtype, current_device, resolve_compute_dtype
from mindtrain.models.qwen3.attention import Qwen3Attention
from mindtrain.models.qwen3.moe import Qwen3MoE, load_balancing_loss
from mindtrain.models.rope import RotaryEmbedding


class Qwen3DecoderLayer(DecoderLayer):
    """One Qwen3 / Qwen3-MoE decoder layer: pre-norm :class:`Qwen3Attention`, then a SwiGLU
    :class:`~mindtrain.models.mlp.MLP` or a :class:`Qwen3MoE` (HF's rule,
    :func:`mindtrain.config.families.moe_layer_ids`). ``construct(h, cos, sin, mask_add)`` ->
    (h, tokens per expert [E] or [1], balance terms [2, E] or a zero); the math, the
    whole-layer graph and the region path are :class:`~mindtrain.models.decoder.DecoderLayer`'s."""

    def __init__(self, cfg, layer_idx: int, moe_block: int = MOE_BLOCK):  # pylint: disable=super-init-not-called
        Block.__init__(self)
        self.is_moe = layer_idx in moe_layer_ids(cfg)
        self.self_attn = Qwen3Attention(cfg)
        if self.is_moe:
            self.mlp = Qwen3MoE(cfg, block=moe_block)
        else:
            self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size, init_std=cfg.initializer_range)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.n_attention = len(self.self_attn.piece_weights("forward"))


class Qwen3Model(nn.Cell):
    """``embed_tokens``, ``layers``, ``norm`` (and the rotary tables over ``head_dim``)."""

    def __init__(self, cfg: ModelConfig, moe_block: int = MOE_BLOCK):
        super().__init__()
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size, cfg.initializer_range)
        self.layers = nn.CellList([Qwen3DecoderLayer(cfg, i, moe_block) for i in range(cfg.num_hidden_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(head_dim(cfg), cfg.rope_theta, cfg.rope_scaling,
                                          cfg.max_position_embeddings)


class Qwen3ForCausalLM(DeepseekV3ForCausalLM):
    """Qwen3 causal LM (model_type ``qwen3``; ``qwen3_moe`` builds :class:`Qwen3MoeForCausalLM`,
    the same code). Call conventions are DeepSeek-V3's (see the package README): ``model(ids)``
    -> logits, ``model(ids, labels=, loss_mask=, position_ids=, attention_mask=)`` ->
    ``(loss, metrics)``. With ``tie_word_embeddings`` the head multiplies by the embedding
    matrix and there is no ``lm_head``. Qwen3 has no MTP modules and no expert bias
    (``update_expert_bias`` does nothing)."""

    def __init__(self, cfg: ModelConfig, moe_block: int = MOE_BLOCK, compute_dtype: Optional[str] = None):
        nn.Cell.__init__(self)  # pylint: disable=non-parent-init-called
        check_param_dtype(cfg.param_init_dtype, current_device())
        self.compute_dtype = resolve_compute_dtype(cfg.compute_dtype, compute_dtype, current_device())
        self.fast_kernels = kernels.fast_kernels_enabled()
        self.config = cfg
        self.model = Qwen3Model(cfg, moe_block)
        self.tie_word_embeddings = bool(cfg.tie_word_embeddings)
        if not self.tie_word_embeddings:
            self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, init_std=cfg.initializer_range)
        self.head_loss = _HeadLoss()
        self.num_layers = cfg.num_hidden_layers
        self.num_mtp = 0
        self.moe_layer_ids = [i for i, layer in enumerate(self.model.layers) if layer.is_moe]
        self._expert_load = None
        self._rope_mask_cache: dict = {}
        self._configure_cells()
        self.layer_runners: dict = {}
        self.recompute_plan = RecomputePlan()
        self.recompute_wrappers: dict = {}

    def output_weight(self):
        """The head's weight [V, H]: ``lm_head.weight``, or the embedding's when tied."""
        return self.model.embed_tokens.weight if self.tie_word_embeddings else self.lm_head.merged_weight()

    def logits(self, h):
        """Final norm and the head: float32 logits [B, S, V]."""
        x = self.model.norm(h)
        if self.head_loss.lora_input is not None:  # the head's adapter unmerged (LoRA dropout): [x, dropout(x)]
            x = self.head_loss.lora_input(x)
        logits = linear(x, self.output_weight(), None, self.head_loss.matmul_dtype)
        return logits if logits.dtype == ms.float32 else ops.cast(logits, ms.float32)

    def lm_loss(self, h, labels, loss_mask):
        """Final norm, the head and the masked mean cross-entropy (one cell, ``head_loss``)."""
        norm = self.model.norm
        return self.head_loss(h, norm.weight, norm.eps, self.output_weight(), labels, loss_mask)

    balance_spans_layers = True
    """HF's balance loss is one product over every MoE layer's tokens (see :meth:`balance_term`):
    pipeline stages pass the layers' balance terms along instead of adding per-stage losses."""

    def balance_term(self, balances):
        """HF Qwen3MoeForCausalLM's ``aux_loss`` (:func:`~mindtrain.models.qwen3.moe.load_balancing_loss`
        of all of ``balances``, the layers' :func:`~mindtrain.models.qwen3.moe.balance_terms`)
        and ``router_aux_loss_coef`` when ``output_router_logits`` (else 0: reported only), so
        :meth:`combine_losses` gives ``lm_loss + router_aux_loss_coef * load_balancing_loss``.
        HF's balance is one product over all MoE layers, so unlike DeepSeek-V3's it does not
        split into a sum of per-stage parts: ``balances`` must be every MoE layer's (or stand
        for them: a pipeline stage passes the other stages' summed terms as one entry)."""
        cfg = self.config
        coefficient = cfg.router_aux_loss_coef if cfg.output_router_logits else 0.0
        return load_balancing_loss(balances, cfg.num_experts_per_tok), coefficient

    def update_expert_bias(self, load) -> None:
        """Nothing: Qwen3-MoE routes without a correction bias."""


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    """Qwen3-MoE causal LM (model_type ``qwen3_moe``): :class:`Qwen3ForCausalLM` whose layers
    HF's rule makes sparse (``decoder_sparse_step``, ``mlp_only_layers``) are softmax top-k
    mixtures of experts."""


__all__ = ["Qwen3DecoderLayer", "Qwen3ForCausalLM", "Qwen3Model", "Qwen3MoeForCausalLM"]
