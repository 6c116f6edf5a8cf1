"""lora_config (LoRA fine-tuning, MindFormers' PyNative semantics) in one process: the layers
MindFormers' regexes select, the adapters' gradients and the merged weights against PEFT's
LoRA on HF transformers' models (fixtures by tools/make_lora_fixtures.py), and a tiny run:
only the adapters change, they are saved alone (PEFT names), resume is exact and
``mindtrain-export-hf --lora`` gives a merged HF directory with the same logits. Two workers
(ZeRO-3 and TP) are in integration_tests/test_lora_msrun.py."""

import json
import os
from types import SimpleNamespace

import mindspore as ms
import numpy as np
import pytest
from mindspore import Tensor
from safetensors.numpy import load_file

import mindtrain.models as mm
from mindtrain.config import LoraConfig
from mindtrain.trainer.export_hf import main as export_main
from mindtrain.trainer.lora import apply_lora, load_adapters, merge, peft_name
from mindtrain.trainer.runtime import Runtime
from mindtrain.trainer.trainer import Trainer

HERE = os.path.dirname(os.path.abspath(__file__))
MODELS = os.path.join(HERE, "..", "..", "models", "tests", "fixtures")
CONFIGS = os.path.join(HERE, "..", "..", "..", "configs")
# fixture -> (base HF fixture, MindFormers target_modules, exclude_layers, config overrides);
# the regexes match what tools/make_lora_fixtures.py gave PEFT
CASES = {
    "dsv3": ("qlora", "linear_(qkv|qb|kvb|proj)|output_layer", r"layers\.2\.self_attention\.linear_(qb|kvb)",
             {"num_nextn_predict_layers": 0}),
    "qwen3": ("qwen3", "linear_qkv|linear_fc1|linear_fc2", r"layers\.1\.mlp\.linear_fc2", {}),
    # DeepSeek-V4: every Linear of the hybrid attention (compressors and an indexer too), the shared
    # experts and the head; the grouped linear_o_group_proj is a bare parameter in MindFormers, never adapted
    "dsv4": ("deepseek_v4", "linear_|output_layer",
             r"layers\.3\.self_attention\.core_attention\.indexer|layers\.0\.mlp", {"num_nextn_predict_layers": 0}),
    "dsv4_mla": ("deepseek_v4_mla", "linear_(qkv|qb|kvb|proj)|shared_experts|output_layer",
                 r"layers\.1\.self_attention\.linear_kvb", {}),
}
TOL = 1e-4
# the parts of MindFormers' fused layers that share their first part's lora_a (PEFT's lora_A tied):
# DeepSeek-V3: linear_qkv (kv_a_proj_with_mqa) of 3 layers; Qwen3: linear_qkv (k_proj, v_proj) of 2 layers
# and linear_fc1 (up_proj) of 2; DeepSeek-V4: its shared experts' linear_fc1 of layers 1-3; the mla
# variant: linear_qkv of 3 layers and 3 shared experts' linear_fc1
SHARED_A = {"dsv3": 3, "qwen3": 6, "dsv4": 3, "dsv4_mla": 6}


def _lora_model(name):
    base, target, exclude, overrides = CASES[name]
    extra = os.path.join(MODELS, f"hf_{base}", "overrides.json")  # a variant's fields (V4's mla)
    if os.path.exists(extra):
        with open(extra, encoding="utf-8") as f:
            overrides = {**json.load(f), **overrides}
    model = mm.from_pretrained(os.path.join(MODELS, f"hf_{base}"), jit=False, **overrides)
    cfg = SimpleNamespace(model=model.config, lora_config=LoraConfig(target_modules=target, exclude_layers=exclude,
                                                                     lora_rank=4, lora_alpha=8))
    adapted = apply_lora(model, cfg, empty=False)
    return model, adapted


