"""mindtrain-estimate: its per-layout bytes against the real sharding code, its rules the
packages' own (parameter plan, FLOPs, row blocks), the command line on the 671B config, and
bad input (one line, exit 2)."""

from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest

from mindtrain.config import load_config, resolve_parallelism
from mindtrain.trainer.estimate import estimate, parse_bytes

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
TINY = os.path.join(ROOT, "configs", "pynative_ds3_tiny.yaml")
DS3 = os.path.join(ROOT, "configs", "pynative_ds3.yaml")
TWO_LAYERS = ["model.num_hidden_layers=2"]
# other shapes of the model: no q LoRA, attention biases, no MTP, every layer MoE
VARIANT = ["model.q_lora_rank=null", "model.attention_bias=true", "model.num_nextn_predict_layers=0",
           "model.first_k_dense_replace=0", "model.n_shared_experts=2"]


def _model(overrides):
    import mindspore as ms

    from mindtrain.models import build_model

    ms.set_device("CPU")
    ms.runtime.launch_blocking()
    cfg = load_config(TINY, overrides)
    return cfg, build_model(cfg.model, jit=False)


def test_one_flops_per_token_and_parameter_plan():
    """The estimate counts with the models package's own rules: the trainer's FLOPs per token
    (the step line's) and the parameters the model builds (mindtrain.config.model_plan, which
    packages/models/tests checks against the built model)."""
    from mindtrain.config import model_plan
    from mindtrain.models import count_parameters, flops_per_token
    from mindtrain.trainer import estimate as e

    assert e.flops_per_token is flops_per_token is model_plan.flops_per_token
    assert count_parameters is model_plan.count_parameters
    cfg = load_config(TINY, VARIANT)
    est = estimate(cfg, 1, "CPU")
    assert est.flops_per_token == flops_per_token(cfg.model)
    assert est.stages[0].optimizer == 8 * count_parameters(cfg.model)[0]


