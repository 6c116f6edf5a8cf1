"""Make the HF-parity fixture of DeepSeek-V4's ``mla`` attention variant (MindFormers'
``experimental_attention_variant: "mla"``) from HF transformers' public modules.

Run with the reference venv's Python (torch and transformers 5.24 are never package dependencies):

    /tmp/fxvenv/bin/python tools/make_deepseek_v4_mla_fixtures.py

transformers has no such model: its DeepseekV4ForCausalLM always builds the hybrid V4
attention. MindFormers builds the variant by composition (``get_gpt_layer_local_spec``: a
hyper-connection transformer layer whose self-attention is the MLA module of DeepSeek-V3), so
the reference is composed the same way from transformers' own modules:

- ``DeepseekV4ForCausalLM`` (hyper-connection streams, hash-routed and learned MoE with
  sigmoid scores, the final norm and head) with every layer's ``self_attn`` replaced by
  transformers' ``DeepseekV3Attention`` (MLA: q_a_proj, q_a_layernorm, q_b_proj,
  kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj, o_proj), configured by a DeepseekV3Config of
  the same sizes. V4's decoder layer calls its attention with V4's rope tables and sliding
  mask; the swapped-in attention (a subclass that only changes ``forward``'s inputs) takes
  DeepSeek-V3's rope from transformers' ``DeepseekV3RotaryEmbedding`` (YaRN, rope dims
  interleaved) and the full causal mask instead, as MindFormers' MLA does.
- ``hc_head`` replaced by the streams' mean (``enable_hc_head: false``, as the published
  pynative_deepseek4.yaml; MindFormers' ``collapse_hyper_connection_streams``).
- ``hc_sinkhorn_iters: 0`` (the published value: one column normalisation).

The fixture directory (packages/models/tests/fixtures/hf_deepseek_v4_mla/) holds
transformers' save_pretrained output of that model (config.json says DeepseekV4; the test
gives the variant's fields as overrides) and reference.safetensors (the batch, logits,
``loss`` = ``lm_loss``, the routers' choices and the gradients by HF's in-memory names).
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np
import torch
from transformers import DeepseekV3Config, DeepseekV4Config, DeepseekV4ForCausalLM
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention, DeepseekV3RotaryEmbedding

import fixture_io as fx
from make_deepseek_v4_fixtures import randomise_constants

NAME = "deepseek_v4_mla"
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "beta_fast": 32.0,
        "beta_slow": 1.0, "mscale": 0.707, "mscale_all_dim": 0.707}
SIZES = dict(vocab_size=64, hidden_size=32, moe_intermediate_size=16, num_hidden_layers=3, num_attention_heads=2,
             q_lora_rank=24, qk_rope_head_dim=8, num_experts_per_tok=2, n_routed_experts=8, n_shared_experts=1,
             routed_scaling_factor=2.5, max_position_embeddings=64, initializer_range=0.1, rms_norm_eps=1e-6)
V4 = dict(SIZES, num_key_value_heads=1, head_dim=16, scoring_func="sigmoid",
          layer_types=["sliding_attention"] * 3, mlp_layer_types=["hash_moe", "moe", "moe"], hc_mult=4,
          hc_sinkhorn_iters=0, hc_eps=1e-6, sliding_window=64, o_groups=2, o_lora_rank=8, swiglu_limit=10.0)
V3 = dict(SIZES, kv_lora_rank=16, qk_nope_head_dim=16, v_head_dim=16, num_key_value_heads=2, rope_theta=10000.0,
          rope_parameters=dict(YARN, rope_theta=10000.0), rope_interleave=True, attention_bias=False)
# what the test gives mindtrain on top of config.json (the variant's fields)
OVERRIDES = {"experimental_attention_variant": "mla", "kv_lora_rank": 16, "qk_nope_head_dim": 16, "v_head_dim": 16,
             "rope_theta": 10000.0, "rope_scaling": {k: v for k, v in YARN.items()}, "enable_hc_head": False}
SEQ, BATCH = 16, 2


class MLAInV4(DeepseekV3Attention):
    """transformers' DeepseekV3Attention, called from a V4 layer: DeepSeek-V3's rope and the
    full causal mask replace V4's rope tables and sliding mask (its weights and math are
    DeepseekV3Attention's)."""

    def __init__(self, config, layer_idx):
        super().__init__(config, layer_idx)
        self.rotary = DeepseekV3RotaryEmbedding(config)

    def forward(self, hidden_states, **kwargs):
        s = hidden_states.shape[1]
        pos = torch.arange(s).unsqueeze(0)
        cos, sin = self.rotary(hidden_states, pos)
        mask = torch.full((s, s), float("-inf")).triu(1)[None, None]
        return super().forward(hidden_states, position_embeddings=(cos, sin), attention_mask=mask)


