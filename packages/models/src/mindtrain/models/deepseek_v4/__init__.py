"""DeepSeek-V4 (HF DeepseekV4ForCausalLM): hybrid sliding / compressed sparse / heavily
compressed attention with one shared key/value head, hyper-connection streams, hash-routed and
learned mixtures of experts with a clamped SwiGLU.

Shared layers (RMSNorm, Linear, MLP, RoutedExperts, rope frequencies, the head + loss cell) are
the package's; this folder holds what is V4's own."""

from mindtrain.models.deepseek_v4.attention import DeepseekV4Attention
from mindtrain.models.deepseek_v4.hyper import HyperConnection, HyperHead
from mindtrain.models.deepseek_v4.model import DeepseekV4DecoderLayer, DeepseekV4ForCausalLM, DeepseekV4Model
from mindtrain.models.deepseek_v4.moe import DeepseekV4MoE, HashRouter, ScoreTopkRouter

__all__ = ["DeepseekV4Attention", "DeepseekV4DecoderLayer", "DeepseekV4ForCausalLM", "DeepseekV4MoE",
           "DeepseekV4Model", "HashRouter", "HyperConnection", "HyperHead", "ScoreTopkRouter"]