@pytest.mark.parametrize("name", list(CASES))
def test_adapters_match_peft(name):
    """The regexes select PEFT's modules; with PEFT's adapter values the logits, loss and
    every adapter gradient match; merging them into the weights gives the same logits."""
    ms.set_device("CPU")
    ms.runtime.launch_blocking()  # eager ops in the calling thread, as the trainer runs them on CPU
    model, adapted = _lora_model(name)
    fixture = os.path.join(HERE, "fixtures", f"lora_{name}")
    adapters, scaling = load_adapters(fixture)  # PEFT's save_pretrained output (a fused layer's lora_A tied)
    assert scaling == 2.0
    assert sorted(adapters) == sorted(n[:-len("weight")] + k for n in adapted for k in ("lora_a", "lora_b"))
    params = {p.name: p for p in model.get_parameters()}
    # MindFormers' fused layers (linear_qkv, linear_fc1): one lora_a, held by the first part
    shared = [n for n in adapters if n.endswith(".lora_a") and n not in params]
    assert len(shared) == SHARED_A[name], sorted(shared)
    for n, v in adapters.items():
        if n in params:
            params[n].set_data(Tensor(v))
    for n in shared:  # the part multiplies by its first part's lora_a, which PEFT's tied one equals
        cell = next(c for _, c in model.cells_and_names() if isinstance(c, mm.linear.Linear) and c.weight.name ==
                    n[:-len("lora_a")] + "weight")
        first = cell.adapter_a().name
        assert first != n and first.rsplit(".", 2)[0] == n.rsplit(".", 2)[0], (n, first)  # the same layer's
        np.testing.assert_array_equal(adapters[n], adapters[first])
    ref = load_file(os.path.join(fixture, "reference.safetensors"))
    ids, labels, mask = (Tensor(ref[k]) for k in ("input_ids", "labels", "loss_mask"))
    np.testing.assert_allclose(model(ids).asnumpy(), ref["logits"], atol=TOL, rtol=0)
    trained = [params[n] for n in sorted(adapters) if n in params]

    def fn(ids, labels, mask):  # the fixture's loss: the masked cross-entropy (no MoE balance term)
        _, metrics = model(ids, labels=labels, loss_mask=mask)
        return metrics["lm_loss"], ()

    (loss, _), grads = ms.value_and_grad(fn, None, trained, has_aux=True)(ids, labels, mask)
    assert abs(float(loss.asnumpy()) - ref["loss"].item()) < TOL
    for p, g in zip(trained, grads):
        expected = ref[f"grad.{peft_name(p.name)}"]  # a tied lora_A's: the sum over the fused parts
        # V4's indexer chooses entries by a top-k: no gradient reaches its adapters (in HF neither)
        assert (np.abs(expected).max() > 1e-4) != (".indexer." in p.name), p.name
        np.testing.assert_allclose(g.asnumpy(), expected, atol=TOL * max(1.0, np.abs(expected).max()), rtol=0,
                                   err_msg=p.name)
    # PEFT's merge: the weights W + s * B @ A without the adapters give the same logits
    for n in adapted:
        cell = next(c for _, c in model.cells_and_names() if isinstance(c, mm.linear.Linear) and c.weight.name == n)
        a, b = adapters[n[:-len("weight")] + "lora_a"], adapters[n[:-len("weight")] + "lora_b"]
        cell.lora_scaling = None
        params[n].set_data(Tensor(merge(params[n].asnumpy(), a, b, scaling)))
    np.testing.assert_allclose(model(ids).asnumpy(), ref["logits"], atol=TOL, rtol=0)


