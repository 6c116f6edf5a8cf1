"""Muon against torch.optim.Muon (fixture from tools/make_muon_fixture.py), its parameter
routing (AdamW for the rest, MindFormers' names in adamw_include), per-expert and MLA-part
orthogonalisation, and its state round trip."""

import os

import mindspore as ms
import numpy as np
import pytest
from mindspore import Parameter, Tensor

from mindtrain.config import ModelConfig, OptimizerConfig
from mindtrain.trainer.muon import Muon, build_optimizer, newton_schulz
from mindtrain.trainer.optimizer import AdamW

ms.set_device("CPU")
ms.runtime.launch_blocking()  # eager ops in the calling thread, as the trainer runs them on CPU

FIXTURE = os.path.join(os.path.dirname(__file__), "fixtures", "muon_torch.npz")
SHAPES = ("wide", "tall", "square")


def _cfg(**kw):
    base = dict(type="Muon", weight_decay=0.1, momentum=0.95, ns_steps=5, eps=1e-7, matched_adamw_rms=0.2)
    base.update(kw)
    return OptimizerConfig(**base)


def _ns_numpy(x, schedule, eps):
    x = np.asarray(x, np.float64)
    tall = x.shape[-2] > x.shape[-1]
    if tall:
        x = np.swapaxes(x, -2, -1)
    x = x / (np.sqrt((x * x).sum(axis=(-2, -1), keepdims=True)) + eps)
    for a, b, c in schedule:
        g = x @ np.swapaxes(x, -2, -1)
        x = a * x + (b * g + c * g @ g) @ x
    return np.swapaxes(x, -2, -1) if tall else x


@pytest.mark.parametrize("nesterov", [True, False])
def test_matches_torch_muon(nesterov):
    ref = np.load(FIXTURE)
    tag = "nesterov" if nesterov else "plain"
    named = [(n, Parameter(Tensor(ref[f"init.{n}"]), name=n)) for n in SHAPES]
    opt = Muon(named, _cfg(nesterov=nesterov), lr=0.02)
    assert opt.muon_idx == [0, 1, 2] and opt.adamw_idx == []
    worst = 0.0
    for step in range(3):
        opt.step([Tensor(ref[f"grad{step}.{n}"]) for n in SHAPES])
        for (n, p), m in zip(named, opt.muon_m):
            want = ref[f"{tag}.param{step}.{n}"]
            np.testing.assert_allclose(p.asnumpy(), want, rtol=1e-5, atol=1e-6)
            worst = max(worst, float(np.max(np.abs(p.asnumpy() - want) / np.maximum(np.abs(want), 1e-3))))
            # torch's buffer is the exponential average: (1 - momentum) times MindFormers' m
            np.testing.assert_allclose(m.asnumpy() * 0.05, ref[f"{tag}.buf{step}.{n}"], rtol=1e-5, atol=1e-7)
    print(f"max relative error vs torch.optim.Muon ({tag}): {worst:.2e}")


def test_schedule_and_batched_experts():
    rng = np.random.default_rng(0)
    sched = [(3.4445, -4.7750, 2.0315)] * 3 + [(2.0, -1.5, 0.5)] * 2
    experts = rng.standard_normal((3, 4, 7)).astype(np.float32)
    got = newton_schulz(Tensor(experts), sched, 1e-8).asnumpy()
    for e in range(3):  # each expert's matrix on its own
        np.testing.assert_allclose(got[e], _ns_numpy(experts[e], sched, 1e-8), rtol=2e-5, atol=2e-6)


