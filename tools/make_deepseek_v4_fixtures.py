"""Make the DeepSeek-V4 HF-parity fixtures of mindtrain-models with HF transformers itself.

Run with the reference venv's Python (torch and transformers 5.24 are never package dependencies):

    /tmp/fxvenv/bin/python tools/make_deepseek_v4_fixtures.py               # writes the fixtures
    /tmp/fxvenv/bin/python tools/make_deepseek_v4_fixtures.py --check-save  # also: mindtrain save_pretrained -> HF

Each fixture directory (packages/models/tests/fixtures/hf_<name>/) holds config.json and
model.safetensors as transformers' save_pretrained writes them (the released checkpoints'
tensor names), and reference.safetensors with input_ids, labels, loss_mask, logits, ``loss``
= ``lm_loss`` (the masked mean cross-entropy of the logits against the labels; HF's V4 adds
no balance loss unless asked for router logits), each layer's routed experts
(``topk.<layer>``, sorted per token), each compressed-sparse layer's indexer choice
(``indexer.<layer>``: [B, S, T] 1 where the query keeps the entry) and the gradients of
``loss`` (``grad.<HF in-memory name>``; per-expert names for the experts).

The tiny models use all three attention kinds (sliding window, compressed sparse with the
lightning indexer keeping fewer entries than are visible, heavily compressed at a ratio the
sequence holds several windows of; YaRN on the compressed layers), hash-routed and learned
MoE layers, a SwiGLU limit low enough to clamp, and hyper-connection streams. Parameters HF
initialises to constants (sinks, position biases, hyper-connection bases and scales, the
correction bias, the token -> experts table) are given random values so that they matter.
HF's DeepseekV4ForCausalLM builds no MTP modules, so the fixtures have none.
"""

from __future__ import annotations

import sys

import numpy as np
import torch
from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

import fixture_io as fx

BASE = dict(
    vocab_size=64, hidden_size=32, moe_intermediate_size=16, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=1, head_dim=16, qk_rope_head_dim=8, q_lora_rank=24, num_experts_per_tok=2, n_routed_experts=8,
    n_shared_experts=1, scoring_func="sqrtsoftplus", routed_scaling_factor=1.5,
    layer_types=["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention",
                 "compressed_sparse_attention"],
    compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
    mlp_layer_types=["hash_moe", "hash_moe", "moe", "moe"], hc_mult=2, hc_sinkhorn_iters=4, hc_eps=1e-6,
    sliding_window=6, o_groups=2, o_lora_rank=8, index_n_heads=4, index_head_dim=16, index_topk=3,
    swiglu_limit=0.6, max_position_embeddings=64, initializer_range=0.1, rms_norm_eps=1e-6,
    rope_theta=10000.0, compress_rope_theta=160000.0,
    rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "beta_fast": 32,
                     "beta_slow": 1},
)
MODELS = {
    # seq 32: the indexer keeps 3 of up to 8 compressed-sparse entries, 4 heavily compressed (ratio 8)
    "deepseek_v4": (dict(BASE), 32),
    # seq 18 (no ratio divides it): 3 layers heavily compressed / compressed sparse / sliding,
    # sigmoid scores, one hash layer, 3 streams, the indexer keeping every visible entry, plain rope
    "deepseek_v4_ragged": (dict(BASE, num_hidden_layers=3, scoring_func="sigmoid", hc_mult=3,
                                layer_types=["heavily_compressed_attention", "compressed_sparse_attention",
                                             "sliding_attention"],
                                mlp_layer_types=["hash_moe", "moe", "moe"], index_topk=8, sliding_window=5,
                                rope_parameters={"rope_type": "default"}, swiglu_limit=10.0), 18),
}
BATCH = 2


def hf_config(spec: dict):
    return DeepseekV4Config(**spec, attn_implementation="eager", experts_implementation="eager")


def randomise_constants(model, spec: dict, gen: torch.Generator) -> None:
    """Random values for what HF initialises to constants, so the parity covers them."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("sinks", "position_bias", ".base", "hc_base")):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
            elif name.endswith((".scale", "hc_scale")):
                p.copy_(1.0 + torch.randn(p.shape, generator=gen) * 0.3)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn(b.shape, generator=gen) * 0.05)
            elif name.endswith("tid2eid"):
                e, k = spec["n_routed_experts"], spec["num_experts_per_tok"]
                table = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(b.shape[0])])
                b.copy_(table)


def record_indexers(model) -> dict[int, list]:
    """Hook each compressed-sparse layer's indexer: its [B, S, k] choices (-1 = none)."""
    out: dict[int, list] = {}
    for i, layer in enumerate(model.model.layers):
        comp = layer.self_attn.compressor
        if comp is not None and hasattr(comp, "indexer"):
            out[i] = []
            comp.indexer.register_forward_hook(lambda _m, _in, o, i=i: out[i].append(o.detach()))
            comp.indexer.scorer.register_forward_hook(lambda _m, _in, o, i=i: out[i].append(o.detach()))
    return out


