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

import argparse
import json
import os
import subprocess
import sys
import tempfile

import numpy as np
import torch
from safetensors.numpy import save_file
from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
OUT = os.path.join(ROOT, "packages", "models", "tests", "fixtures")

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


def _grad(model, name: str, moe_inter: int) -> np.ndarray:
    params = dict(model.named_parameters())
    if ".mlp.experts." in name:  # HF's per-expert file name -> transformers' stacked tensors
        prefix, e, proj, _ = name.rsplit(".", 3)
        e = int(e)
        if proj == "down_proj":
            return params[f"{prefix}.down_proj"].grad[e].numpy()
        gu = params[f"{prefix}.gate_up_proj"].grad[e].numpy()
        return gu[:moe_inter] if proj == "gate_proj" else gu[moe_inter:]
    return params[name].grad.numpy()


def make(name: str, kind: str, spec: dict) -> None:
    torch.manual_seed(4321 + len(name))
    model = CLASSES[kind][1](hf_config(kind, spec)).float().eval()
    rng = np.random.default_rng(11)
    input_ids = rng.integers(0, spec["vocab_size"], (BATCH, SEQ)).astype(np.int64)
    labels = rng.integers(0, spec["vocab_size"], (BATCH, SEQ)).astype(np.int64)
    loss_mask = (rng.random((BATCH, SEQ)) > 0.2).astype(np.float32)

    choices: dict[int, torch.Tensor] = {}

    def hook(idx):
        def fn(_module, _inputs, output):
            choices[idx] = output[2].detach()
        return fn

    sparse = moe_layers(kind, spec)
    for i in sparse:
        model.model.layers[i].mlp.gate.register_forward_hook(hook(i))
    out = model(torch.from_numpy(input_ids), output_router_logits=True) if sparse else model(torch.from_numpy(input_ids))
    logits = out.logits
    ce = torch.nn.functional.cross_entropy(logits.reshape(-1, spec["vocab_size"]),
                                           torch.from_numpy(labels).reshape(-1), reduction="none")
    mask = torch.from_numpy(loss_mask).reshape(-1)
    lm_loss = (ce * mask).sum() / mask.sum()
    loss = lm_loss
    if sparse and spec["output_router_logits"]:
        loss = lm_loss + spec["router_aux_loss_coef"] * out.aux_loss  # what HF adds to its loss
    loss.backward()

    ref = {
        "input_ids": input_ids.astype(np.int32), "labels": labels.astype(np.int32), "loss_mask": loss_mask,
        "logits": logits.detach().numpy(), "lm_loss": np.array(lm_loss.item(), np.float32),
        "loss": np.array(loss.item(), np.float32),
    }
    if sparse:
        ref["aux_loss"] = np.array(out.aux_loss.item(), np.float32)
    for i, idx in choices.items():
        ref[f"topk.{i}"] = np.sort(idx.numpy(), -1).astype(np.int32)
    busiest = {i: list(np.argsort(-np.bincount(idx.numpy().reshape(-1), minlength=spec["num_experts"]),
                                  kind="stable")) for i, idx in choices.items()}
    for g in grad_names(kind, spec, busiest):
        ref[f"grad.{g}"] = np.ascontiguousarray(_grad(model, g, spec.get("moe_intermediate_size", 0)))

    out_dir = os.path.join(OUT, f"hf_{name}")
    os.makedirs(out_dir, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    save_file({k: np.ascontiguousarray(v) for k, v in ref.items()}, os.path.join(out_dir, "reference.safetensors"))
    for extra in ("generation_config.json",):
        if os.path.exists(os.path.join(out_dir, extra)):
            os.remove(os.path.join(out_dir, extra))
    aux = f", aux {ref['aux_loss'].item():.6f}" if sparse else ""
    print(f"{name}: loss {loss.item():.6f} (lm {lm_loss.item():.6f}{aux}), wrote {out_dir}")


_MS_SAVE = """
import sys, mindspore as ms
ms.set_device('CPU')
import mindtrain.models as mm
m = mm.from_pretrained(sys.argv[1], jit=False)
m.save_pretrained(sys.argv[2])
"""


def check_save(name: str, kind: str, ms_python: list[str]) -> float:
    """mindtrain from_pretrained -> save_pretrained -> transformers loads -> same logits."""
    src = os.path.join(OUT, f"hf_{name}")
    cls = CLASSES[kind][1]
    with tempfile.TemporaryDirectory() as tmp:
        script = os.path.join(tmp, "save.py")
        with open(script, "w") as f:
            f.write(_MS_SAVE)
        dst = os.path.join(tmp, "saved")
        subprocess.run(ms_python + [script, src, dst], check=True, cwd=ROOT)
        with open(os.path.join(dst, "config.json")) as f:
            print(f"{name}: mindtrain wrote config keys {sorted(json.load(f))[:6]}...")
        extra = {"experts_implementation": "eager"} if kind == "qwen3_moe" else {}
        model = cls.from_pretrained(dst, attn_implementation="eager", **extra).float().eval()
        ref = cls.from_pretrained(src, attn_implementation="eager", **extra).float().eval()
        for key in ("head_dim", "num_key_value_heads", "tie_word_embeddings", "rope_parameters",
                    "num_experts", "mlp_only_layers", "decoder_sparse_step", "norm_topk_prob",
                    "output_router_logits", "router_aux_loss_coef", "attention_bias"):
            if getattr(ref.config, key, None) != getattr(model.config, key, None):
                raise SystemExit(f"{name}: config.{key} {getattr(model.config, key, None)!r} != "
                                 f"{getattr(ref.config, key, None)!r}")
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
        for name, (kind, spec) in MODELS.items():
            make(name, kind, spec)
    if args.check_save or args.only_check:
        worst = max(check_save(name, kind, args.ms_python.split()) for name, (kind, _) in MODELS.items())
        if worst > 1e-5:
            print("FAIL: logits differ", file=sys.stderr)
            return 1
        print("OK: transformers loads mindtrain's save_pretrained output with identical logits")
    return 0


if __name__ == "__main__":
    sys.exit(main())
