"""Reference fixtures for the max attention logits and Muon's QK-clip, with transformers and
torch themselves (never package dependencies). Run with the reference venv's Python:

    /tmp/fxvenv/bin/python tools/make_qkclip_fixtures.py

1. ``packages/models/tests/fixtures/max_logits_hf.npz``: for the HF-parity fixtures
   hf_qlora, hf_noqlora (DeepseekV3ForCausalLM) and hf_qwen3, hf_qwen3_tied
   (Qwen3ForCausalLM), transformers 5.x loads each committed checkpoint with
   ``attn_implementation="eager"``, and ``<name>.layer<i>`` is, per head, the largest
   pre-softmax logit of layer i over the batch and the query rows of one forward of the
   fixture's ``input_ids``: recomputed from the query and key states HF's attention hands
   to its ``eager_attention_forward`` (``q @ repeat_kv(k)^T * scaling``, causally blocked
   keys excluded), a wrapper around that function.

2. ``packages/trainer/tests/fixtures/qk_clip_torch.npz``: one Muon step with QK-clip on the
   MLA query/key projections of hf_qlora (``q_b_proj``) and hf_noqlora (``q_proj``), with
   ``kv_b_proj``: torch.optim.Muon (float64, Newton-Schulz without its bfloat16 cast, the
   settings of tools/make_muon_fixture.py), each of MindFormers' logical parts (per-head
   nope / rope rows of the query, nope / v rows of kv_b_proj) its own matrix as
   MindFormers' ``make_model_muon_fns`` split orthogonalises them; the gradients are HF's
   of the masked mean cross-entropy of that forward. Then MindFormers' clip rule
   (``mindformers/pynative/transformers/multi_latent_attention.py``,
   ``apply_qk_clip_to_weight``) transcribed in torch: per layer, a head whose max logit
   (part 1) reaches the threshold gets ``scale = threshold / max``; query nope rows x
   sqrt(scale), query rope rows x scale, kv_b_proj's key nope rows x sqrt(scale), values
   untouched. The threshold is the median of the fixture's max logits, so some heads clip
   and others do not. Keys: ``<fixture>.threshold``, ``<fixture>.grad.<name>``,
   ``<fixture>.muon.<name>`` (after Muon only) and ``<fixture>.clipped.<name>``.
"""

from __future__ import annotations

import importlib
import os
import sys

import numpy as np
import torch
from safetensors.numpy import load_file
from transformers import AutoModelForCausalLM

sys.path.insert(0, os.path.dirname(__file__))
import fixture_io as fx  # noqa: E402
import make_muon_fixture as mf  # noqa: E402

MODULES = {"qlora": "deepseek_v3", "noqlora": "deepseek_v3", "qwen3": "qwen3", "qwen3_tied": "qwen3"}
CLIP = ("qlora", "noqlora")
TRAINER_OUT = os.path.join(fx.ROOT, "packages", "trainer", "tests", "fixtures", "qk_clip_torch.npz")
MODELS_OUT = os.path.join(fx.OUT, "max_logits_hf.npz")


