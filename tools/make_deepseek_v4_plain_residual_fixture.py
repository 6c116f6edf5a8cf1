"""Make the ``enable_hyper_connections: false`` DeepSeek-V4 parity fixture of mindtrain-models:
HF transformers' DeepseekV4ForCausalLM with plain residual layers instead of the hyper-connection
streams.

Run with the reference venv's Python (torch and transformers are never package dependencies):

    /tmp/fxvenv/bin/python tools/make_deepseek_v4_plain_residual_fixture.py

HF has no switch for the streams. What MindFormers builds with ``enable_hyper_connections:
false`` (pynative gpt_layer_specs: ``TransformerLayer`` instead of
``HyperConnectionTransformerLayer``; TransformerBlock / MultiTokenPredictionLayer: no stream
expansion, no ``hc_head``, no collapse) is a pre-norm residual layer:

    h = h + self_attn(input_layernorm(h));  h = h + mlp(post_attention_layernorm(h))

and the final norm on ``h`` directly. The reference is HF's model built with ``hc_mult=1``
whose decoder layers' ``forward`` is replaced by exactly that wiring around HF's own attention
and MoE modules (``attn_hc`` / ``ffn_hc`` deleted) and whose ``hc_head`` is replaced by taking
the one stream. Everything else (attention of all three kinds, hash / learned MoE, rope,
norms, head) is HF's code.

The fixture directory (packages/models/tests/fixtures/hf_deepseek_v4_plain/) holds
transformers' save_pretrained files (no hyper-connection weights) with
``"enable_hyper_connections": false`` and ``"enable_hc_head": false`` added to config.json
(mindtrain's keys; no HF class reads them), and reference.safetensors as
tools/make_deepseek_v4_fixtures.py writes it (batch, logits, loss, gradients).
"""

from __future__ import annotations

import json
import os
import sys
import types

import numpy as np
import torch
from transformers import DeepseekV4ForCausalLM

import fixture_io as fx
import make_deepseek_v4_fixtures as v4

NAME = "deepseek_v4_plain"
# three layers: compressed sparse (the indexer), heavily compressed, sliding; hash then learned MoE
SPEC = dict(v4.BASE, num_hidden_layers=3, hc_mult=1,
            layer_types=["compressed_sparse_attention", "heavily_compressed_attention", "sliding_attention"],
            mlp_layer_types=["hash_moe", "moe", "moe"])
SEQ = 24


def plain_forward(self, hidden_states, input_ids=None, **kwargs):
    """MindFormers' TransformerLayer wiring on the one stream [B, S, 1, H]."""
    h = hidden_states[:, :, 0]
    attn_output, _ = self.self_attn(self.input_layernorm(h), **kwargs)
    h = h + attn_output
    h = h + self.mlp(self.post_attention_layernorm(h), input_ids=input_ids)
    return h.unsqueeze(2)


class OneStream(torch.nn.Module):
    """The final collapse without streams: the residual itself."""

    def forward(self, x):
        return x[:, :, 0]


def main() -> int:
    import transformers
    print(f"torch {torch.__version__}, transformers {transformers.__version__}")
    torch.manual_seed(8642)
    model = DeepseekV4ForCausalLM(v4.hf_config(SPEC)).float().eval()
    v4.randomise_constants(model, SPEC, torch.Generator().manual_seed(97))
    for layer in model.model.layers:
        del layer.attn_hc, layer.ffn_hc
        layer.forward = types.MethodType(plain_forward, layer)
    model.model.hc_head = OneStream()
    assert not any(".attn_hc." in k or ".ffn_hc." in k or "hc_head" in k for k in model.state_dict())
    input_ids, labels, loss_mask = fx.random_batch(13, SPEC["vocab_size"], v4.BATCH, SEQ)
    logits = model(torch.from_numpy(input_ids)).logits
    loss = fx.masked_loss(logits, labels, loss_mask, SPEC["vocab_size"])
    loss.backward()
    ref = fx.reference(input_ids, labels, loss_mask, logits)
    ref["loss"] = ref["lm_loss"] = np.array(loss.item(), np.float32)
    names = ["model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"]
    for i, kind in enumerate(SPEC["layer_types"]):
        p = f"model.layers.{i}."
        a = p + "self_attn."
        names += [a + "q_a_proj.weight", a + "kv_proj.weight", a + "o_b_proj.weight", a + "sinks",
                  p + "input_layernorm.weight", p + "post_attention_layernorm.weight", p + "mlp.gate.weight",
                  p + "mlp.shared_experts.down_proj.weight"]
        if kind != "sliding_attention":
            names.append(a + "compressor.kv_proj.weight")
    fx.add_grads(ref, model, names, SPEC["moe_intermediate_size"])
    out = fx.write_fixture(NAME, model, ref)
    path = os.path.join(out, "config.json")
    with open(path, encoding="utf-8") as f:
        config = json.load(f)
    config.update(enable_hyper_connections=False, enable_hc_head=False)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2)
    print(f"{NAME}: loss {loss.item():.6f}, wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
