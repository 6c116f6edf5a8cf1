"""Make the HF-parity fixtures of mindtrain-models with HF transformers' DeepseekV3 itself.

Run with the reference venv's Python (torch and transformers are never package dependencies):

    python3 -m venv /tmp/hfvenv && /tmp/hfvenv/bin/pip install torch==2.13.0 transformers safetensors numpy
    /tmp/hfvenv/bin/python tools/make_hf_fixtures.py            # writes the fixtures
    /tmp/hfvenv/bin/python tools/make_hf_fixtures.py --check-save  # also: mindtrain save_pretrained -> HF

Each fixture directory (packages/models/tests/fixtures/hf_<name>/) holds config.json and
model.safetensors as transformers' save_pretrained writes them, and reference.safetensors with
input_ids, labels, loss_mask, logits, loss, the router's top-k choices per MoE layer
(``topk.<layer>``, sorted per token) and gradients of the loss (``grad.<HF name>``).

``--check-save`` loads each fixture with mindtrain (workspace env, ``hatch run python``), saves
it with mindtrain's save_pretrained, loads that directory with transformers and compares logits.
"""

from __future__ import annotations

import sys

import numpy as np
import torch
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

import fixture_io as fx

BASE = dict(
    vocab_size=128, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
    num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
    n_shared_experts=1, n_routed_experts=8, routed_scaling_factor=2.5,
    kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8, v_head_dim=16, qk_nope_head_dim=16,
    n_group=4, topk_group=2, num_experts_per_tok=2, first_k_dense_replace=1, norm_topk_prob=True,
    hidden_act="silu", max_position_embeddings=128, initializer_range=0.1, rms_norm_eps=1e-6,
    rope_theta=10000.0,
    rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32,
                  "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 0.707},
    rope_interleave=True, attention_bias=False, tie_word_embeddings=False,
    bos_token_id=0, eos_token_id=1,
)
MODELS = {
    "qlora": dict(BASE),
    "noqlora": dict(BASE, q_lora_rank=None, rope_interleave=False, norm_topk_prob=False,
                    rope_scaling={"type": "yarn", "factor": 2.0, "original_max_position_embeddings": 64,
                                  "beta_fast": 16, "beta_slow": 2, "mscale": 0.9, "mscale_all_dim": 1.0}),
}
BATCH, SEQ = 2, 24
GRAD_NAMES = [
    "model.embed_tokens.weight", "lm_head.weight", "model.norm.weight",
    "model.layers.0.mlp.gate_proj.weight", "model.layers.0.self_attn.kv_b_proj.weight",
    "model.layers.1.self_attn.kv_a_proj_with_mqa.weight", "model.layers.1.self_attn.o_proj.weight",
    "model.layers.1.mlp.gate.weight", "model.layers.2.mlp.gate.weight",
    "model.layers.2.mlp.shared_experts.down_proj.weight", "model.layers.2.self_attn.kv_a_layernorm.weight",
]


def hf_config(spec: dict) -> DeepseekV3Config:
    spec = dict(spec)
    rope = dict(spec.pop("rope_scaling"))
    rope["rope_type"] = rope.pop("type")
    rope["rope_theta"] = spec.pop("rope_theta")
    return DeepseekV3Config(**spec, rope_parameters=rope, attn_implementation="eager")


def make(name: str, spec: dict) -> None:
    torch.manual_seed(1234 + len(name))
    model = DeepseekV3ForCausalLM(hf_config(spec)).float().eval()
    with torch.no_grad():  # a non-zero correction bias that changes some choices
        for layer in model.model.layers[spec["first_k_dense_replace"]:]:
            layer.mlp.gate.e_score_correction_bias.copy_(torch.randn(spec["n_routed_experts"]) * 0.05)
    input_ids, labels, loss_mask = fx.random_batch(7, spec["vocab_size"], BATCH, SEQ)
    choices = fx.record_choices({i: layer.mlp.gate for i, layer in enumerate(model.model.layers)
                                 if i >= spec["first_k_dense_replace"]})
    logits = model(torch.from_numpy(input_ids)).logits
    loss = fx.masked_loss(logits, labels, loss_mask, spec["vocab_size"])
    loss.backward()

    ref = fx.reference(input_ids, labels, loss_mask, logits)
    ref["loss"] = np.array(loss.item(), np.float32)
    fx.add_choices(ref, choices)
    grad_names = GRAD_NAMES + ["model.layers.1.mlp.experts.3.gate_proj.weight",
                               "model.layers.2.mlp.experts.5.down_proj.weight",
                               "model.layers.2.mlp.experts.0.up_proj.weight"]
    grad_names += (["model.layers.0.self_attn.q_a_proj.weight", "model.layers.1.self_attn.q_b_proj.weight"]
                   if spec["q_lora_rank"] else ["model.layers.1.self_attn.q_proj.weight"])
    fx.add_grads(ref, model, grad_names, spec["moe_intermediate_size"])
    out = fx.write_fixture(name, model, ref)
    print(f"{name}: loss {loss.item():.6f}, wrote {out}")


def check_save(name: str, ms_python: list[str]) -> float:
    """mindtrain from_pretrained -> save_pretrained -> transformers loads -> same logits."""
    return fx.check_save(name, lambda path: DeepseekV3ForCausalLM.from_pretrained(
        path, attn_implementation="eager").float().eval(), ms_python, BATCH, SEQ)


def main() -> int:
    return fx.main(__doc__.splitlines()[0], list(MODELS), lambda name: make(name, MODELS[name]), check_save)


if __name__ == "__main__":
    sys.exit(main())
