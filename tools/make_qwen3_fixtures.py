"""Make the Qwen3 / Qwen3-MoE HF-parity fixtures of mindtrain-models with HF transformers itself.

Run with the reference venv's Python (torch and transformers are never package dependencies):

    python3 -m venv /tmp/hfvenv && /tmp/hfvenv/bin/pip install torch==2.13.0 transformers safetensors numpy
    /tmp/hfvenv/bin/python tools/make_qwen3_fixtures.py               # writes the fixtures
    /tmp/hfvenv/bin/python tools/make_qwen3_fixtures.py --check-save  # also: mindtrain save_pretrained -> HF

Each fixture directory (packages/models/tests/fixtures/hf_<name>/) holds config.json and
model.safetensors as transformers' save_pretrained writes them, and reference.safetensors with
input_ids, labels, loss_mask, logits, ``lm_loss`` (the masked mean cross-entropy of the logits
against the labels, aligned as mindtrain's are), for MoE models ``aux_loss`` (HF's
``load_balancing_loss_func``, the model's ``aux_loss`` output with ``output_router_logits``)
and the router's top-k choices per MoE layer (``topk.<layer>``, sorted per token), ``loss``
(``lm_loss``, plus ``router_aux_loss_coef * aux_loss`` when the config's
``output_router_logits`` is true: what HF's Qwen3MoeForCausalLM adds) and the gradients of
``loss`` (``grad.<HF name>``; per-expert names for the experts).

``--check-save`` loads each fixture with mindtrain (workspace env, ``hatch run python``), saves
it with mindtrain's save_pretrained, loads that directory with transformers and compares logits.
"""

from __future__ import annotations

import sys

import numpy as np
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

import fixture_io as fx

BASE = dict(
    vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, hidden_act="silu", max_position_embeddings=64, initializer_range=0.1,
    rms_norm_eps=1e-6, rope_theta=10000.0, rope_scaling=None, attention_bias=False, tie_word_embeddings=False,
    bos_token_id=0, eos_token_id=1,
)
MOE = dict(BASE, num_hidden_layers=3, intermediate_size=24, moe_intermediate_size=8, num_experts=8,
           num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[1], norm_topk_prob=True,
           output_router_logits=True, router_aux_loss_coef=0.05)
MODELS = {
    # GQA 4/2, head_dim 16 != hidden / heads (8), q/k/v/o biases, YaRN
    "qwen3": ("qwen3", dict(BASE, attention_bias=True,
                            rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16,
                                          "beta_fast": 32, "beta_slow": 1})),
    # tied embeddings, one key/value head for 4 query heads, linear scaling, theta 1e6
    "qwen3_tied": ("qwen3", dict(BASE, num_hidden_layers=1, num_key_value_heads=1, tie_word_embeddings=True,
                                 rope_theta=1e6, rope_scaling={"rope_type": "linear", "factor": 2.0})),
    # 8 experts top-2 (normalised), layer 1 dense (mlp_only_layers), the aux loss in the loss
    "qwen3_moe": ("qwen3_moe", dict(MOE)),
    # decoder_sparse_step 2 (layer 1 sparse), unnormalised top-k, aux loss reported only, tied,
    # biases, no head_dim (hidden / heads = 8)
    "qwen3_moe_step2": ("qwen3_moe", dict({k: v for k, v in MOE.items() if k != "head_dim"}, num_hidden_layers=2,
                                          decoder_sparse_step=2, mlp_only_layers=[], norm_topk_prob=False,
                                          output_router_logits=False, tie_word_embeddings=True, attention_bias=True,
                                          moe_intermediate_size=6)),
}
CLASSES = {"qwen3": (Qwen3Config, Qwen3ForCausalLM), "qwen3_moe": (Qwen3MoeConfig, Qwen3MoeForCausalLM)}
BATCH, SEQ = 2, 16


def hf_config(kind: str, spec: dict):
    spec = dict(spec)
    rope = dict(spec.pop("rope_scaling") or {"rope_type": "default"})
    rope["rope_theta"] = spec.pop("rope_theta")
    extra = {"experts_implementation": "eager"} if kind == "qwen3_moe" else {}  # the modeling file's own loop
    return CLASSES[kind][0](**spec, rope_parameters=rope, attn_implementation="eager", **extra)


def moe_layers(kind: str, spec: dict) -> list[int]:
    if kind != "qwen3_moe":
        return []
    return [i for i in range(spec["num_hidden_layers"])
            if i not in spec["mlp_only_layers"] and (i + 1) % spec["decoder_sparse_step"] == 0]


