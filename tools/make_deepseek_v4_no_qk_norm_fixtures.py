"""Make the ``qk_layernorm: false`` DeepSeek-V4 parity fixtures of mindtrain-models: HF
transformers' DeepseekV4 with its query-latent and key/value norms taken out, in both of
MindFormers' attention variants.

Run with the reference venv's Python (torch and transformers are never package dependencies):

    /tmp/fxvenv/bin/python tools/make_deepseek_v4_no_qk_norm_fixtures.py

HF has no switch for these norms, so the reference replaces the modules by ``torch.nn.Identity``
(an RMSNorm with weight ones is not the identity: it still divides by the rms), as
tools/make_no_qk_norm_fixtures.py does for DeepSeek-V3 and Qwen3-MoE:

- ``deepseek_v4_no_qk_norm`` (``dsv4_hybrid``): every layer's ``self_attn.q_a_norm`` (the
  compressed query latent's norm, whose output the lightning indexer reads too) and
  ``self_attn.kv_norm``: what MindFormers' DSv4HybridSelfAttention builds with ``qk_layernorm:
  false`` (pynative experimental_attention_variant_module_specs.py: IdentityOp for
  q_layernorm / kv_layernorm). The fixed per-head query norm (HF's unweighted RMSNorm,
  MindFormers' q_rms_gamma) and the compressors' and indexer's own ``kv_norm`` stay, as
  MindFormers' Compressor always builds its norm. Three layers (compressed sparse with the
  indexer, heavily compressed, sliding), hyper-connection streams, hash then learned MoE.
- ``deepseek_v4_mla_no_qk_norm`` (``mla``): HF has no V4 model with this attention; as
  tools/make_deepseek_v4_mla_fixtures.py, V4's model with every layer's ``self_attn``
  transformers' DeepseekV3Attention (its rope and causal mask), here with its
  ``q_a_layernorm`` / ``kv_a_layernorm`` replaced by the identity (MindFormers'
  MLASelfAttention with IdentityOp q_layernorm / k_layernorm, as for DeepSeek-V3).

Each fixture directory (packages/models/tests/fixtures/hf_<name>/) holds transformers'
save_pretrained files (no such norm weights) with ``"qk_layernorm": false`` added to
config.json (the key mindtrain writes for such a model, which no HF class reads), the mla one
its ``overrides.json`` (the variant's fields), and reference.safetensors as the other V4
fixture makers write it (batch, logits, ``loss`` = ``lm_loss``, the routers' choices, the
gradients by HF's in-memory names).
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np
import torch
from transformers import DeepseekV3Config, DeepseekV4Config, DeepseekV4ForCausalLM

import fixture_io as fx
import make_deepseek_v4_fixtures as v4
import make_deepseek_v4_mla_fixtures as mla

HYBRID = dict(v4.BASE, num_hidden_layers=3,
              layer_types=["compressed_sparse_attention", "heavily_compressed_attention", "sliding_attention"],
              mlp_layer_types=["hash_moe", "moe", "moe"])
HYBRID_SEQ = 24  # the indexer keeps 3 of up to 6 entries, 3 heavily compressed entries (ratio 8)
MLA_V4 = dict(mla.V4, num_hidden_layers=2, layer_types=["sliding_attention"] * 2, mlp_layer_types=["hash_moe", "moe"])
MLA_V3 = dict(mla.V3, num_hidden_layers=2)


def _run(name: str, model, spec: dict, seq: int, seed: int, grad_names) -> dict:
    """Forward + loss + backward on a random batch; the reference arrays."""
    input_ids, labels, loss_mask = fx.random_batch(seed, spec["vocab_size"], v4.BATCH, seq)
    choices = fx.record_choices({i: layer.mlp.gate for i, layer in enumerate(model.model.layers)})
    indexers = v4.record_indexers(model) if spec is HYBRID else {}  # the mla variant has no indexer
    logits = model(torch.from_numpy(input_ids)).logits
    loss = fx.masked_loss(logits, labels, loss_mask, spec["vocab_size"])
    loss.backward()
    for scores, _top in indexers.values():
        v4.check_no_ties(scores, spec["index_topk"], 4, name)
    ref = fx.reference(input_ids, labels, loss_mask, logits)
    ref["loss"] = ref["lm_loss"] = np.array(loss.item(), np.float32)
    fx.add_choices(ref, choices)
    busiest = fx.busiest_experts(choices, spec["n_routed_experts"])
    fx.add_grads(ref, model, grad_names(busiest), spec["moe_intermediate_size"])
    print(f"{name}: loss {loss.item():.6f}")
    return ref


def make_hybrid() -> None:
    name = "deepseek_v4_no_qk_norm"
    torch.manual_seed(1234)
    model = DeepseekV4ForCausalLM(v4.hf_config(HYBRID)).float().eval()
    v4.randomise_constants(model, HYBRID, torch.Generator().manual_seed(55))
    for layer in model.model.layers:
        layer.self_attn.q_a_norm = torch.nn.Identity()
        layer.self_attn.kv_norm = torch.nn.Identity()
    state = model.state_dict()
    assert not any(k.endswith(("self_attn.q_a_norm.weight", "self_attn.kv_norm.weight")) for k in state)
    assert any(k.endswith("compressor.kv_norm.weight") for k in state)  # the compressors' norms stay

    def grads(busiest):
        return [n for n in v4.grad_names(HYBRID, busiest)
                if not n.endswith(("self_attn.q_a_norm.weight", "self_attn.kv_norm.weight"))]

    ref = _run(name, model, HYBRID, HYBRID_SEQ, 23, grads)
    out = fx.write_fixture(name, model, ref)
    fx.mark_no_qk_norm(out)
    print(f"wrote {out}")


def make_mla() -> None:
    name = "deepseek_v4_mla_no_qk_norm"
    torch.manual_seed(4048)
    model = DeepseekV4ForCausalLM(DeepseekV4Config(**MLA_V4, attn_implementation="eager",
                                                   experts_implementation="eager"))
    v3 = DeepseekV3Config(**MLA_V3, attn_implementation="eager")
    for i, layer in enumerate(model.model.layers):
        layer.self_attn = mla.MLAInV4(v3, i)
        layer.self_attn.q_a_layernorm = torch.nn.Identity()
        layer.self_attn.kv_a_layernorm = torch.nn.Identity()
    model.model.hc_head = mla.StreamMean()
    model = model.float().eval()
    mla.randomise_constants(model, MLA_V4, torch.Generator().manual_seed(66))
    assert not any("layernorm" in k and "self_attn" in k for k in model.state_dict())

    def grads(busiest):
        names = ["model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"]
        for i in range(MLA_V4["num_hidden_layers"]):
            p = f"model.layers.{i}."
            a = p + "self_attn."
            names += [a + w + ".weight" for w in ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj",
                                                  "o_proj")]
            names += [p + "input_layernorm.weight", p + "post_attention_layernorm.weight"]
            if i:  # layer 0's streams are copies of one embedding: its collapse weights' gradients are round-off
                names += [p + f"{hc}.{w}" for hc in ("attn_hc", "ffn_hc") for w in ("fn", "base", "scale")]
            e, m = busiest[i], p + "mlp."
            names += [m + "gate.weight", m + "shared_experts.down_proj.weight", m + f"experts.{e[0]}.gate_proj.weight"]
        return names

    ref = _run(name, model, MLA_V4, mla.SEQ, 29, grads)
    out = fx.write_fixture(name, model, ref)
    fx.mark_no_qk_norm(out)
    with open(os.path.join(out, "overrides.json"), "w", encoding="utf-8") as f:
        json.dump(dict(mla.OVERRIDES), f, indent=1)
    print(f"wrote {out}")


def main() -> int:
    import transformers
    print(f"torch {torch.__version__}, transformers {transformers.__version__}")
    make_hybrid()
    make_mla()
    return 0


if __name__ == "__main__":
    sys.exit(main())