@pytest.mark.parametrize("target, exclude, says", [
    ("mapping_proj", None, "model.decoder.layers.0.attn_hc.mapping_proj (a DeepSeek-V4 hyper-connection mapping)"),
    ("hc_head", None, "model.decoder.hc_head.hc_fn (a DeepSeek-V4"),
    ("linear_o_group_proj", None, "'linear_o_group_proj' matches no Linear layer"),
    (r"proj|linear_fc|hc_fn", r"_hc|hc_head|layers\.[1-3]", None),  # excluded: layer 0's attention and shared experts
])
def test_v4_layers_without_an_adapter_are_refused_in_one_line(target, exclude, says):
    """DeepSeek-V4's hyper-connection mappings are Linear layers in MindFormers (its LoRA would
    adapt them) but bare parameters here and in HF: selecting one is a one-line ConfigError;
    the grouped output projection is a bare parameter in MindFormers too: never selected."""
    from mindtrain.config import ConfigError

    ms.set_device("CPU")
    model = mm.from_pretrained(os.path.join(MODELS, "hf_deepseek_v4"), jit=False, num_nextn_predict_layers=0)
    cfg = SimpleNamespace(model=model.config, lora_config=LoraConfig(target_modules=target, exclude_layers=exclude))
    if says is None:
        assert sorted(apply_lora(model, cfg, empty=False)) == sorted(
            f"model.layers.0.{n}.weight" for n in ("self_attn.q_a_proj", "self_attn.q_b_proj", "self_attn.kv_proj",
                                                   "self_attn.o_b_proj", "mlp.shared_experts.gate_proj",
                                                   "mlp.shared_experts.up_proj", "mlp.shared_experts.down_proj"))
        return
    with pytest.raises(ConfigError) as err:
        apply_lora(model, cfg, empty=False)
    assert "\n" not in str(err.value) and str(err.value).startswith("lora_config.target_modules: ")
    assert says in str(err.value), str(err.value)


# the tiny run: (config, lora_config's target_modules and exclude_layers, overrides, adapted layers,
# the fused layers' later parts, which share their first part's lora_a)
RUNS = {
    # DeepSeek-V3 saved in MindFormers' layout: the adapters under MindFormers' names and fused shapes
    "dsv3": ("pynative_ds3_tiny.yaml", "'linear_(qkv|qb|kvb|proj|fc1|fc2)', exclude_layers: 'mtp'",
             ("checkpoint.layout=mindformers",), 16, 4),
    # DeepSeek-V4, 2 layers (sliding, compressed sparse) + an MTP module: every Linear but the
    # grouped output projections (MindFormers' bare parameter) and the indexer's scorer
    "dsv4": ("pynative_ds4_tiny.yaml", "'linear_|output_layer|eh_proj', exclude_layers: 'linear_weights_proj'",
             ("model.compress_ratios=[0, 4]", "model.num_nextn_predict_layers=1"), 28, 3),
}