# layouts whose sharding runs in one process (no collective at set-up): rank 0's bytes
LAYOUTS = {
    "single": (1, []),
    "zero1": (2, ["parallelism.data_parallel_shard_strategy=optim"]),
    "zero2": (2, ["parallelism.data_parallel_shard_strategy=optim_grads"]),
    "zero3": (2, ["parallelism.data_parallel_shard_strategy=optim_grads_params"]),
    "tp2": (2, ["parallelism.tensor_parallel=2"]),
    "tp2_dp2_zero3": (4, ["parallelism.tensor_parallel=2",
                          "parallelism.data_parallel_shard_strategy=optim_grads_params"]),
    "ep2_zero3": (2, ["parallelism.expert_parallel=2"]),
    "tp2_ep2_zero2": (4, ["parallelism.tensor_parallel=2", "parallelism.expert_parallel=2",
                          "parallelism.data_parallel_shard_strategy=optim_grads"]),
    "ep4_dp4_zero1": (4, ["parallelism.expert_parallel=4", "parallelism.data_parallel_shard_strategy=optim"]),
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_bytes_are_the_sharded_models(name):
    """Parameters resident between steps and AdamW state, as the engine counts them
    (``Engine.memory_bytes``, ``AdamW.state_bytes``), on the model laid out by
    mindtrain.parallel for every rank of the layout; the largest of the tensors the optimizer
    updates, which sizes a save's buffer and the gradient norm's host copy."""
    from mindtrain.models import parallel_plan
    from mindtrain.parallel import DeviceMesh, apply_expert_parallel, apply_tensor_parallel, fully_shard

    workers, extra = LAYOUTS[name]
    cfg, _ = _model(TWO_LAYERS)  # sets the device
    cfg = load_config(TINY, TWO_LAYERS + ["training.global_batch_size=4", "checkpoint.enable_save=true"] + extra,
                      world_size=workers)
    dims = resolve_parallelism(cfg.parallelism, workers)
    want = estimate(cfg, workers, "CPU").stages[0]
    async_save = estimate(load_config(TINY, TWO_LAYERS + ["training.global_batch_size=4", "checkpoint.enable_save=true",
                                                         "checkpoint.async_save=true"]
                                      + extra, world_size=workers), workers, "CPU").stages[0]
    from mindtrain.models import build_model

    strategy = cfg.parallelism.data_parallel_shard_strategy
    # ZeRO-3 (alone, under TP or EP): one unit per layer, compiled layers (as ShardedLayout
    # lays it out; a compiled model compiles only when it first runs)
    units = dims.dp > 1 and strategy == "optim_grads_params"
    for rank in range(workers):
        model = build_model(cfg.model, jit=units)
        mesh = DeviceMesh(dims, rank)
        plan = parallel_plan(model)
        tp = apply_tensor_parallel(model, plan, mesh) if dims.tp > 1 else None
        ep = apply_expert_parallel(model, plan, mesh) if dims.ep > 1 else None
        experts = ep.param_bytes() if ep is not None else 0
        if dims.dp > 1:
            kw = {}
            if units:
                kw = {"units": [u.path for u in plan.units if u.kind in ("decoder", "mtp")],
                      "shared": {n: [] for n, p in plan.params.items() if p.applied_outside and p.trainable}}
            fs = fully_shard(model, mesh, strategy=strategy, **kw)
            params = fs.memory_bytes()["params"] + experts
            given = list(fs.params)
        else:
            params = sum(p.size * p.itemsize for p in model.trainable_params()) + experts
            given = list(model.trainable_params())
        given += list(ep.params) if ep is not None else []  # what the optimizer updates (and a save writes)
        optim = 8 * sum(p.size for p in given)
        del tp
        assert (want.params, want.optimizer) == (params, optim), (name, rank)
        # a save's buffer: its largest piece; the gradient norm: its float64 copy and square
        largest = 4 * max(p.size for p in given)
        assert (want.save_buffer, want.host_transient) == (largest, 4 * largest), (name, rank)
        # an asynchronous save copies every piece first: the weights and both moments
        assert async_save.save_buffer == 3 * 4 * sum(p.size for p in given), (name, rank)


PIPELINE_LAYOUTS = {
    "pp2": (2, ["parallelism.pipeline_parallel=2"]),
    "pp2_dp2_zero1": (4, ["parallelism.pipeline_parallel=2", "parallelism.data_parallel_shard_strategy=optim"]),
    "pp2_dp2_zero3": (4, ["parallelism.pipeline_parallel=2",
                          "parallelism.data_parallel_shard_strategy=optim_grads_params"]),
    "pp2_cp2_ep2": (4, ["parallelism.pipeline_parallel=2", "parallelism.context_parallel=2",
                        "parallelism.expert_parallel=2"]),
}


@pytest.mark.parametrize("name", list(PIPELINE_LAYOUTS))
def test_pipeline_stage_bytes_are_the_schedules(name):
    """Each stage's resident bytes (``PipelineSchedule.memory_bytes``) and optimizer state
    (8 bytes per element of ``PipelineSchedule.params``) on every rank."""
    from mindtrain.models import build_model, parallel_plan
    from mindtrain.parallel import DeviceMesh, PipelineSchedule

    workers, extra = PIPELINE_LAYOUTS[name]
    _model(TWO_LAYERS)  # sets the device
    cfg = load_config(TINY, TWO_LAYERS + ["training.global_batch_size=4"] + extra, world_size=workers)
    dims = resolve_parallelism(cfg.parallelism, workers)
    est = estimate(cfg, workers, "CPU")
    p = cfg.parallelism
    for rank in range(workers):
        model = build_model(cfg.model, jit=bool(cfg.compile.enable))
        sched = PipelineSchedule(model, parallel_plan(model), DeviceMesh(dims, rank), cfg.model.seq_length,
                                 layers_per_stage=p.pipeline_parallel_layers_per_stage,
                                 dp_sharding=p.data_parallel_shard_strategy if dims.dp_shard > 1 else None)
        want = est.stages[sched.stage_index]
        assert (want.params, want.optimizer) == (sched.memory_bytes(), 8 * sum(q.size for q in sched.params)), \
            (name, rank)


def _cli(*args, cwd=ROOT):
    return subprocess.run([sys.executable, "-m", "mindtrain.trainer.estimate", *args], cwd=cwd,
                          capture_output=True, text=True, timeout=120)


def test_671b_on_the_seeds_two_devices_does_not_fit():
    out = _cli("--config", DS3, "--world-size", "2", "--device-memory", "64GB")
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert "dp_shard=2 (ZeRO-3) tp=1 cp=1 pp=1 ep=1" in text
    (line,) = [x for x in text.splitlines() if "fit" in x.lower() and "GB" in x]
    assert line.startswith("does NOT fit: needs ") and " GB over (" in line
    # the parameters: 671B x 4 bytes over 2 ranks, about 1,271 GB (2^30 bytes), compiled or
    # not (compiled layers take their weights as graph inputs: no copy of any layer)
    params = float(next(x for x in text.splitlines() if x.startswith("parameters")).split()[-1].replace(",", ""))
    assert 1250 < params < 1290
    eager = _cli("--config", DS3, "--world-size", "2", "-o", "compile.enable=false").stdout
    eager_params = float(next(x for x in eager.splitlines() if x.startswith("parameters")).split()[-1].replace(",", ""))
    assert eager_params == params
    # context.max_device_memory is the default device memory
    same = _cli("--config", DS3, "--world-size", "2", "-o", "context.max_device_memory=64GB")
    assert same.returncode == 0 and same.stdout.splitlines()[-1] == text.splitlines()[-1]


FITTING = ["--world-size", "1024", "-o", "parallelism.pipeline_parallel=16", "-o", "parallelism.tensor_parallel=8",
           "-o", "parallelism.expert_parallel=8", "-o", "training.global_batch_size=64",
           "-o", "recompute.mode=full", "--device-memory", "64GB"]


def test_671b_on_a_layout_that_fits():
    out = _cli("--config", DS3, *FITTING)
    assert out.returncode == 0, out.stderr
    last = out.stdout.splitlines()[-1]
    assert last.startswith("fits: needs ") and "GB spare" in last, out.stdout
    assert "pp=16" in out.stdout and "stage 15" in out.stdout


def test_recomputed_attention_is_rebuilt_in_blocks(monkeypatch):
    """Layers whose attention core is recomputed rebuild its scores one block at a time
    (mindtrain.config.recompute's rule, which mindtrain-models runs), eager or compiled (the model then
    compiles such a layer around its core): bench_memory's size at seq 4096. Attention that
    is not recomputed keeps the whole scores."""
    from mindtrain.config import recompute as rules
    from mindtrain.config.plan import causal_block_elements
    from mindtrain.config.schema import RecomputeConfig
    from mindtrain.trainer import estimate

    size = ["model.hidden_size=256", "model.num_attention_heads=8", "model.num_key_value_heads=8",
            "model.seq_length=4096", "train_dataset.dataloader.config.seq_length=4096",
            "model.max_position_embeddings=4096", "training.global_batch_size=1"]
    scores = 8 * 4096 * 4096  # one layer's [B, N, S, S], batch 1
    block = rules.ROW_BLOCK_ELEMENTS  # 1024 rows of one head x 4096 keys

    def act(compiled, mode, **select):
        cfg = load_config(TINY, size + [f"compile.enable={str(compiled).lower()}"])
        dims = resolve_parallelism(cfg.parallelism, 1)
        rc = RecomputeConfig(mode=mode, **({"select_module": select} if select else {}))
        units = [f"layers.{i}" for i in range(cfg.model.num_hidden_layers)]
        return estimate.activation_bytes(cfg, dims, units, 4, rc)

    # a compiled model whose cores run plainly also holds the causal mask's row blocks
    # (mindtrain-models' plan_causal_blocks cuts them for compiled cores only)
    causal = 8 * causal_block_elements(4096) * 4
    cases = [("full", {}), ("select", {"self_attn.core_attention": True})]
    blocked = {(c, mode): act(c, mode, **sel) for c in (False, True) for mode, sel in cases}
    off = act(False, "None")
    assert act(True, "None") == off + causal  # nothing recomputed: nothing in blocks
    # selecting the experts alone leaves the attention whole, eager or compiled
    assert act(False, "select", **{"mlp.experts": True}) + causal == act(True, "select", **{"mlp.experts": True})
    monkeypatch.setattr(rules, "ROW_BLOCK_ELEMENTS", 1 << 40)  # every core whole
    whole = {(c, mode): act(c, mode, **sel) for c in (False, True) for mode, sel in cases}
    core = 2 * scores * 4  # the scores and probabilities a rebuilt whole core keeps
    for key, b in blocked.items():
        # a core in blocks: nothing of it rebuilt at once, one block in the backward's transient;
        # a compiled core run whole reads the causal blocks, one run in blocks none
        assert whole[key] - b == core + 5 * (scores - block) * 4 + (causal if key[0] else 0), key


def test_estimator_needs_no_mindspore():
    code = ("import sys, mindtrain.trainer.estimate as e; e.main(['--config', %r, '--world-size', '2']); "
            "assert 'mindspore' not in sys.modules and 'mindtrain.models' not in sys.modules" % DS3)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr


@pytest.mark.parametrize("args,field", [
    (["--config", "no_such.yaml", "--world-size", "2"], "no_such.yaml"),
    (["--config", DS3, "--world-size", "3", "-o", "parallelism.tensor_parallel=2"], "parallelism"),
    (["--config", DS3, "--world-size", "2", "-o", "parallelism.expert_parallel=3"], "parallelism.expert_parallel"),
    (["--config", DS3, "--world-size", "2", "-o", "model.hidden_sise=8"], "model.hidden_sise"),
    (["--config", DS3, "--world-size", "2", "--device-memory", "lots"], "--device-memory"),
    (["--config", DS3, "--world-size", "2", "-o", "context.max_device_memory=58XB"], "context.max_device_memory"),
    (["--config", DS3, "--world-size", "0"], "--world-size"),
    (["--config", DS3], "--world-size"),
    (["--config", DS3, "--world-size", "4", "-o", "training.global_batch_size=3"], "training.global_batch_size"),
])
def test_bad_input_is_one_line_exit_2(args, field):
    out = _cli(*args)
    assert out.returncode == 2, (out.stdout, out.stderr)
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("mindtrain-estimate: error: ") and field in lines[0], out.stderr
    assert out.stdout == ""


def test_parse_bytes():
    assert parse_bytes("58GB") == 58 * 2 ** 30
    assert parse_bytes("512 MB") == 512 * 2 ** 20
    assert parse_bytes("1.5TB") == int(1.5 * 2 ** 40)
    assert parse_bytes(1024) == 1024


def test_qwen3_layers_follow_the_family():
    """Qwen3-MoE's layers by HF's rule (mlp_only_layers: layer 0 dense), its grouped-query
    attention (the core's scores over the local heads, keys and values per key/value head),
    no shared experts."""
    from mindtrain.config import families
    from mindtrain.trainer.estimate import _Shapes, layer_module

    cfg = load_config(os.path.join(ROOT, "configs", "pynative_qwen3_moe_tiny.yaml"))
    m = cfg.model
    dims = resolve_parallelism(cfg.parallelism, 1)
    s, n, kv, d = m.seq_length, m.num_attention_heads, m.num_key_value_heads, families.head_dim(m)
    z = _Shapes(b=1, s=s, sk=s, tl=s, ta=s, heads=n, inter=m.intermediate_size, moe_inter=m.moe_intermediate_size, c=4)
    paths = [{sub.path: sub.own for sub in layer_module(m, i, z, dims).walk()} for i in range(3)]
    assert "mlp.experts" not in paths[0] and "mlp.experts" in paths[1] and "mlp.experts" in paths[2]
    assert not any("shared_experts" in p for p in paths[1])
    assert paths[1]["self_attn.core_attention"] == 2 * n * s * s * 4
    # q, k, v and their transposes, the output, norms and rope: k and v have kv heads, not n
    assert paths[1]["self_attn"] < 20 * s * n * d * 4 and kv < n


def test_muon_holds_one_buffer_per_matrix():
    """optimizer.type Muon: one float32 buffer per Muon matrix, AdamW's two for the rest
    (norms, and the embedding and head, which MindFormers' default adamw_include names)."""
    from mindtrain.config.model_plan import param_specs
    from mindtrain.trainer.muon import uses_muon  # the optimizer's own rule, with the full name map

    cfg = load_config(TINY, TWO_LAYERS + ["optimizer.type=Muon"])
    specs = param_specs(cfg.model)
    muon = {p.name for p in specs if uses_muon(p.name, p.shape, cfg.optimizer, cfg.model)}
    assert "model.embed_tokens.weight" not in muon and "lm_head.weight" not in muon
    assert "model.layers.1.mlp.experts.gate_proj" in muon and "model.norm.weight" not in muon
    want = 4 * sum(p.numel * (1 if p.name in muon else 2) for p in specs)
    (stage,) = estimate(cfg, 1, device="CPU").stages
    assert stage.optimizer == want
    adamw = estimate(load_config(TINY, TWO_LAYERS), 1, device="CPU").stages[0].optimizer
    assert stage.optimizer < 0.6 * adamw


def test_muon_estimate_and_optimizer_pick_the_same_parameters():
    """A custom adamw_include over MindFormers' layer names (linear_qkv, the experts'
    weight1, an MTP module's eh_proj): the estimator and the Muon optimizer decide with one
    rule and one name map, so the estimate counts the buffers of the parameters that train."""
    import numpy as np
    from mindspore import Parameter, Tensor

    from mindtrain.config.model_plan import param_specs
    from mindtrain.trainer.muon import Muon

    globs = '["*word_embeddings*", "*output_layer*", "*linear_qkv*", "*experts.weight1*", "mtp.*.eh_proj*"]'
    cfg = load_config(TINY, TWO_LAYERS + ["optimizer.type=Muon", f"optimizer.adamw_include={globs}"])
    specs = param_specs(cfg.model)
    named = [(p.name, Parameter(Tensor(np.zeros(p.shape, np.float32)), name=p.name)) for p in specs]
    opt = Muon(named, cfg.optimizer, lr=0.1, model=cfg.model)
    muon = {specs[i].name for i in opt.muon_idx}
    adamw_matrices = {specs[i].name for i in opt.adamw_idx if len(specs[i].shape) > 1}
    # the globs name layer weights by MindFormers' names only: mindtrain's names match none of them
    assert adamw_matrices == {"model.embed_tokens.weight", "lm_head.weight", "model.layers.2.eh_proj.weight"} | {
        f"model.layers.{i}.self_attn.{w}.weight" for i in range(3) for w in ("q_a_proj", "kv_a_proj_with_mqa")} | {
        f"model.layers.{i}.mlp.experts.{w}" for i in (1, 2) for w in ("gate_proj", "up_proj")}
    assert "model.layers.1.mlp.experts.down_proj" in muon and "model.layers.0.self_attn.q_b_proj.weight" in muon
    (stage,) = estimate(cfg, 1, device="CPU").stages
    assert stage.optimizer == 4 * sum(p.numel * (1 if p.name in muon else 2) for p in specs)


def test_deepseek_v4_layers_follow_the_family():
    """DeepSeek-V4's layers (configs/pynative_ds4_tiny.yaml): the scores over every key plus
    the layer's compressed entries and the sink, a compressor only in compressed layers (the
    indexer's share in the compressed sparse one), the hyper-connection streams as the layer
    input; its parameters and FLOPs are the config's plan's."""
    from mindtrain.config import families
    from mindtrain.config.model_plan import count_parameters, flops_per_token
    from mindtrain.trainer.estimate import _Shapes, _layer_input, layer_module

    cfg = load_config(os.path.join(ROOT, "configs", "pynative_ds4_tiny.yaml"))
    m = cfg.model
    dims = resolve_parallelism(cfg.parallelism, 1)
    s, n = m.seq_length, m.num_attention_heads
    z = _Shapes(b=1, s=s, sk=s, tl=s, ta=s, heads=n, inter=0, moe_inter=m.moe_intermediate_size, c=4)
    paths = [{sub.path: sub.own for sub in layer_module(m, i, z, dims).walk()} for i in range(3)]
    assert families.v4_attention_kinds(m) == ["sliding", "csa", "hca"]
    for i, entries in enumerate((0, s // 4, s // 16)):
        assert paths[i]["self_attn.core_attention"] == 2 * n * s * (s + entries + 1) * 4
    assert "self_attn.compressor" not in paths[0]
    assert paths[1]["self_attn.compressor"] > paths[2]["self_attn.compressor"] > 0  # the indexer's share
    assert all("mlp.shared_experts" in p for p in paths)
    assert _layer_input(m, 0, z) == m.hc_mult * s * m.hidden_size * 4
    total, _ = count_parameters(m)
    est = estimate(cfg, 1, "CPU")
    assert est.stages[0].optimizer == 8 * total and est.flops_per_token == flops_per_token(m)


V4 = os.path.join(ROOT, "configs", "pynative_ds4_tiny.yaml")
V4_LAYOUTS = {  # DeepSeek-V4 (issue 32): its plan's splits (heads, output groups, experts) per layout
    "tp2": (2, ["parallelism.tensor_parallel=2"]),
    "ep2_zero3": (2, ["parallelism.expert_parallel=2", "parallelism.data_parallel_shard_strategy=optim_grads_params"]),
    "tp2_ep2_zero2": (4, ["parallelism.tensor_parallel=2", "parallelism.expert_parallel=2"]),
    "pp2": (2, ["parallelism.pipeline_parallel=2"]),
    # issue 34: plain residual layers without the query-latent / key-value norms, TP=2 and PP=2
    "tp2_plain": (2, ["parallelism.tensor_parallel=2", "model.enable_hyper_connections=false",
                      "model.enable_hc_head=false", "model.qk_layernorm=false"]),
    "pp2_plain": (2, ["parallelism.pipeline_parallel=2", "model.enable_hyper_connections=false",
                      "model.enable_hc_head=false", "model.qk_layernorm=false"]),
}


@pytest.mark.parametrize("name", list(V4_LAYOUTS))
def test_deepseek_v4_layout_bytes_are_the_laid_out_models(name):
    """DeepSeek-V4's parameters resident between steps and AdamW state per rank, estimated,
    equal the model laid out by mindtrain.parallel on every rank (the indexer and the
    hyper-connections whole on every TP rank, the query heads and output groups split)."""
    from mindtrain.models import build_model, parallel_plan
    from mindtrain.parallel import DeviceMesh, PipelineSchedule, apply_expert_parallel, apply_tensor_parallel
    from mindtrain.parallel import fully_shard

    _model(TWO_LAYERS)  # sets the device
    workers, extra = V4_LAYOUTS[name]
    cfg = load_config(V4, ["model.seq_length=32", "train_dataset.dataloader.config.seq_length=32",
                           "training.global_batch_size=4"] + extra, world_size=workers)
    dims = resolve_parallelism(cfg.parallelism, workers)
    est = estimate(cfg, workers, "CPU")
    strategy = cfg.parallelism.data_parallel_shard_strategy
    for rank in range(workers):
        model = build_model(cfg.model, jit=False)
        mesh = DeviceMesh(dims, rank)
        plan = parallel_plan(model)
        if dims.pp > 1:
            sched = PipelineSchedule(model, plan, mesh, cfg.model.seq_length)
            params, given, want = sched.memory_bytes(), list(sched.params), est.stages[sched.stage_index]
        else:
            apply_tensor_parallel(model, plan, mesh)
            ep = apply_expert_parallel(model, plan, mesh)
            experts = ep.param_bytes()
            kw = {}
            if strategy == "optim_grads_params":
                kw = {"units": [u.path for u in plan.units if u.kind == "decoder"]}
            if dims.dp > 1:
                fs = fully_shard(model, mesh, strategy=strategy, **kw)
                params, given = fs.memory_bytes()["params"] + experts, list(fs.params) + list(ep.params)
            else:
                params = sum(p.size * p.itemsize for p in model.trainable_params()) + experts
                given = list(model.trainable_params()) + list(ep.params)
            want = est.stages[0]
        assert (want.params, want.optimizer) == (params, 8 * sum(p.size for p in given)), (name, rank)


LORA = "lora_config={target_modules: 'linear_(qkv|fc1|proj)|eh_proj|output_layer'}"
Z3 = "parallelism.data_parallel_shard_strategy=optim_grads_params"
LORA_LAYOUTS = {  # workers, overrides (ZeRO-3: build_share lays each rank out without a collective)
    "lora_zero3": (2, [LORA, Z3]),
    "lora_zero3_never_muon": (2, [LORA, Z3, "parallelism.reshard_after_forward_policy=never", "optimizer.type=Muon"]),
    "lora_tp2_zero3": (4, [LORA, Z3, "parallelism.tensor_parallel=2"]),
    "zero3_buckets": (2, [Z3, "model.num_hidden_layers=3"]),  # no LoRA: three units, one 16 MB bucket
}


@pytest.mark.parametrize("name", list(LORA_LAYOUTS))
def test_lora_and_zero3_gathering_are_the_laid_out_runs(name):
    """Each rank of the trainer's own layout (``build_share(connect=False)``, the LoRA
    adapters applied): its resident parameter bytes (the metrics' ``param_bytes``,
    ``Layout.memory_bytes``) include the adapters; its optimizer state (``optimizer_bytes``,
    the trainer's ``AdapterOptimizer`` of AdamW or Muon) is the adapters' alone; the ZeRO-3
    bytes gathered at once are the root plus FSDP's largest bucket of consecutive units (the
    tiny model's units fit one 16 MB bucket), or every weight with reshard_after_forward_policy
    never; the gradient norm's host copy is the largest adapter piece's (Muon: its gather's
    batches, larger here)."""
    import mindspore as ms

    from mindtrain.config.derived import num_accumulation_steps
    from mindtrain.models.lora import is_adapter
    from mindtrain.trainer.checkpoint import Checkpointer
    from mindtrain.trainer.lora import AdapterOptimizer
    from mindtrain.trainer.muon import build_optimizer
    from mindtrain.trainer.share import build_share

    ms.set_device("CPU")
    ms.runtime.launch_blocking()
    workers, extra = LORA_LAYOUTS[name]
    cfg = load_config(TINY, TWO_LAYERS + ["training.global_batch_size=4"] + extra, world_size=workers)
    dims = resolve_parallelism(cfg.parallelism, workers)
    est = estimate(cfg, workers, "CPU").stages[0]
    lora = cfg.lora_config is not None
    for rank in range(workers):
        ck = Checkpointer(cfg, rank, workers, dims.dp, out=lambda _: None)
        share = build_share(cfg, dims, rank, ck, "float32", num_accumulation_steps(cfg, dims),
                            cfg.train_dataset.dataloader.column_names, connect=False)
        layout = share.layout
        trained = [i for i, (n, _) in enumerate(layout.named_params) if is_adapter(n)] if lora else \
            list(range(len(layout.named_params)))
        assert bool(share.adapted) == lora and (not lora or 0 < len(trained) < len(layout.named_params))
        opt = build_optimizer([layout.named_params[i] for i in trained], cfg.optimizer, lr=1e-3, layout=layout,
                              model=cfg.model)
        opt = AdapterOptimizer(opt, trained) if lora else opt
        assert (est.params, est.optimizer) == (layout.memory_bytes(), opt.state_bytes()), (name, rank)
        largest = max(layout.params[i].size * 4 for i in trained)
        muon = opt.inner if lora else opt
        # Muon gathers whole matrices (a fused layer's lora_b parts together) a batch at a time and
        # holds their updates: twice its largest batch's bytes
        gathered = 2 * max(sum(4 * math.prod(muon.global_shapes[i]) for i in b) for b in muon.batches) \
            if getattr(muon, "gather", False) else 0
        assert est.host_transient == max(4 * largest, gathered), (name, rank)
        fs = layout.fsdp
        if fs is not None and fs.strategy == "optim_grads_params":
            nbytes = {s.name: 4 * math.prod(s.shape) for s in fs.slots.values()}
            if fs.reshard_after_forward:  # the root, and a bucket (units gathered by one collective)
                at_once = max(sum(nbytes[s.name] for b in u.group for s in b.slots) for u in fs.units)
                assert len(fs.units) > 1 and all(u.group == fs.units for u in fs.units)  # one bucket
                want = sum(nbytes[s.name] for s in fs.root.slots) + at_once
            else:  # everything, from the first forward to the end of the backward
                want = sum(nbytes.values())
            assert est.gathered == want, (name, rank, est.gathered, want)
            # the forward replayed in the backward: reshard after forward where dispatch is
            # asynchronous; on CPU (synchronous) the units release their storage in place
            assert est.units_replay == (fs.reshard_after_forward and not fs.in_place)