def record_max_logits(module: str) -> dict:
    """Wrap the HF family's ``eager_attention_forward``; the returned dict fills with each
    layer's per-head max pre-softmax logit (running max over calls)."""
    mod = importlib.import_module(f"transformers.models.{module}.modeling_{module}")
    orig = getattr(mod, "_qkclip_original", mod.eager_attention_forward)
    mod._qkclip_original = orig
    rec: dict = {}

    def wrapped(attn, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
        k = mod.repeat_kv(key, attn.num_key_value_groups)
        logits = torch.matmul(query, k.transpose(2, 3)) * scaling
        s, sk = logits.shape[-2:]
        open_keys = torch.ones(s, sk, dtype=torch.bool).tril(sk - s)
        top = logits.detach().masked_fill(~open_keys, float("-inf")).amax(dim=(0, 2, 3))
        i = attn.layer_idx
        rec[i] = top if i not in rec else torch.maximum(rec[i], top)
        return orig(attn, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)

    mod.eager_attention_forward = wrapped
    return rec


def forward(name: str):
    """(HF model, its max logits by layer, loss) of one forward of fixture ``name``'s input_ids."""
    d = fx.fixture_dir(name)
    ref = load_file(os.path.join(d, "reference.safetensors"))
    rec = record_max_logits(MODULES[name])
    model = AutoModelForCausalLM.from_pretrained(d, attn_implementation="eager", dtype=torch.float32)
    model.train()
    logits = model(torch.from_numpy(ref["input_ids"].astype(np.int64))).logits
    assert np.allclose(logits.detach().numpy(), ref["logits"], atol=1e-4), name  # the fixture's model
    loss = fx.masked_loss(logits, ref["labels"].astype(np.int64), ref["loss_mask"], model.config.vocab_size)
    return model, {i: t.numpy().astype(np.float64) for i, t in rec.items()}, loss


def parts(name: str, cfg) -> list[np.ndarray]:
    """MindFormers' logical matrices (row indices) of an MLA query / kv_b_proj weight."""
    heads, nope, rope, v = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
    other = v if "kv_b_proj" in name else rope
    base = np.arange(heads)[:, None] * (nope + other)
    return [(base + np.arange(nope)).reshape(-1), (base + nope + np.arange(other)).reshape(-1)]


def clip_rule(w: torch.Tensor, name: str, top: np.ndarray, threshold: float, cfg) -> torch.Tensor:
    """MindFormers' apply_qk_clip_to_weight on one full weight (a transcription)."""
    heads, nope, rope, v = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
    logits = torch.tensor(top, dtype=w.dtype)
    mask = logits >= threshold
    scales = torch.where(mask, threshold / torch.where(mask, logits, torch.ones_like(logits)),
                         torch.ones_like(logits))

    def broadcast(s, d):  # _get_scale_broadcast: each head's scale on its d rows
        return s.unsqueeze(1).tile(1, d).reshape(-1).unsqueeze(1)

    if "kv_b_proj" in name:
        w3 = w.reshape(heads, nope + v, -1)
        k_nope = w3[:, :nope].reshape(heads * nope, -1) * broadcast(scales.sqrt(), nope)
        return torch.cat([k_nope.reshape(heads, nope, -1), w3[:, nope:]], 1).reshape(w.shape)
    w3 = w.reshape(heads, nope + rope, -1)
    q_nope = w3[:, :nope].reshape(heads * nope, -1) * broadcast(scales.sqrt(), nope)
    q_pe = w3[:, nope:].reshape(heads * rope, -1) * broadcast(scales, rope)
    return torch.cat([q_nope.reshape(heads, nope, -1), q_pe.reshape(heads, rope, -1)], 1).reshape(w.shape)


def clip_step(name: str, model, top: dict, loss, out: dict) -> None:
    cfg = model.config
    loss.backward()
    names = [n for n, _ in model.named_parameters()
             if n.endswith(("self_attn.q_b_proj.weight", "self_attn.q_proj.weight", "self_attn.kv_b_proj.weight"))]
    params = dict(model.named_parameters())
    values = np.concatenate([top[i] for i in sorted(top)])
    threshold = float(np.median(values))
    out[f"{name}.threshold"] = np.array(threshold)
    torch_parts, owners = [], []
    for n in names:
        w, g = params[n].detach().double(), params[n].grad.detach().double()
        out[f"{name}.grad.{n}"] = g.numpy().astype(np.float32)
        for rows in parts(n, cfg):
            p = torch.nn.Parameter(w[torch.from_numpy(rows)].clone())
            p.grad = g[torch.from_numpy(rows)].clone()
            torch_parts.append(p)
            owners.append((n, rows))
    opt = torch.optim.Muon(torch_parts, nesterov=True, **mf.SETTINGS)
    opt.step()
    for n in names:
        w = params[n].detach().double().clone()
        for p, (owner, rows) in zip(torch_parts, owners):
            if owner == n:
                w[torch.from_numpy(rows)] = p.detach()
        out[f"{name}.muon.{n}"] = w.numpy().astype(np.float32)
        layer = int(n.split(".")[2])
        out[f"{name}.clipped.{n}"] = clip_rule(w, n, top[layer], threshold, cfg).numpy().astype(np.float32)
    fired = int((values >= threshold).sum())
    print(f"{name}: threshold {threshold:.4f}, {fired}/{values.size} heads clip")


def main() -> None:
    torch.manual_seed(0)
    import torch.optim._muon as torch_muon

    torch_muon._zeropower_via_newtonschulz = mf._float_newton_schulz()
    logits_out, clip_out = {}, {}
    for name in MODULES:
        model, top, loss = forward(name)
        for i, t in top.items():
            logits_out[f"{name}.layer{i}"] = t.astype(np.float32)
        if name in CLIP:
            clip_step(name, model, top, loss, clip_out)
    import transformers

    for out, path in ((logits_out, MODELS_OUT), (clip_out, TRAINER_OUT)):
        out["versions"] = np.array(f"torch {torch.__version__}, transformers {transformers.__version__}")
        np.savez_compressed(path, **out)
        print(f"wrote {os.path.relpath(path, fx.ROOT)} ({os.path.getsize(path)} bytes)")


if __name__ == "__main__":
    main()