def grad_names(kind: str, spec: dict, busiest: dict[int, list[int]]) -> list[str]:
    """The parameters whose gradients the fixture keeps; ``busiest``: per MoE layer the experts
    by tokens routed to them, most first (an expert with no token has a zero gradient)."""
    names = ["model.embed_tokens.weight", "model.norm.weight"]
    if not spec["tie_word_embeddings"]:
        names.append("lm_head.weight")
    last = spec["num_hidden_layers"] - 1
    a = "model.layers.0.self_attn."
    names += [a + "q_proj.weight", a + "k_proj.weight", a + "v_proj.weight", a + "o_proj.weight",
              a + "q_norm.weight", a + "k_norm.weight", f"model.layers.{last}.self_attn.k_norm.weight",
              f"model.layers.{last}.input_layernorm.weight", f"model.layers.{last}.post_attention_layernorm.weight"]
    if spec["attention_bias"]:
        names += [a + "q_proj.bias", a + "v_proj.bias", a + "o_proj.bias"]
    sparse = moe_layers(kind, spec)
    dense = [i for i in range(spec["num_hidden_layers"]) if i not in sparse]
    names += [f"model.layers.{dense[0]}.mlp.gate_proj.weight", f"model.layers.{dense[0]}.mlp.down_proj.weight"]
    for i in sparse:
        e = busiest[i]
        names += [f"model.layers.{i}.mlp.gate.weight", f"model.layers.{i}.mlp.experts.{e[0]}.gate_proj.weight",
                  f"model.layers.{i}.mlp.experts.{e[1]}.up_proj.weight",
                  f"model.layers.{i}.mlp.experts.{e[2]}.down_proj.weight"]
    return names


def make(name: str, kind: str, spec: dict) -> None:
    torch.manual_seed(4321 + len(name))
    model = CLASSES[kind][1](hf_config(kind, spec)).float().eval()
    input_ids, labels, loss_mask = fx.random_batch(11, spec["vocab_size"], BATCH, SEQ)
    sparse = moe_layers(kind, spec)
    choices = fx.record_choices({i: model.model.layers[i].mlp.gate for i in sparse})
    out = model(torch.from_numpy(input_ids), output_router_logits=True) if sparse else model(torch.from_numpy(input_ids))
    logits = out.logits
    lm_loss = fx.masked_loss(logits, labels, loss_mask, spec["vocab_size"])
    loss = lm_loss
    if sparse and spec["output_router_logits"]:
        loss = lm_loss + spec["router_aux_loss_coef"] * out.aux_loss  # what HF adds to its loss
    loss.backward()

    ref = fx.reference(input_ids, labels, loss_mask, logits)
    ref["lm_loss"] = np.array(lm_loss.item(), np.float32)
    ref["loss"] = np.array(loss.item(), np.float32)
    if sparse:
        ref["aux_loss"] = np.array(out.aux_loss.item(), np.float32)
    fx.add_choices(ref, choices)
    busiest = fx.busiest_experts(choices, spec.get("num_experts", 0))  # dense: no choices
    fx.add_grads(ref, model, grad_names(kind, spec, busiest), spec.get("moe_intermediate_size", 0))
    out_dir = fx.write_fixture(name, model, ref)
    aux = f", aux {ref['aux_loss'].item():.6f}" if sparse else ""
    print(f"{name}: loss {loss.item():.6f} (lm {lm_loss.item():.6f}{aux}), wrote {out_dir}")


def check_save(name: str, kind: str, ms_python: list[str]) -> float:
    """mindtrain from_pretrained -> save_pretrained -> transformers loads -> same logits and
    the same structural config."""
    cls = CLASSES[kind][1]
    extra = {"experts_implementation": "eager"} if kind == "qwen3_moe" else {}

    def load(path):
        return cls.from_pretrained(path, attn_implementation="eager", **extra).float().eval()

    return fx.check_save(name, load, ms_python, BATCH, SEQ,
                         config_keys=("head_dim", "num_key_value_heads", "tie_word_embeddings", "rope_parameters",
                                      "num_experts", "mlp_only_layers", "decoder_sparse_step", "norm_topk_prob",
                                      "output_router_logits", "router_aux_loss_coef", "attention_bias"))


def main() -> int:
    return fx.main(__doc__.splitlines()[0], list(MODELS), lambda name: make(name, *MODELS[name]),
                   lambda name, ms_python: check_save(name, MODELS[name][0], ms_python))


if __name__ == "__main__":
    sys.exit(main())