def test_routing_adamw_include_and_mindformers_names():
    model = ModelConfig(hidden_size=8, intermediate_size=12, moe_intermediate_size=6, num_hidden_layers=1,
                        num_attention_heads=2, num_key_value_heads=2, kv_lora_rank=4, q_lora_rank=None,
                        qk_rope_head_dim=2, qk_nope_head_dim=3, v_head_dim=3, n_routed_experts=3,
                        first_k_dense_replace=0, num_nextn_predict_layers=0, vocab_size=16)
    shapes = {
        "model.embed_tokens.weight": (16, 8),
        "model.layers.0.input_layernorm.weight": (8,),
        "model.layers.0.self_attn.q_proj.weight": (10, 8),            # 2 heads x (3 nope + 2 rope)
        "model.layers.0.self_attn.kv_a_proj_with_mqa.weight": (6, 8),  # 4 latent + 2 rope
        "model.layers.0.self_attn.kv_b_proj.weight": (12, 4),          # 2 heads x (3 nope + 3 v)
        "model.layers.0.mlp.experts.gate_proj": (3, 6, 8),
        "lm_head.weight": (16, 8),
    }
    rng = np.random.default_rng(1)
    named = [(n, Parameter(Tensor(rng.standard_normal(s).astype(np.float32)), name=n)) for n, s in shapes.items()]
    before = {n: p.asnumpy().copy() for n, p in named}
    opt = build_optimizer(named, _cfg(nesterov=False, momentum=0.0, weight_decay=0.0), lr=0.1, model=model)
    names = list(shapes)
    # the embedding and LM head match MindFormers' *word_embeddings* / *output_layer*; the norm is 1-D
    assert [names[i] for i in opt.adamw_idx] == ["model.embed_tokens.weight", "model.layers.0.input_layernorm.weight",
                                                 "lm_head.weight"]
    assert isinstance(opt.adamw, AdamW) and len(opt.muon_m) == 4
    grads = [Tensor(rng.standard_normal(s).astype(np.float32)) for s in shapes.values()]
    opt.step(grads)
    sched = [(3.4445, -4.7750, 2.0315)] * 5

    def expect(g, rows):  # NS per logical part, each scaled by 0.2 * sqrt(max(part rows, cols))
        out = np.zeros_like(g, np.float64)
        for r in rows:
            out[..., r, :] = _ns_numpy(g[..., r, :], sched, 1e-8) * 0.2 * np.sqrt(max(len(r), g.shape[-1]))
        return out

    periodic = lambda a, b, h: [np.concatenate([k * (a + b) + np.arange(a) for k in range(h)]),  # noqa: E731
                                np.concatenate([k * (a + b) + a + np.arange(b) for k in range(h)])]
    rows = {"model.layers.0.self_attn.q_proj.weight": periodic(3, 2, 2),
            "model.layers.0.self_attn.kv_a_proj_with_mqa.weight": [np.arange(4), 4 + np.arange(2)],
            "model.layers.0.self_attn.kv_b_proj.weight": periodic(3, 3, 2),
            "model.layers.0.mlp.experts.gate_proj": [np.arange(6)]}
    for (n, p), g in zip(named, grads):
        if n in rows:
            want = before[n] - 0.1 * expect(g.asnumpy(), rows[n])
            np.testing.assert_allclose(p.asnumpy(), want, rtol=1e-4, atol=1e-5)
    # only the glob on our name would keep the LM head on Muon: adamw_include matches both
    opt2 = build_optimizer(named, _cfg(adamw_include=["*lm_head*"]), lr=0.1, model=model)
    assert [names[i] for i in opt2.adamw_idx] == ["model.layers.0.input_layernorm.weight", "lm_head.weight"]


def test_state_dict_round_trip():
    rng = np.random.default_rng(2)
    named = [("w", Parameter(Tensor(rng.standard_normal((4, 6)).astype(np.float32)), name="w")),
             ("b", Parameter(Tensor(np.zeros(6, np.float32)), name="b"))]
    opt = Muon(named, _cfg(), lr=0.01)
    opt.step([Tensor(rng.standard_normal((4, 6)).astype(np.float32)), Tensor(np.ones(6, np.float32))])
    state = opt.state_dict()
    assert sorted(state) == ["exp_avg.b", "exp_avg_sq.b", "muon_m.w", "step"]
    assert [k for k, _, _ in opt.moment_sets()] == ["exp_avg", "exp_avg_sq", "muon_m"]
    other = Muon(named, _cfg(), lr=0.01)
    other.load_state_dict(state)
    assert other.step_count == 1 and other.adamw.step_count == 1
    np.testing.assert_array_equal(other.muon_m[0].asnumpy(), state["muon_m.w"])
    with pytest.raises(KeyError, match="muon_m.w"):
        other.load_state_dict({k: v for k, v in state.items() if k != "muon_m.w"})


