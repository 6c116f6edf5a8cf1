"""Make the LoRA fixtures of mindtrain-trainer with PEFT's LoRA on HF transformers' models.

Run with the reference venv's Python (torch, transformers and peft are never package
dependencies):

    /tmp/fxvenv/bin/python tools/make_lora_fixtures.py

Each base model is an HF-parity fixture of mindtrain-models (packages/models/tests/fixtures/
hf_qlora: DeepSeek-V3 with q LoRA; hf_qwen3: Qwen3; hf_deepseek_v4: DeepSeek-V4; hf_deepseek_v4_mla:
DeepSeek-V4's mla variant, composed as its fixture tool composes it). PEFT's ``LoraConfig`` adapts the HF modules
that the MindFormers ``target_modules`` / ``exclude_layers`` regexes of ``SPECS`` select (written
here as the equivalent PEFT regex over HF module names), with rank 4, alpha 8 and no dropout;
the adapters are set to seeded normal values (both factors non-zero, so every adapter
gradient is). MindFormers' LoRA on a fused layer (``linear_qkv``: MLA's q_a_proj / q_proj +
kv_a_proj_with_mqa, Qwen3's q_proj + k_proj + v_proj; ``linear_fc1``: gate_proj + up_proj) is one
adapter: one ``lora_A`` shared by the parts. PEFT gives each HF module its own, so here the
parts' ``lora_A`` are tied by hand (one torch Parameter, the first part's: :data:`FUSED`): the
fused adapter's function, and its gradient is the sum over the parts (saved under each part's
name, as are its values). Each fixture directory (packages/trainer/tests/fixtures/lora_<name>/) holds PEFT's
``save_pretrained`` output (adapter_model.safetensors, adapter_config.json) and
reference.safetensors: the batch, the logits of the adapted model, the masked mean
cross-entropy ``loss`` and ``grad.<PEFT tensor name>`` of every adapter.
"""

from __future__ import annotations

import json
import os
import re
import sys

import numpy as np
import torch
from peft import LoraConfig, get_peft_model
from safetensors.numpy import load_file, save_file
from transformers import AutoModelForCausalLM

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import fixture_io as fx  # noqa: E402

OUT = os.path.join(fx.ROOT, "packages", "trainer", "tests", "fixtures")
RANK, ALPHA = 4, 8
SPECS = {
    # MindFormers: target_modules 'linear_(qkv|qb|kvb|proj)|output_layer', exclude_layers
    # 'layers\.2\.self_attention\.linear_(qb|kvb)' (MTP off: HF's DeepSeek-V3 has none). Its MLPs
    # are left out: PEFT on transformers 5 turns their gate/up/down_proj into adapters on the
    # fused experts' parameters (Qwen3's dense MLP has them)
    "dsv3": ("qlora", r"lm_head|model\.layers\.[01]\.self_attn\.(q_a_proj|kv_a_proj_with_mqa|q_b_proj|kv_b_proj|o_proj)"
                      r"|model\.layers\.2\.self_attn\.(q_a_proj|kv_a_proj_with_mqa|o_proj)"),
    # MindFormers: target_modules 'linear_qkv|linear_fc1|linear_fc2', exclude_layers 'layers\.1\.mlp\.linear_fc2'
    "qwen3": ("qwen3", r"model\.layers\.\d+\.(self_attn\.(q_proj|k_proj|v_proj)|mlp\.(gate_proj|up_proj))"
                       r"|model\.layers\.0\.mlp\.down_proj"),
    # DeepSeek-V4 (dsv4_hybrid; HF builds no MTP module). MindFormers: target_modules 'linear_|output_layer',
    # exclude_layers 'layers\.3\.self_attention\.core_attention\.indexer|layers\.0\.mlp': every Linear of its
    # attention (linear_q_down_proj, linear_q_up_proj, linear_kv_proj, linear_proj), compressors (linear_wkv,
    # linear_wgate) and indexer (its compressor's, linear_wq_b, linear_weights_proj), the shared experts'
    # linear_fc1 / linear_fc2 and the head. The grouped output projection (HF's o_a_proj, a GroupedLinear) is a
    # bare parameter in MindFormers (linear_o_group_proj), never adapted; the indexer's adapters get no
    # gradient (its choice is a top-k, in HF too): saved as zeros
    "dsv4": ("deepseek_v4", r"lm_head|model\.layers\.\d+\.self_attn\.(q_a_proj|q_b_proj|kv_proj|o_b_proj"
                            r"|compressor\.(kv_proj|gate_proj))"
                            r"|model\.layers\.[12]\.self_attn\.compressor\.indexer\.(kv_proj|gate_proj|q_b_proj"
                            r"|scorer\.weights_proj)"
                            r"|model\.layers\.[1-9]\.mlp\.shared_experts\.(gate_proj|up_proj|down_proj)"),
    # DeepSeek-V4's mla variant (the model of tools/make_deepseek_v4_mla_fixtures.py: V4 with transformers'
    # DeepseekV3Attention in every layer). MindFormers: target_modules
    # 'linear_(qkv|qb|kvb|proj)|shared_experts|output_layer', exclude_layers 'layers\.1\.self_attention\.linear_kvb'
    "dsv4_mla": ("deepseek_v4_mla", r"lm_head|model\.layers\.\d+\.self_attn\.(q_a_proj|kv_a_proj_with_mqa|q_b_proj|o_proj)"
                                    r"|model\.layers\.[02]\.self_attn\.kv_b_proj"
                                    r"|model\.layers\.\d+\.mlp\.shared_experts\.(gate_proj|up_proj|down_proj)"),
}


