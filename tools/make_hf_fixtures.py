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

import argparse
import json
import os
import subprocess
import sys
import tempfile

import numpy as np
import torch
from safetensors.numpy import save_file
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
OUT = os.path.join(ROOT, "packages", "models", "tests", "fixtures")

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


def _grad(model, name: str, moe_inter: int) -> np.ndarray:
    params = dict(model.named_parameters())
    if ".mlp.experts." in name:  # official per-expert name -> transformers' stacked tensors
        prefix, e, proj, _ = name.rsplit(".", 3)
        e = int(e)
        if proj == "down_proj":
            return params[f"{prefix}.down_proj"].grad[e].numpy()
        gu = params[f"{prefix}.gate_up_proj"].grad[e].numpy()
        return gu[:moe_inter] if proj == "gate_proj" else gu[moe_inter:]
    return params[name].grad.numpy()


def make(name: str, spec: dict) -> None:
    torch.manual_seed(1234 + len(name))
    model = DeepseekV3ForCausalLM(hf_config(spec)).float().eval()
    with torch.no_grad():  # a non-zero correction bias that changes some choices
        for layer in model.model.layers[spec["first_k_dense_replace"]:]:
            layer.mlp.gate.e_score_correction_bias.copy_(torch.randn(spec["n_routed_experts"]) * 0.05)
    rng = np.random.default_rng(7)
    input_ids = rng.integers(0, spec["vocab_size"], (BATCH, SEQ)).astype(np.int64)
    labels = rng.integers(0, spec["vocab_size"], (BATCH, SEQ)).astype(np.int64)
    loss_mask = (rng.random((BATCH, SEQ)) > 0.2).astype(np.float32)

    choices: dict[int, torch.Tensor] = {}

    def hook(idx):
        def fn(_module, _inputs, output):
            choices[idx] = output[2].detach()
        return fn

    for i, layer in enumerate(model.model.layers):
        if i >= spec["first_k_dense_replace"]:
            layer.mlp.gate.register_forward_hook(hook(i))
    logits = model(torch.from_numpy(input_ids)).logits
    ce = torch.nn.functional.cross_entropy(logits.reshape(-1, spec["vocab_size"]),
                                           torch.from_numpy(labels).reshape(-1), reduction="none")
    mask = torch.from_numpy(loss_mask).reshape(-1)
    loss = (ce * mask).sum() / mask.sum()
    loss.backward()

    ref = {
        "input_ids": input_ids.astype(np.int32), "labels": labels.astype(np.int32), "loss_mask": loss_mask,
        "logits": logits.detach().numpy(), "loss": np.array(loss.item(), np.float32),
    }
    for i, idx in choices.items():
        ref[f"topk.{i}"] = np.sort(idx.numpy(), -1).astype(np.int32)
    grad_names = GRAD_NAMES + ["model.layers.1.mlp.experts.3.gate_proj.weight",
                               "model.layers.2.mlp.experts.5.down_proj.weight",
                               "model.layers.2.mlp.experts.0.up_proj.weight"]
    grad_names += (["model.layers.0.self_attn.q_a_proj.weight", "model.layers.1.self_attn.q_b_proj.weight"]
                   if spec["q_lora_rank"] else ["model.layers.1.self_attn.q_proj.weight"])
    for g in grad_names:
        ref[f"grad.{g}"] = np.ascontiguousarray(_grad(model, g, spec["moe_intermediate_size"]))

    out = os.path.join(OUT, f"hf_{name}")
    os.makedirs(out, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    save_file({k: np.ascontiguousarray(v) for k, v in ref.items()}, os.path.join(out, "reference.safetensors"))
    for extra in ("generation_config.json",):
        if os.path.exists(os.path.join(out, extra)):
            os.remove(os.path.join(out, extra))
    print(f"{name}: loss {loss.item():.6f}, wrote {out}")


_MS_SAVE = """
import sys, mindspore as ms
ms.set_device('CPU')
import mindtrain.models as mm
m = mm.from_pretrained(sys.argv[1], jit=False)
m.save_pretrained(sys.argv[2])
"""


def check_save(name: str, ms_python: list[str]) -> float:
    """mindtrain from_pretrained -> save_pretrained -> transformers loads -> same logits."""
    src = os.path.join(OUT, f"hf_{name}")
    with tempfile.TemporaryDirectory() as tmp:
        script = os.path.join(tmp, "save.py")
        with open(script, "w") as f:
            f.write(_MS_SAVE)
        dst = os.path.join(tmp, "saved")
        subprocess.run(ms_python + [script, src, dst], check=True, cwd=ROOT)
        with open(os.path.join(dst, "config.json")) as f:
            print(f"{name}: mindtrain wrote config keys {sorted(json.load(f))[:6]}...")
        model = DeepseekV3ForCausalLM.from_pretrained(dst, attn_implementation="eager").float().eval()
        ref = DeepseekV3ForCausalLM.from_pretrained(src, attn_implementation="eager").float().eval()
        ids = torch.randint(0, model.config.vocab_size, (BATCH, SEQ), generator=torch.Generator().manual_seed(3))
        with torch.no_grad():
            diff = (model(ids).logits - ref(ids).logits).abs().max().item()
    print(f"{name}: mindtrain save_pretrained -> transformers from_pretrained, max |logits diff| {diff:.3g}")
    return diff


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check-save", action="store_true", help="also check mindtrain save_pretrained -> HF")
    ap.add_argument("--only-check", action="store_true", help="skip regenerating fixtures")
    ap.add_argument("--ms-python", default="hatch run python", help="command running the workspace Python")
    args = ap.parse_args()
    import transformers
    print(f"torch {torch.__version__}, transformers {transformers.__version__}")
    if not args.only_check:
        for name, spec in MODELS.items():
            make(name, spec)
    if args.check_save or args.only_check:
        worst = max(check_save(name, args.ms_python.split()) for name in MODELS)
        if worst > 1e-5:
            print("FAIL: logits differ", file=sys.stderr)
            return 1
        print("OK: transformers loads mindtrain's save_pretrained output with identical logits")
    return 0


if __name__ == "__main__":
    sys.exit(main())