@pytest.mark.parametrize("name", list(RUNS))
def test_lora_run_trains_adapters_only_resumes_exactly_and_exports_merged(name, tiny_config, tmp_path):
    """A tiny LoRA run: only the adapters move and have optimizer state; each save writes
    them alone (PEFT's names; under checkpoint.layout mindformers MindFormers' names and fused
    shapes, a fused layer's one lora_a, as they sit in the checkpoint); resume is exact; the
    merged HF export (from either layout's folder and adapter names) gives the adapted logits."""
    from mindtrain.trainer import mindformers_checkpoint as mf
    from mindtrain.trainer.lora import with_shared_a
    from mindtrain.trainer.mindformers_names import to_mindformers

    config, target, more, n_layers, n_shared = RUNS[name]
    lora = f"lora_config={{target_modules: {target}, lora_b_std: 0.01}}"
    mindformers = "checkpoint.layout=mindformers" in more

    def tiny_config(*extra, _make=tiny_config):
        return _make(*more, *extra, config=os.path.join(CONFIGS, config))

    def folder(step):
        return ck / (mf.folder_name(step) if mindformers else f"iter_{step:07d}")

    ck = tmp_path / "ck"
    cfg = tiny_config(lora, "checkpoint.enable_save=true", f"checkpoint.save_path={ck}", "checkpoint.save_interval=2")
    lines = []
    trainer = Trainer(cfg, Runtime(device="CPU"), out=lines.append)
    assert any(f"LoRA: adapters on {n_layers} Linear layers" in x for x in lines)
    before = {n: p.asnumpy().copy() for n, p in trainer.params}
    full = trainer.train()
    after = {n: p.asnumpy().copy() for n, p in trainer.params}
    adapters = [n for n in before if n.endswith((".lora_a", ".lora_b"))]
    # a lora_b per adapted layer; a lora_a per layer of MindFormers' (a fused one's parts share one)
    assert len(adapters) == 2 * n_layers - n_shared
    for n in before:  # the base is bit-identical; every adapter moved
        assert np.array_equal(before[n], after[n]) != (n in adapters), n
    # optimizer state: the adapters' moments only
    if mindformers:
        stored = mf.MindFormersBoxes(str(folder(3)), cfg.model).names()
        assert sorted(k for k in stored if k.startswith("exp_avg")) == sorted(
            f"{m}.{n}" for n in adapters for m in ("exp_avg", "exp_avg_sq"))
    else:
        opt = load_file(str(folder(3) / "opt-0000000-0000001.safetensors"))
        assert sorted(k for k in opt if k != "step") == sorted(f"{m}.{n}" for n in adapters
                                                               for m in ("exp_avg", "exp_avg_sq"))
    # the adapters alone with adapter_config.json
    saved = load_file(str(ck / "lora" / "iter_0000003" / "adapter_model.safetensors"))
    mine = {n: after[n] for n in adapters}
    if mindformers:  # MindFormers' names and shapes: linear_qkv.lora_a [r, H], linear_qkv.lora_b [q + kv, r]
        want = to_mindformers(mine, cfg.model)
        r, h = cfg.lora_config.lora_rank, cfg.model.hidden_size
        qkv = cfg.model.q_lora_rank + cfg.model.kv_lora_rank + cfg.model.qk_rope_head_dim
        assert saved["decoder.layers.0.self_attention.linear_qkv.lora_a"].shape == (r, h)
        assert saved["decoder.layers.0.self_attention.linear_qkv.lora_b"].shape == (qkv, r)
        assert saved["decoder.layers.0.mlp.linear_fc1.lora_b"].shape == (2 * cfg.model.intermediate_size, r)
        # one lora_a and one lora_b per MindFormers layer
        assert len(saved) == 2 * (n_layers - n_shared) and all(k.startswith("decoder.layers.") for k in saved)
    else:  # PEFT's names, a fused layer's lora_a under each of its parts' names
        want = {peft_name(n): a for n, a in with_shared_a(mine, cfg.model).items()}
        assert len(saved) == 2 * n_layers
    assert sorted(saved) == sorted(want)
    for k, a in want.items():
        np.testing.assert_array_equal(saved[k], a, err_msg=k)
    conf = json.loads((ck / "lora" / "iter_0000003" / "adapter_config.json").read_text())
    assert conf["peft_type"] == "LORA" and conf["r"] == 8 and conf["lora_alpha"] == 16
    assert conf["mindtrain_layout"] == ("mindformers" if mindformers else "mindtrain")
    back, _ = load_adapters(str(ck / "lora" / "iter_0000003"), cfg.model)  # read back: every part's a and b
    assert sorted(back) == sorted(with_shared_a(mine, cfg.model))

    # resume from step 2: step 3 is the same, to the bit
    resumed_trainer = Trainer(tiny_config(lora, f"checkpoint.load_path={folder(2)}"), Runtime(device="CPU"),
                              out=lambda _: None)
    resumed = resumed_trainer.train()
    assert [r["step"] for r in resumed] == [3]
    for key in ("loss", "grad_norm", "load_balancing_loss", "mtp_loss"):
        assert resumed[0][key] == full[2][key], key
    for n, p in resumed_trainer.params:
        np.testing.assert_array_equal(p.asnumpy(), after[n], err_msg=n)

    if name == "dsv4":  # the export is the family-independent merge checked on DeepSeek-V3 below
        return
    # merged into an HF directory: the same logits as the adapted model
    hf = tmp_path / "hf"
    assert export_main([str(folder(3)), str(hf)]) == 2  # adapters present: --lora is needed
    assert export_main([str(folder(3)), str(hf), "--lora", str(ck / "lora" / "iter_0000003")]) == 0
    assert not any(n.endswith((".lora_a", ".lora_b")) for n in load_file(str(hf / "model.safetensors")))
    # a LoRA run starts from that HF directory (fresh adapters, lora_b zero: the merged model)
    start = Trainer(tiny_config(lora.replace("lora_b_std: 0.01", "lora_b_std: 0.0"), f"checkpoint.load_path={hf}"),
                    Runtime(device="CPU"), out=lines.append)
    assert any("HF model directory" in x for x in lines)
    ids = Tensor(np.arange(32, dtype=np.int32).reshape(1, 32) * 7 % 512)
    np.testing.assert_allclose(start.model(ids).asnumpy(), trainer.model(ids).asnumpy(), atol=1e-5, rtol=0)


