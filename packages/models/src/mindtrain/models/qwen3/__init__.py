"""Qwen3 and Qwen3-MoE (HF Qwen3ForCausalLM / Qwen3MoeForCausalLM): grouped-query attention
with per-head q/k norms, SwiGLU MLPs or softmax top-k experts, optionally tied embeddings.

Shared layers (RMSNorm, Linear, MLP, RoutedExperts, RotaryEmbedding, CoreAttention, the
Block / GraphCache compile machinery, the losses) are the package's; this folder holds what is
Qwen3's own."""

from mindtrain.models.qwen3.attention import Qwen3Attention
from mindtrain.models.qwen3.model import Qwen3DecoderLayer, Qwen3ForCausalLM, Qwen3Model, Qwen3MoeForCausalLM
from mindtrain.models.qwen3.moe import Qwen3MoE, SoftmaxTopkRouter, balance_terms, load_balancing_loss

__all__ = ["Qwen3Attention", "Qwen3DecoderLayer", "Qwen3ForCausalLM", "Qwen3MoE", "Qwen3Model",
           "Qwen3MoeForCausalLM", "SoftmaxTopkRouter", "balance_terms", "load_balancing_loss"]
