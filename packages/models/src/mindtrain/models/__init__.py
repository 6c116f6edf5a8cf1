"""DeepSeek-V3 (MLA, MoE, MTP), DeepSeek-V4, Qwen3 and Qwen3-MoE for MindSpore eager mode, with HF weight names."""

from mindtrain.models.__about__ import __version__
from mindtrain.models.attention import MLAttention
from mindtrain.models.counting import count_parameters, flops_per_token
from mindtrain.models.decoder import DecoderLayer
from mindtrain.models.deepseek_v3 import DeepseekV3ForCausalLM, DeepseekV3Model
from mindtrain.models.deepseek_v4 import DeepseekV4ForCausalLM
from mindtrain.models.execution import apply_compile, apply_recompute, is_compiled
from mindtrain.models.experts import RoutedExperts
from mindtrain.models.hf_checkpoint import from_pretrained, hf_state_dict, load_hf_state_dict, save_pretrained
from mindtrain.models.hf_config import config_from_hf, config_to_hf
from mindtrain.models.kernels import FastKernelsUnavailable, fast_kernels_enabled, use_fast_kernels
from mindtrain.models.mlp import MLP
from mindtrain.models.moe import MoE
from mindtrain.models.mtp import MTPLayer
from mindtrain.models.norm import RMSNorm
from mindtrain.models.parallel_plan import parallel_plan
from mindtrain.models.precision import effective_compute_dtype, synchronous_cpu_dispatch
from mindtrain.models.qwen3 import Qwen3Attention, Qwen3ForCausalLM, Qwen3MoE, Qwen3MoeForCausalLM
from mindtrain.models.registry import build_model, model_class, register_model
from mindtrain.models.rope import RotaryEmbedding
from mindtrain.models.router import TopkRouter
from mindtrain.models.weights import Init, init_of, initial_values, is_empty, materialize

# the built-in models (registry.py imports none, so models may build through it)
register_model("deepseek_v3", "DeepseekV3ForCausalLM", DeepseekV3ForCausalLM)
register_model("deepseek_v4", "DeepseekV4ForCausalLM", DeepseekV4ForCausalLM)
register_model("qwen3", "Qwen3ForCausalLM", Qwen3ForCausalLM)
register_model("qwen3_moe", "Qwen3MoeForCausalLM", Qwen3MoeForCausalLM)

__all__ = [
    "__version__",
    "DecoderLayer", "DeepseekV3ForCausalLM", "DeepseekV3Model", "DeepseekV4ForCausalLM", "FastKernelsUnavailable", "Init", "MLAttention", "MLP",
    "MoE", "MTPLayer", "Qwen3Attention", "Qwen3ForCausalLM", "Qwen3MoE", "Qwen3MoeForCausalLM", "RMSNorm",
    "RotaryEmbedding", "RoutedExperts", "TopkRouter",
    "apply_compile", "apply_recompute", "build_model", "config_from_hf", "config_to_hf", "count_parameters", "effective_compute_dtype",
    "fast_kernels_enabled", "flops_per_token", "from_pretrained", "hf_state_dict", "init_of", "initial_values", "is_compiled",
    "is_empty", "load_hf_state_dict", "materialize", "model_class", "parallel_plan", "register_model",
    "save_pretrained", "synchronous_cpu_dispatch",
    "use_fast_kernels",
]
