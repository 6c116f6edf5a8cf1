"""Make the ``qk_layernorm: false`` parity fixtures of mindtrain-models: HF transformers'
DeepseekV3 and Qwen3-MoE with their query / key norms taken out.

Run with the reference venv's Python (torch and transformers are never package dependencies):

    /tmp/fxvenv/bin/python tools/make_no_qk_norm_fixtures.py

HF has no switch for these norms, so the reference replaces the modules by ``torch.nn.Identity``
(an RMSNorm with weight ones is not the identity: it still divides by the rms):
DeepSeek-V3's MLA latent norms ``q_a_layernorm`` and ``kv_a_layernorm`` (what MindFormers'
MLA builds with ``qk_layernorm: false``: IdentityOp for q_layernorm / kv_layernorm), and
Qwen3-MoE's per-head ``q_norm`` and ``k_norm`` (MindFormers' GPT attention: IdentityOp for
q_layernorm / k_layernorm). The rest of each model is HF's own code.

Each fixture directory (packages/models/tests/fixtures/hf_<name>/) holds transformers'
save_pretrained files (so no norm weights) with ``"qk_layernorm": false`` added to config.json
(the key mindtrain writes for such a model, which no HF class reads), and reference.safetensors
as tools/make_hf_fixtures.py / make_qwen3_fixtures.py write them: the batch, logits, loss and
gradients (``grad.<HF name>``).
"""

from __future__ import annotations

import sys

import numpy as np
import torch
from transformers import DeepseekV3ForCausalLM, Qwen3MoeForCausalLM

import fixture_io as fx
import make_hf_fixtures as ds3
import make_qwen3_fixtures as qw

# DeepSeek-V3: q_lora_rank (both latent norms), YaRN, interleaved rope; 2 layers (dense, MoE)
DS3 = dict(ds3.BASE, num_hidden_layers=2, vocab_size=64)
# Qwen3-MoE: layer 1 dense (mlp_only_layers), q/k/v/o biases, the aux loss in the loss
QWEN3_MOE = dict(qw.MOE, num_hidden_layers=2, mlp_only_layers=[1], attention_bias=True)
BATCH, SEQ = 2, 16


def make_ds3() -> None:
    name, spec = "ds3_no_qk_norm", DS3
    torch.manual_seed(2468)
    model = DeepseekV3ForCausalLM(ds3.hf_config(spec)).float().eval()
    for layer in model.model.layers:
        layer.self_attn.q_a_layernorm = torch.nn.Identity()
        layer.self_attn.kv_a_layernorm = torch.nn.Identity()
    with torch.no_grad():  # a non-zero correction bias, as make_hf_fixtures.py
        model.model.layers[1].mlp.gate.e_score_correction_bias.copy_(torch.randn(spec["n_routed_experts"]) * 0.05)
    input_ids, labels, loss_mask = fx.random_batch(5, spec["vocab_size"], BATCH, SEQ)
    logits = model(torch.from_numpy(input_ids)).logits
    loss = fx.masked_loss(logits, labels, loss_mask, spec["vocab_size"])
    loss.backward()
    ref = fx.reference(input_ids, labels, loss_mask, logits)
    ref["loss"] = np.array(loss.item(), np.float32)
    a0, a1 = "model.layers.0.self_attn.", "model.layers.1.self_attn."
    grads = ["model.embed_tokens.weight", "lm_head.weight", "model.norm.weight", a0 + "q_a_proj.weight",
             a0 + "q_b_proj.weight", a0 + "kv_a_proj_with_mqa.weight", a0 + "kv_b_proj.weight", a0 + "o_proj.weight",
             a1 + "q_a_proj.weight", a1 + "kv_a_proj_with_mqa.weight", "model.layers.0.mlp.gate_proj.weight",
             "model.layers.1.mlp.gate.weight", "model.layers.1.mlp.shared_experts.down_proj.weight",
             "model.layers.1.input_layernorm.weight"]
    fx.add_grads(ref, model, grads, spec["moe_intermediate_size"])
    assert not any("layernorm" in k and "self_attn" in k for k in model.state_dict())
    out = fx.write_fixture(name, model, ref)
    fx.mark_no_qk_norm(out)
    print(f"{name}: loss {loss.item():.6f}, wrote {out}")


def make_qwen3_moe() -> None:
    name, spec = "qwen3_moe_no_qk_norm", QWEN3_MOE
    torch.manual_seed(1357)
    model = Qwen3MoeForCausalLM(qw.hf_config("qwen3_moe", spec)).float().eval()
    for layer in model.model.layers:
        layer.self_attn.q_norm = torch.nn.Identity()
        layer.self_attn.k_norm = torch.nn.Identity()
    input_ids, labels, loss_mask = fx.random_batch(9, spec["vocab_size"], BATCH, SEQ)
    out = model(torch.from_numpy(input_ids), output_router_logits=True)
    lm_loss = fx.masked_loss(out.logits, labels, loss_mask, spec["vocab_size"])
    loss = lm_loss + spec["router_aux_loss_coef"] * out.aux_loss  # what HF adds to its loss
    loss.backward()
    ref = fx.reference(input_ids, labels, loss_mask, out.logits)
    ref["lm_loss"] = np.array(lm_loss.item(), np.float32)
    ref["loss"] = np.array(loss.item(), np.float32)
    ref["aux_loss"] = np.array(out.aux_loss.item(), np.float32)
    a = "model.layers.0.self_attn."
    grads = ["model.embed_tokens.weight", "lm_head.weight", "model.norm.weight", a + "q_proj.weight",
             a + "k_proj.weight", a + "v_proj.weight", a + "o_proj.weight", a + "q_proj.bias", a + "k_proj.bias",
             "model.layers.1.self_attn.q_proj.weight", "model.layers.1.self_attn.k_proj.weight",
             "model.layers.0.mlp.gate.weight", "model.layers.1.mlp.gate_proj.weight",
             "model.layers.1.post_attention_layernorm.weight"]
    fx.add_grads(ref, model, grads, spec["moe_intermediate_size"])
    assert not any(k.endswith(("q_norm.weight", "k_norm.weight")) for k in model.state_dict())
    out_dir = fx.write_fixture(name, model, ref)
    fx.mark_no_qk_norm(out_dir)
    print(f"{name}: loss {loss.item():.6f} (lm {lm_loss.item():.6f}), wrote {out_dir}")


def main() -> int:
    import transformers
    print(f"torch {torch.__version__}, transformers {transformers.__version__}")
    make_ds3()
    make_qwen3_moe()
    return 0


if __name__ == "__main__":
    sys.exit(main())