def check_no_ties(scores: torch.Tensor, k: int, ratio: int, name: str) -> None:
    """The indexer's k-th and (k+1)-th visible scores differ per query (a tie would make the
    choice depend on the top-k implementation)."""
    b, s, t = scores.shape
    for q in range(s):
        visible = (q + 1) // ratio
        if visible <= k:
            continue
        vals = torch.sort(scores[:, q, :visible], dim=-1, descending=True).values
        gap = (vals[:, k - 1] - vals[:, k]).abs().min().item()
        if gap < 1e-5:
            raise SystemExit(f"{name}: indexer scores tie at query {q} (gap {gap:g}); change the seed")


def grad_names(spec: dict, busiest: dict[int, list[int]]) -> list[str]:
    names = ["model.embed_tokens.weight", "model.norm.weight", "lm_head.weight", "model.hc_head.hc_fn",
             "model.hc_head.hc_base", "model.hc_head.hc_scale"]
    for i, kind in enumerate(spec["layer_types"]):
        p = f"model.layers.{i}."
        a = p + "self_attn."
        names += [a + "q_a_proj.weight", a + "q_a_norm.weight", a + "q_b_proj.weight", a + "kv_proj.weight",
                  a + "kv_norm.weight", a + "o_a_proj.weight", a + "o_b_proj.weight", a + "sinks",
                  p + "input_layernorm.weight", p + "post_attention_layernorm.weight"]
        names += [p + f"{hc}.{w}" for hc in ("attn_hc", "ffn_hc") for w in ("fn", "base", "scale")]
        if kind != "sliding_attention":
            c = a + "compressor."
            names += [c + "kv_proj.weight", c + "gate_proj.weight", c + "position_bias", c + "kv_norm.weight"]
        e = busiest[i]
        m = p + "mlp."
        names += [m + "gate.weight", m + "shared_experts.gate_proj.weight", m + "shared_experts.up_proj.weight",
                  m + "shared_experts.down_proj.weight", m + f"experts.{e[0]}.gate_proj.weight",
                  m + f"experts.{e[1]}.up_proj.weight", m + f"experts.{e[2]}.down_proj.weight"]
    return names


def make(name: str, spec: dict, seq: int) -> None:
    torch.manual_seed(4321 + len(name))
    model = DeepseekV4ForCausalLM(hf_config(spec)).float().eval()
    gen = torch.Generator().manual_seed(99 + len(name))
    randomise_constants(model, spec, gen)
    input_ids, labels, loss_mask = fx.random_batch(11, spec["vocab_size"], BATCH, seq)
    choices = fx.record_choices({i: layer.mlp.gate for i, layer in enumerate(model.model.layers)})
    indexers = record_indexers(model)
    clamped = []  # the shared experts' gate pre-activations above the SwiGLU limit
    for layer in model.model.layers:
        layer.mlp.shared_experts.gate_proj.register_forward_hook(
            lambda _m, _in, o: clamped.append(int((o > spec["swiglu_limit"]).sum())))
    logits = model(torch.from_numpy(input_ids)).logits
    loss = fx.masked_loss(logits, labels, loss_mask, spec["vocab_size"])
    loss.backward()

    ref = fx.reference(input_ids, labels, loss_mask, logits)
    ref["loss"] = ref["lm_loss"] = np.array(loss.item(), np.float32)
    fx.add_choices(ref, choices)
    for i, (scores, top) in indexers.items():
        t = scores.shape[-1]
        check_no_ties(scores, min(spec["index_topk"], t), 4, name)
        kept = np.zeros((BATCH, seq, t), np.float32)
        for bi in range(BATCH):
            for q in range(seq):
                for j in top[bi, q].tolist():
                    if j >= 0:
                        kept[bi, q, j] = 1.0
        ref[f"indexer.{i}"] = kept
    busiest = fx.busiest_experts(choices, spec["n_routed_experts"])
    fx.add_grads(ref, model, grad_names(spec, busiest), spec["moe_intermediate_size"])
    out_dir = fx.write_fixture(name, model, ref)
    kept = {i: f"{ref[f'indexer.{i}'].sum(-1).max():.0f}" for i in indexers}
    print(f"{name}: loss {loss.item():.6f}, shared-expert gates clamped {clamped}, indexer keeps at most {kept} "
          f"entries per query, wrote {out_dir}")


def check_save(name: str, ms_python: list[str]) -> float:
    """mindtrain from_pretrained -> save_pretrained -> transformers loads -> same logits and
    the same structural config."""
    def load(path):
        return DeepseekV4ForCausalLM.from_pretrained(path, attn_implementation="eager",
                                                     experts_implementation="eager").float().eval()

    return fx.check_save(name, load, ms_python, BATCH, MODELS[name][1],
                         config_keys=("layer_types", "compress_rates", "mlp_layer_types", "rope_parameters",
                                      "hc_mult", "hc_sinkhorn_iters", "sliding_window", "o_groups", "o_lora_rank",
                                      "index_n_heads", "index_head_dim", "index_topk", "swiglu_limit",
                                      "scoring_func", "qk_rope_head_dim", "head_dim", "q_lora_rank"))


def main() -> int:
    return fx.main(__doc__.splitlines()[0], list(MODELS), lambda name: make(name, *MODELS[name]), check_save)


if __name__ == "__main__":
    sys.exit(main())