@pytest.mark.parametrize("base", ["qlora", "qwen3", "noqlora"])
def test_adapters_under_mindformers_names_are_its_fused_adapter(base):
    """checkpoint.layout mindformers: the adapters of a fused layer's parts (shared lora_a, each
    part's lora_b) are MindFormers' one adapter of the fused layer: ``linear_qkv.lora_b`` /
    ``linear_fc1.lora_b`` have the fused weight's rows (MLA's q then kv, Qwen3's per-group q, k,
    v blocks, fc1's interleaved gate / up), so MindFormers' merge ``W + s * B @ A`` of the fused
    tensors is the fused tensor of the parts' merges; the names go there and back exactly."""
    from mindtrain.models.hf_config import config_from_hf
    from mindtrain.trainer.lora import with_shared_a
    from mindtrain.trainer.mindformers_names import from_mindformers, parts, to_mindformers

    with open(os.path.join(MODELS, f"hf_{base}", "config.json"), encoding="utf-8") as f:
        cfg = config_from_hf(json.load(f))
    model = mm.build_model(cfg, jit=False)
    lc = LoraConfig(target_modules="linear_qkv|linear_fc1", lora_rank=3, lora_alpha=6)
    apply_lora(model, SimpleNamespace(model=cfg, lora_config=lc), empty=False)
    rng = np.random.default_rng(0)
    params = {p.name: rng.normal(0, 1, tuple(p.shape)).astype(np.float32) for p in model.get_parameters()}
    ours = {n: a for n, a in params.items() if n.endswith((".lora_a", ".lora_b"))}
    weights = {n[:-len("lora_b")] + "weight": params[n[:-len("lora_b")] + "weight"] for n in ours
               if n.endswith(".lora_b")}
    theirs = to_mindformers(ours, cfg)
    fused = [t for t in theirs if t.endswith(".lora_b")]
    assert any(".linear_qkv." in t for t in fused) and any(".linear_fc1." in t for t in fused)
    assert sorted(theirs) == sorted(t[:-1] + k for t in fused for k in "ab")  # one lora_a per fused layer
    assert len(ours) > len(theirs)  # the parts share it
    for t in fused:  # lora_a belongs to the first part (q, gate) only
        assert [n[:-1] for n, _, _ in parts(t[:-1] + "a", theirs[t[:-1] + "a"].shape, cfg)] == [
            n[:-1] for n, _, _ in parts(t, theirs[t].shape, cfg)][:1]
    # MindFormers' merge of its fused tensors = the fused tensor of mindtrain's per-part merges
    merged_parts = {n: merge(w, with_shared_a(ours, cfg)[n[:-len("weight")] + "lora_a"],
                             ours[n[:-len("weight")] + "lora_b"], 2.0) for n, w in weights.items()}
    w_theirs, merged_theirs = to_mindformers(weights, cfg), to_mindformers(merged_parts, cfg)
    for t in fused:
        w = t[:-len("lora_b")] + "weight"
        np.testing.assert_allclose(merge(w_theirs[w], theirs[t[:-1] + "a"], theirs[t], 2.0), merged_theirs[w],
                                   atol=1e-5, rtol=0, err_msg=t)
    back = from_mindformers(theirs, cfg)
    assert sorted(back) == sorted(ours)
    for n, a in ours.items():
        np.testing.assert_array_equal(back[n], a, err_msg=n)
