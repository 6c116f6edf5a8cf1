"""checkpoint.layout: mindformers for Qwen3 / Qwen3-MoE: MindFormers' PyNative names
(``PyNativeQwen3ForCausalLM``'s GPTModel) and layouts, written and read back exactly, whole
and piece by piece, and a Trainer run that saves and resumes through them.

MindFormers' fused ``linear_qkv`` is laid out per query group (pynative/transformers/
attention.py ``SelfAttention.get_query_key_value_tensors``: reshape to (..., groups,
(n_rep + 2) * head_dim), split (n_rep * d, d, d)); the test rebuilds that split in numpy on
its own and recovers q/k/v from it.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from mindtrain.config import UserError, load_config
from mindtrain.config.model_plan import param_specs
from mindtrain.trainer import mindformers_checkpoint as mf
from mindtrain.trainer import mindformers_names as names
from mindtrain.trainer import sharded
from mindtrain.trainer.sharded import Lazy, Piece

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
QWEN3 = os.path.join(ROOT, "configs", "pynative_qwen3_tiny.yaml")
QWEN3_MOE = os.path.join(ROOT, "configs", "pynative_qwen3_moe_tiny.yaml")
SMALL = ["model.num_hidden_layers=2"]
# (config, overrides): GQA n_rep 2 (4 heads, 2 groups) with and without biases, tied and not;
# n_rep 4 (8 heads of 16, 2 groups); Qwen3-MoE (layer 0 dense, layer 1 MoE)
CASES = {
    "qwen3": (QWEN3, []),
    "qwen3-bias-untied": (QWEN3, ["model.attention_bias=true", "model.tie_word_embeddings=false"]),
    "qwen3-rep4": (QWEN3, ["model.num_attention_heads=8", "model.head_dim=16", "model.attention_bias=true"]),
    "qwen3_moe": (QWEN3_MOE, []),
    "qwen3_moe-bias-untied": (QWEN3_MOE, ["model.attention_bias=true", "model.tie_word_embeddings=false"]),
}


def _model(case: str):
    path, extra = CASES[case]
    return load_config(path, SMALL + extra).model


def _weights(cfg, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {p.name: rng.standard_normal(p.shape).astype(np.float32) for p in param_specs(cfg)}


def _split_qkv(w: np.ndarray, cfg) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """q, k, v rows of MindFormers' linear_qkv weight ([rows, H]) or bias ([rows]), as its
    SelfAttention splits them: (groups, (n_rep + 2) * d) then (n_rep * d, d, d)."""
    groups, heads, d = cfg.num_key_value_heads, cfg.num_attention_heads, cfg.head_dim
    rep = heads // groups
    x = w.reshape((groups, (rep + 2) * d) + w.shape[1:])
    q, k, v = np.split(x, [rep * d, (rep + 1) * d], axis=1)
    return (q.reshape((heads * d,) + w.shape[1:]), k.reshape((groups * d,) + w.shape[1:]),
            v.reshape((groups * d,) + w.shape[1:]))


@pytest.mark.parametrize("case", sorted(CASES))
def test_names_layouts_and_round_trip(case):
    cfg = _model(case)
    ours = _weights(cfg)
    theirs = names.to_mindformers(ours, cfg, buffers=True)
    moe = cfg.model_type == "qwen3_moe"
    want = {"embedding.word_embeddings.weight", "decoder.final_layernorm.weight"}
    if not cfg.tie_word_embeddings:
        want.add("output_layer.weight")  # absent when tied (GPTModel skips its allocation)
    for i in range(2):
        p = f"decoder.layers.{i}."
        want |= {p + t for t in ("input_layernorm.weight", "pre_mlp_layernorm.weight",
                                 "self_attention.linear_qkv.weight", "self_attention.linear_proj.weight",
                                 "self_attention.q_layernorm.weight", "self_attention.k_layernorm.weight")}
        if cfg.attention_bias:
            want |= {p + "self_attention.linear_qkv.bias", p + "self_attention.linear_proj.bias"}
        if moe and i == 1:
            want |= {p + t for t in ("mlp.router.weight", "mlp.tokens_per_expert", "mlp.experts.weight1",
                                     "mlp.experts.weight2")}
        else:
            want |= {p + "mlp.linear_fc1.weight", p + "mlp.linear_fc2.weight"}
    assert set(theirs) == want

    h, d = cfg.hidden_size, cfg.head_dim
    n, g = cfg.num_attention_heads, cfg.num_key_value_heads
    for i in range(2):
        a, p = f"model.layers.{i}.self_attn.", f"decoder.layers.{i}."
        qkv = theirs[p + "self_attention.linear_qkv.weight"]
        assert qkv.shape == ((n + 2 * g) * d, h)
        for got, mine in zip(_split_qkv(qkv, cfg), ("q_proj", "k_proj", "v_proj")):
            np.testing.assert_array_equal(got, ours[a + mine + ".weight"])
        if cfg.attention_bias:
            for got, mine in zip(_split_qkv(theirs[p + "self_attention.linear_qkv.bias"], cfg),
                                 ("q_proj", "k_proj", "v_proj")):
                np.testing.assert_array_equal(got, ours[a + mine + ".bias"])
        # MindFormers' forward: qkv = x W^T reshaped per group and split = our q / k / v projections
        x = np.random.default_rng(1).standard_normal((3, h)).astype(np.float32)
        mixed = (x @ qkv.T).reshape(3, g, -1)
        q, k, v = np.split(mixed, [(n // g) * d, (n // g + 1) * d], axis=2)
        np.testing.assert_allclose(q.reshape(3, -1), x @ ours[a + "q_proj.weight"].T, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(k.reshape(3, -1), x @ ours[a + "k_proj.weight"].T, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(v.reshape(3, -1), x @ ours[a + "v_proj.weight"].T, rtol=1e-5, atol=1e-5)
        m = f"model.layers.{i}.mlp."
        if moe and i == 1:  # weight1 [E, H, 2I] = [gate^T | up^T], weight2 [E, I, H] = down^T
            w1 = theirs[p + "mlp.experts.weight1"]
            im = cfg.moe_intermediate_size
            np.testing.assert_array_equal(w1[:, :, :im], ours[m + "experts.gate_proj"].transpose(0, 2, 1))
            np.testing.assert_array_equal(w1[:, :, im:], ours[m + "experts.up_proj"].transpose(0, 2, 1))
            np.testing.assert_array_equal(theirs[p + "mlp.experts.weight2"],
                                          ours[m + "experts.down_proj"].transpose(0, 2, 1))
            np.testing.assert_array_equal(theirs[p + "mlp.router.weight"], ours[m + "gate.weight"])
            assert not theirs[p + "mlp.tokens_per_expert"].any()
        else:  # MLP: linear_fc1 output reshaped (..., I, 2), [..., 0] the gate, [..., 1] up
            fc1 = theirs[p + "mlp.linear_fc1.weight"].reshape(-1, 2, h)
            np.testing.assert_array_equal(fc1[:, 0], ours[m + "gate_proj.weight"])
            np.testing.assert_array_equal(fc1[:, 1], ours[m + "up_proj.weight"])

    back = names.from_mindformers(theirs, cfg)
    assert set(back) == set(ours)
    for k in ours:
        np.testing.assert_array_equal(back[k], ours[k], err_msg=k)


@pytest.mark.parametrize("case", ["qwen3-bias-untied", "qwen3_moe"])
def test_round_trip_through_files_with_moments(case, tmp_path):
    cfg = _model(case)
    ours = _weights(cfg)
    opt = {f"exp_avg.{k}": 2 * a for k, a in ours.items()} | {f"exp_avg_sq.{k}": a * a for k, a in ours.items()}
    opt["step"] = np.array(7, np.int64)
    tensors, files = mf.checkpoint_files(ours, opt, "qwen3", 1, mf.common_info(7, 10, 2, 14), cfg)
    folder = tmp_path / mf.folder_name(7)
    folder.mkdir()
    for fname, ts in tensors.items():
        sharded.write_safetensors(str(folder / fname), ts.items())
    for fname, j in files.items():
        (folder / fname).write_text(json.dumps(j))
    model, optim, common = mf.read_checkpoint(str(folder))
    assert "decoder.layers.0.self_attention.linear_qkv.weight" in model
    assert "adam_m.decoder.layers.0.self_attention.linear_qkv.weight" in optim
    got, got_opt = mf.network_tensors(model, optim, cfg)
    assert set(got) == set(ours)
    for k in ours:
        np.testing.assert_array_equal(got[k], ours[k])
        np.testing.assert_array_equal(got_opt[f"adam_m.{k}"], opt[f"exp_avg.{k}"])
        np.testing.assert_array_equal(got_opt[f"adam_v.{k}"], opt[f"exp_avg_sq.{k}"])
    boxes = mf.MindFormersBoxes(str(folder), cfg)
    for k in ours:
        np.testing.assert_array_equal(boxes.read_full(k), ours[k])
        np.testing.assert_array_equal(boxes.read_full(f"exp_avg.{k}"), opt[f"exp_avg.{k}"])
    assert int(boxes.read_full("step")) == 7


def _cuts(n: int, parts: int) -> list[tuple[int, int]]:
    c = -(-n // parts)
    return [(r * c, min(n, (r + 1) * c)) for r in range(parts) if r * c < n]


def _rank_pieces(ours: dict, rank: int, tp: int, fsdp: int) -> list[tuple[Piece, Lazy]]:
    """Rank (t, f) = divmod(rank, fsdp)'s pieces: TP slices dim 0 of q/k/v (and their biases),
    gate/up and the experts' gate/up (dim 1), then FSDP cuts the slice's dim 0 at any row
    (ceil), with the AdamW moments alongside."""
    t, f = divmod(rank, fsdp)
    out = []
    for name, a in ours.items():
        off, shape = [0] * a.ndim, list(a.shape)
        column = any(s in name for s in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"))
        tdim = 1 if "experts." in name else 0
        if column and tp > 1:
            n = a.shape[tdim] // tp
            off[tdim], shape[tdim] = t * n, n
        cuts = _cuts(shape[0], fsdp)
        if f >= len(cuts):
            continue
        lo, hi = cuts[f]
        off[0], shape[0] = off[0] + lo, hi - lo
        box = tuple(slice(o, o + s) for o, s in zip(off, shape))
        for kind, prefix, scale in (("model", "", 1), ("opt", "exp_avg.", 2)):
            out.append((Piece(kind, prefix + name, a.shape, tuple(off), tuple(shape), "float32"),
                        Lazy(prefix + name, tuple(shape), np.dtype(np.float32), lambda a=a, b=box, s=scale: s * a[b])))
    return out


def _write(folder, everyone_pieces: list[list[tuple[Piece, Lazy]]]) -> list[list[Piece]]:
    everyone = [[p for p, _ in ps] for ps in everyone_pieces]
    plan = sharded.plan_files(everyone, "qwen3")
    for rank, ps in enumerate(everyone_pieces):
        by_file: dict[str, list[Lazy]] = {}
        for p, lazy in ps:
            if plan.writer[p.key] == rank:
                by_file.setdefault(plan.file[p.key], []).append(lazy)
        for fname, lazies in by_file.items():
            sharded.write_lazy(os.path.join(folder, fname), lazies)
    with open(os.path.join(folder, mf.METADATA_FILE), "w") as f:
        json.dump(plan.metadata(everyone), f)
    with open(os.path.join(folder, mf.COMMON_FILE), "w") as f:
        json.dump(mf.common_info(3, 10, 2, 6), f)
    return everyone


@pytest.mark.parametrize("tp, fsdp", [(2, 1), (1, 3), (2, 2)])
def test_rank_pieces_are_boxes_of_linear_qkv_and_read_back(tp, fsdp, tmp_path):
    """TP's whole query groups are one box of linear_qkv per rank; an FSDP cut at any row is
    cut further into a box per block it crosses (a file per extra box); every rank's pieces
    read back exactly, under any other cutting."""
    cfg = _model("qwen3_moe-bias-untied")
    ours = _weights(cfg)
    world = tp * fsdp
    mine = [mf.to_pieces(_rank_pieces(ours, r, tp, fsdp), cfg) for r in range(world)]
    qkv = "decoder.layers.0.self_attention.linear_qkv.weight"
    if fsdp == 1:  # whole groups: one box per rank, rows [t * G/tp * P, (t + 1) * G/tp * P)
        for r, ps in enumerate(mine):
            (box,) = [p for p, _ in ps if p.name == qkv]
            rows = box.global_shape[0] // tp
            assert (box.offset, box.shape) == ((r * rows, 0), (rows, cfg.hidden_size))
    full = names.to_mindformers(ours, cfg, buffers=True)
    for ps in mine:  # every box a box of the full MindFormers tensor
        for p, lazy in ps:
            if p.kind == "model":
                want = full[p.name][tuple(slice(o, o + s) for o, s in zip(p.offset, p.shape))]
                np.testing.assert_array_equal(lazy.get(), want, err_msg=p.name)
    folder = tmp_path / mf.folder_name(3)
    folder.mkdir()
    _write(str(folder), mine)
    if fsdp == 3:  # q/k/v rows cut across groups: a rank writes several boxes of linear_qkv
        counts = {int(f.rsplit("-", 1)[1].split(".")[0]) for f in os.listdir(folder) if "-model-" in f}
        assert counts == {5 * world}, counts  # rank 1: q, k and v rows each across two groups, 5 boxes joined
    boxes = mf.MindFormersBoxes(str(folder), cfg, {k: a.shape for k, a in ours.items()})
    boxes.check_files()
    boxes.check_shapes([(k, a.shape) for k, a in ours.items()])
    for k, a in ours.items():
        np.testing.assert_array_equal(boxes.read_full(k), a, err_msg=k)
        np.testing.assert_array_equal(boxes.read_full(f"exp_avg.{k}"), 2 * a, err_msg=k)
    for rank in range(4):  # another layout reads its pieces: TP 2 x FSDP 2 from any save
        for p, _ in _rank_pieces(ours, rank, 2, 2):
            if p.kind == "model":
                want = ours[p.name][tuple(slice(o, o + s) for o, s in zip(p.offset, p.shape))]
                np.testing.assert_array_equal(boxes.read(p.name, p.offset, p.shape), want, err_msg=p.name)
    model, _, _ = mf.read_checkpoint(str(folder))
    assert not model["decoder.layers.1.mlp.tokens_per_expert"].any()


def _share(data: str, world: int, rank: int, extra=()):
    """(config, checkpointer, share) of one rank of ``world`` of the tiny Qwen3-MoE, laid out
    without collectives (as test_mindformers_sharded.py does for DeepSeek-V3)."""
    import mindspore as ms

    from mindtrain.config.derived import num_accumulation_steps, resolve_parallelism
    from mindtrain.trainer.checkpoint import Checkpointer
    from mindtrain.trainer.share import build_share

    ms.set_device("CPU")
    ms.runtime.launch_blocking()
    cfg = load_config(QWEN3_MOE, SMALL + [
        "model.seq_length=32", "train_dataset.dataloader.config.seq_length=32", "compile.enable=false",
        f"train_dataset.dataloader.config.data_path=['1', '{data}']", "checkpoint.layout=mindformers",
        "checkpoint.prefix=qwen3", "training.global_batch_size=2", *extra], world_size=world)
    dims = resolve_parallelism(cfg.parallelism, world)
    ck = Checkpointer(cfg, rank, world, dims.dp, out=lambda _: None)
    share = build_share(cfg, dims, rank, ck, "float32", num_accumulation_steps(cfg, dims),
                        cfg.train_dataset.dataloader.column_names, connect=False)
    return cfg, ck, share


def test_fsdp_by_tp_ranks_write_their_boxes_and_one_process_loads_them(tiny_data, tmp_path):
    """The trainer's own 4 ranks of ZeRO-3 FSDP (2) x TP (2) (each rank's pieces of the
    initial weights and of AdamW moments made from them, no collective): their MindFormers
    files hold the one-process model's MindFormers tensors, and one process (initialised from
    another seed) loads weights and moments back exactly."""
    from mindtrain.trainer.checkpoint import read_pieces, sharded_replace
    from mindtrain.trainer.optimizer import AdamW

    layout = ["parallelism.data_parallel_shard=2", "parallelism.tensor_parallel=2",
              "parallelism.data_parallel_shard_strategy=optim_grads_params"]
    folder = tmp_path / mf.folder_name(3)
    folder.mkdir()
    everyone = []
    for rank in range(4):
        cfg, ck, share = _share(tiny_data, 4, rank, layout)
        named = share.layout.named_params
        opt = AdamW.from_config(named, cfg.optimizer, lr=1e-3)
        state = {"step": np.array(3, np.int64)}
        for n, t in named:
            state[f"exp_avg.{n}"], state[f"exp_avg_sq.{n}"] = 2 * t.asnumpy(), t.asnumpy() ** 2
        opt.load_state_dict(state)
        everyone.append(ck.local_pieces(share.layout, share.buffers, opt))
    _write(str(folder), everyone)
    cfg, _, one = _share(tiny_data, 1, 0)
    full = {n: p.asnumpy() for n, p in one.params.items()}
    model, optim, _ = mf.read_checkpoint(str(folder))
    want = names.to_mindformers(full, cfg.model, buffers=True)
    assert set(model) == set(want)
    for k, a in want.items():
        np.testing.assert_array_equal(model[k], a, err_msg=k)
    for k, a in names.to_mindformers({n: 2 * a for n, a in full.items()}, cfg.model).items():
        np.testing.assert_array_equal(optim[f"adam_m.{k}"], a, err_msg=k)

    _, _, loaded = _share(tiny_data, 1, 0, [f"checkpoint.load_path={folder}", "training.seed=7"])
    assert loaded.resume is not None and loaded.resume.state["step"] == 3
    shards = loaded.layout.shards()
    named = loaded.layout.named_params
    for sh, (n, t) in zip(shards, named):
        np.testing.assert_array_equal(sh.take(t.asnumpy()), full[n], err_msg=n)
    moment = [sharded_replace(sh, f"exp_avg_sq.{sh.name}") for sh in shards]
    for sh, a in zip(shards, read_pieces(loaded.resume.reader, moment, [t for _, t in named])):
        np.testing.assert_array_equal(sh.take(a), full[sh.name] ** 2, err_msg=sh.name)


def test_unknown_and_foreign_names_are_one_line():
    cfg = _model("qwen3")
    with pytest.raises(UserError, match=r"^checkpoint.layout: mindformers: no MindFormers name for parameter "
                                        r"'model.layers.2.self_attn.q_proj.weight' \(Qwen3 has 2 layers\)$"):
        names.placement("model.layers.2.self_attn.q_proj.weight", (128, 128), cfg)
    with pytest.raises(UserError, match=r"^checkpoint.load_path: 'decoder.layers.0.self_attention.linear_qb.weight' "
                                        r"has no mindtrain counterpart"):
        names.parts("decoder.layers.0.self_attention.linear_qb.weight", (128, 64), cfg)
    with pytest.raises(UserError, match=r"^checkpoint.load_path: 'mtp.layers.0.enorm.weight' is a multi-token "
                                        r"prediction module, which Qwen3 has none of"):
        names.parts("mtp.layers.0.enorm.weight", (128,), cfg)
    with pytest.raises(UserError, match=r"is no parameter of MindFormers' Qwen3 that mindtrain knows"):
        names.parts("foo.weight", (1,), cfg)


def test_trainer_saves_and_resumes_exactly_in_the_mindformers_layout(tiny_data, tmp_path):
    """configs/pynative_qwen3_moe_tiny.yaml at 2 layers (one dense, one MoE), seq 32: three
    steps saved each step in MindFormers' layout; resumed from iteration 2, step 3 is the
    same step."""
    import mindspore as ms

    from mindtrain.trainer.runtime import Runtime
    from mindtrain.trainer.trainer import Trainer

    ms.set_device("CPU")
    ms.runtime.launch_blocking()
    save = tmp_path / "ck"

    def config(*extra):
        return load_config(QWEN3_MOE, SMALL + [
            "model.seq_length=32", "train_dataset.dataloader.config.seq_length=32", "training.global_batch_size=2",
            "training.steps=3", "compile.enable=false", f"train_dataset.dataloader.config.data_path=['1', '{tiny_data}']",
            f"monitor.metrics_dir={tmp_path}/metrics", "checkpoint.layout=mindformers", "checkpoint.prefix=qwen3",
            "lr_scheduler.total_steps=3", *extra])

    run = Trainer(config("checkpoint.enable_save=true", f"checkpoint.save_path={save}", "checkpoint.save_interval=1"),
                  Runtime(device="CPU"), out=lambda _: None).train()
    assert len(run) == 3
    folder = save / mf.folder_name(2)
    assert (save / mf.TRACKER).read_text().strip() == "3"
    model, optim, common = mf.read_checkpoint(str(folder))
    assert common["global_step"] == 2
    assert "decoder.layers.0.self_attention.linear_qkv.weight" in model and "output_layer.weight" not in model
    assert "decoder.layers.1.mlp.experts.weight1" in model and "decoder.layers.1.mlp.tokens_per_expert" in model
    assert "adam_v.decoder.layers.0.mlp.linear_fc1.weight" in optim
    ours, _ = mf.network_tensors(model, optim, config().model)
    assert set(ours) == {p.name for p in param_specs(config().model)}
    # mindtrain-export-hf reads the folder through the same map
    from safetensors.numpy import load_file

    from mindtrain.trainer.export_hf import export_hf

    hf = {}
    for path in export_hf(str(folder), str(tmp_path / "hf")):
        hf.update(load_file(path if os.path.isabs(path) else str(tmp_path / "hf" / path)))
    np.testing.assert_array_equal(hf["model.layers.0.self_attn.k_proj.weight"],
                                  ours["model.layers.0.self_attn.k_proj.weight"])
    np.testing.assert_array_equal(hf["model.layers.1.mlp.experts.3.up_proj.weight"],
                                  ours["model.layers.1.mlp.experts.up_proj"][3])

    (rec,) = Trainer(config(f"checkpoint.load_path={folder}"), Runtime(device="CPU"), out=lambda _: None).train()
    figures = [k for k in ("loss", "grad_norm", "load_balancing_loss", "lr", "consumed_samples") if k in run[2]]
    assert "loss" in figures and "grad_norm" in figures
    for key in figures:
        assert rec[key] == run[2][key], (key, rec[key], run[2][key])