# HF modules MindFormers fuses into one layer, first part first (it holds the shared lora_A)
FUSED = [("self_attn.q_a_proj", "self_attn.kv_a_proj_with_mqa"), ("self_attn.q_proj", "self_attn.kv_a_proj_with_mqa"),
         ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), ("mlp.gate_proj", "mlp.up_proj"),
         ("mlp.shared_experts.gate_proj", "mlp.shared_experts.up_proj")]


def _tie_fused(model) -> int:
    """Tie the ``lora_A`` of the parts of every fused layer to its first part's; the count tied."""
    modules = dict(model.named_modules())
    tied = 0
    for name, module in modules.items():
        for group in FUSED:
            if not name.endswith("." + group[0]) or "default" not in getattr(module, "lora_A", {}):
                continue
            layer = name[:-len(group[0])]
            others = [modules.get(layer + g) for g in group[1:]]
            if any(o is None or "default" not in getattr(o, "lora_A", {}) for o in others):
                continue
            for o in others:
                o.lora_A["default"].weight = module.lora_A["default"].weight
                tied += 1
    return tied


def _base_model(base: str, base_dir: str):
    if base == "deepseek_v4_mla":  # transformers has no such model: the composition of its fixture tool
        from make_deepseek_v4_mla_fixtures import build

        return build()
    extra = {"experts_implementation": "eager"} if base.startswith("deepseek_v4") else {}
    return AutoModelForCausalLM.from_pretrained(base_dir, attn_implementation="eager", **extra).float().eval()


def make(name: str) -> None:
    base, pattern = SPECS[name]
    base_dir = fx.fixture_dir(base)
    batch = load_file(os.path.join(base_dir, "reference.safetensors"))
    model = _base_model(base, base_dir)
    # PEFT is given the full module names the regex selects (a list matches by name)
    targets = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and re.fullmatch(pattern, n)]
    model = get_peft_model(model, LoraConfig(r=RANK, lora_alpha=ALPHA, lora_dropout=0.0, target_modules=targets))
    rng = np.random.default_rng(2024)
    with torch.no_grad():
        for mod_name, module in model.named_modules():
            if hasattr(module, "lora_A") and "default" in getattr(module, "lora_A", {}):
                a, b = module.lora_A["default"].weight, module.lora_B["default"].weight
                a.copy_(torch.from_numpy(rng.normal(0, 0.1, tuple(a.shape)).astype(np.float32)))
                b.copy_(torch.from_numpy(rng.normal(0, 0.05, tuple(b.shape)).astype(np.float32)))
    tied = _tie_fused(model)
    input_ids, labels, loss_mask = (batch[k] for k in ("input_ids", "labels", "loss_mask"))
    logits = model(input_ids=torch.from_numpy(input_ids.astype(np.int64))).logits
    vocab = logits.shape[-1]
    loss = fx.masked_loss(logits, labels.astype(np.int64), loss_mask, vocab)
    loss.backward()
    out_dir = os.path.join(OUT, f"lora_{name}")
    model.save_pretrained(out_dir, save_embedding_layers=False)
    os.remove(os.path.join(out_dir, "README.md"))  # PEFT's model card
    saved = load_file(os.path.join(out_dir, "adapter_model.safetensors"))
    ref = {"input_ids": input_ids, "labels": labels, "loss_mask": loss_mask, "logits": logits.detach().numpy(),
           "loss": np.array(loss.item(), np.float32)}
    grads = {}
    for pname, p in model.named_parameters(remove_duplicate=False):  # a tied lora_A under each part's name
        if "lora_" in pname:
            # None: no gradient reaches it (DeepSeek-V4's indexer: its choice is a top-k)
            grads[pname.replace(".default.weight", ".weight")] = (np.zeros(tuple(p.shape), np.float32) if p.grad is None
                                                                   else p.grad.numpy().copy())
    assert set(grads) == set(saved), (sorted(set(grads) ^ set(saved)))[:4]
    for k, g in grads.items():
        ref[f"grad.{k}"] = g
    save_file(ref, os.path.join(out_dir, "reference.safetensors"))
    with open(os.path.join(out_dir, "adapter_config.json")) as f:
        conf = json.load(f)
    for k in saved:  # the tied parts' saved values are the shared one's
        assert np.array_equal(saved[k], dict(model.named_parameters(remove_duplicate=False))[
            k[:-len(".weight")] + ".default.weight"].detach().numpy()), k
    print(f"{name}: {len(saved) // 2} adapted modules ({tied} lora_A tied to a fused layer's first), loss {loss.item():.6f}, r {conf['r']} alpha {conf['lora_alpha']}, "
          f"wrote {out_dir}")


if __name__ == "__main__":
    for n in sys.argv[1:] or list(SPECS):
        make(n)