class StreamMean(torch.nn.Module):
    def forward(self, x):
        return x.mean(dim=2)


def build():
    torch.manual_seed(2026)
    model = DeepseekV4ForCausalLM(DeepseekV4Config(**V4, attn_implementation="eager",
                                                   experts_implementation="eager"))
    v3 = DeepseekV3Config(**V3, attn_implementation="eager")
    for i, layer in enumerate(model.model.layers):
        layer.self_attn = MLAInV4(v3, i)
    model.model.hc_head = StreamMean()
    model = model.float().eval()
    randomise_constants(model, V4, torch.Generator().manual_seed(77))
    with torch.no_grad():  # the latent norms' weights too (HF: ones)
        for name, p in model.named_parameters():
            if name.endswith(("q_a_layernorm.weight", "kv_a_layernorm.weight")):
                p.copy_(1.0 + torch.randn(p.shape, generator=torch.Generator().manual_seed(5)) * 0.2)
    return model


def grad_names(busiest):
    names = ["model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"]
    for i in range(V4["num_hidden_layers"]):
        p = f"model.layers.{i}."
        a = p + "self_attn."
        names += [a + w + ".weight" for w in ("q_a_proj", "q_a_layernorm", "q_b_proj", "kv_a_proj_with_mqa",
                                              "kv_a_layernorm", "kv_b_proj", "o_proj")]
        names += [p + "input_layernorm.weight", p + "post_attention_layernorm.weight"]
        names += [p + f"{hc}.{w}" for hc in ("attn_hc", "ffn_hc") for w in ("fn", "base", "scale")]
        e, m = busiest[i], p + "mlp."
        names += [m + "gate.weight", m + "shared_experts.gate_proj.weight", m + "shared_experts.up_proj.weight",
                  m + "shared_experts.down_proj.weight", m + f"experts.{e[0]}.gate_proj.weight",
                  m + f"experts.{e[1]}.up_proj.weight", m + f"experts.{e[2]}.down_proj.weight"]
    return names


def main() -> int:
    import transformers
    print(f"torch {torch.__version__}, transformers {transformers.__version__}")
    model = build()
    input_ids, labels, loss_mask = fx.random_batch(17, V4["vocab_size"], BATCH, SEQ)
    choices = fx.record_choices({i: layer.mlp.gate for i, layer in enumerate(model.model.layers)})
    logits = model(torch.from_numpy(input_ids)).logits
    loss = fx.masked_loss(logits, labels, loss_mask, V4["vocab_size"])
    loss.backward()
    ref = fx.reference(input_ids, labels, loss_mask, logits)
    ref["loss"] = ref["lm_loss"] = np.array(loss.item(), np.float32)
    fx.add_choices(ref, choices)
    busiest = fx.busiest_experts(choices, V4["n_routed_experts"])
    fx.add_grads(ref, model, grad_names(busiest), V4["moe_intermediate_size"])
    out = fx.write_fixture(NAME, model, ref)
    with open(os.path.join(out, "overrides.json"), "w") as f:
        json.dump(OVERRIDES, f, indent=1)
    print(f"{NAME}: loss {loss.item():.6f}, wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