@pytest.mark.parametrize("base", ["hf_qlora", "hf_qwen3"])
def test_lora_fused_layers_lora_b_is_one_matrix(base):
    """LoRA with Muon as MindFormers' optimizer holds the adapters: a fused layer's lora_b
    (DeepSeek-V3 linear_qkv = q_a_proj + kv_a_proj_with_mqa, Qwen3 linear_qkv = q/k/v and
    linear_fc1 = gate + up) is ONE parameter [sum(out), r] there, orthogonalised whole; here its
    parts' lora_b get the rows of numpy Newton-Schulz on MindFormers' fused tensor (its row order:
    Qwen3's per-group q, k, v blocks, fc1's interleaved gate / up), the shared lora_a and an
    unfused layer's adapters each as their own matrix."""
    import json
    from types import SimpleNamespace

    import mindtrain.models as mm
    from mindtrain.config import LoraConfig
    from mindtrain.models.hf_config import config_from_hf
    from mindtrain.trainer.lora import apply_lora
    from mindtrain.trainer.mindformers_names import from_mindformers, parts, to_mindformers

    fixtures = os.path.join(os.path.dirname(__file__), "..", "..", "models", "tests", "fixtures")
    with open(os.path.join(fixtures, base, "config.json"), encoding="utf-8") as f:
        model_cfg = config_from_hf(json.load(f))
    model = mm.build_model(model_cfg, jit=False)
    lc = LoraConfig(target_modules="linear_qkv|linear_fc1|linear_proj", lora_rank=3, lora_alpha=6)
    apply_lora(model, SimpleNamespace(model=model_cfg, lora_config=lc), empty=False)
    named = [(p.name, p) for p in model.get_parameters() if p.name.endswith((".lora_a", ".lora_b"))]
    rng = np.random.default_rng(3)
    before = {n: p.asnumpy().copy() for n, p in named}
    grads = {n: rng.standard_normal(tuple(p.shape)).astype(np.float32) for n, p in named}
    opt = build_optimizer(named, _cfg(nesterov=False, momentum=0.0, weight_decay=0.0), lr=0.1, model=model_cfg)
    assert not opt.adamw_idx
    opt.step([Tensor(grads[n]) for n, _ in named])
    sched = [(3.4445, -4.7750, 2.0315)] * 5
    theirs = to_mindformers(grads, model_cfg)
    fused = [t for t, g in theirs.items() if t.endswith(".lora_b") and len(parts(t, g.shape, model_cfg)) > 1]
    kinds = {".linear_qkv.", ".linear_fc1."} if base == "hf_qwen3" else {".linear_qkv."}
    assert {k for t in fused for k in kinds if k in t} == kinds
    updates = from_mindformers({t: _ns_numpy(g, sched, 1e-8) * 0.2 * np.sqrt(max(g.shape)) for t, g in theirs.items()},
                               model_cfg)
    assert sorted(updates) == sorted(grads)
    worst = 0.0
    for n, p in named:
        want = before[n] - 0.1 * updates[n]
        np.testing.assert_allclose(p.asnumpy(), want, rtol=1e-4, atol=2e-5, err_msg=n)
        worst = max(worst, float(np.abs(p.asnumpy() - want).max()))
    # the parts on their own (the old per-part update) would differ by far more
    part = next(n for n in grads if n.endswith(("kv_a_proj_with_mqa.lora_b", "k_proj.lora_b")))
    alone = before[part] - 0.1 * _ns_numpy(grads[part], sched, 1e-8) * 0.2 * np.sqrt(max(grads[part].shape))
    assert np.abs(alone - dict(named)[part].asnumpy()).max() > 100 * max(worst, 1e-6), part
