"""checkpoint.layout: mindformers under a parallel layout: each rank writes only its pieces.

The 4 ranks of FSDP ZeRO-3 (2) x TP (2) are laid out one after the other in this process
(``build_share(connect=False)``: each rank's pieces made from the initial values, no
collective); each rank's save (``Checkpointer.local_pieces``: its pieces as boxes of
MindFormers' fused tensors) is written as its own files, the piece lists exchanged here as
the ranks exchange them. Under this layout every kind of fused tensor is cut: ``linear_qkv``
by its two FSDP-sharded parts (two boxes per rank, so two files per rank), ``linear_fc1`` by
TP and FSDP (a rank's gate and up rows one box), ``weight1`` by TP (two boxes per rank).

The files hold exactly one copy of the weights and moments, no rank writes more than it
holds, the tensors are MindFormers' (the full-model transform of the one-process weights),
and the folder loads into one process and into another layout. A folder that lacks a rank's
file, or was written for another model, is refused by the command line in one line, exit 2.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from safetensors import safe_open

from mindtrain.trainer import mindformers_checkpoint as mf
from mindtrain.trainer import mindformers_names as mfn
from mindtrain.trainer import sharded

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
ENTRY = os.path.join(ROOT, "run_mindformer.py")
TINY = os.path.join(ROOT, "configs", "pynative_ds3_tiny.yaml")
WORLD = 4
LAYOUT = ["parallelism.data_parallel_shard=2", "parallelism.tensor_parallel=2",
          "parallelism.data_parallel_shard_strategy=optim_grads_params", "training.global_batch_size=2"]


V4 = os.path.join(ROOT, "configs", "pynative_ds4_tiny.yaml")
# DeepSeek-V4 (issue 32): the tiny config's hybrid attention (sliding, compressed sparse with its
# indexer, heavily compressed; hash routing in layer 0, the stream head), and the mla variant
# with an MTP module; two hyper-connection streams, so a scale [3] is cut by ZeRO-3 across the
# alphas MindFormers keeps it as
V4_CASES = {"dsv4_hybrid": [], "mla_mtp": ["model.experimental_attention_variant=mla", "model.kv_lora_rank=32",
                                           "model.qk_nope_head_dim=16", "model.v_head_dim=16",
                                           "model.num_nextn_predict_layers=1"]}


def _overrides(data: str, extra=()) -> list[str]:
    return ["model.seq_length=32", "train_dataset.dataloader.config.seq_length=32", "model.num_hidden_layers=2",
            "compile.enable=false", f"train_dataset.dataloader.config.data_path=['1', '{data}']",
            "checkpoint.layout=mindformers", "checkpoint.prefix=ds3", *extra]


def _share(data: str, world: int, rank: int, extra=(), config: str = TINY):
    """(config, checkpointer, share) of one rank of ``world``, laid out without collectives."""
    import mindspore as ms

    from mindtrain.config import load_config
    from mindtrain.config.derived import num_accumulation_steps, resolve_parallelism
    from mindtrain.trainer.checkpoint import Checkpointer
    from mindtrain.trainer.share import build_share

    ms.set_device("CPU")
    ms.runtime.launch_blocking()
    cfg = load_config(config, _overrides(data, extra), world_size=world)
    dims = resolve_parallelism(cfg.parallelism, world)
    ck = Checkpointer(cfg, rank, world, dims.dp, out=lambda _: None)
    share = build_share(cfg, dims, rank, ck, "float32", num_accumulation_steps(cfg, dims),
                        cfg.train_dataset.dataloader.column_names, connect=False)
    return cfg, ck, share


def _moments(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    return 2 * w, w * w  # any function of the weight's own values: each rank makes its pieces' moments


def _save(folder: str, data: str, config: str = TINY, extra=()):
    """WORLD ranks of LAYOUT (+ ``extra``) each write their pieces into ``folder``, as the
    trainer's save does; (one-process weights, bytes each rank held, bytes each rank wrote,
    model config)."""
    from mindtrain.models import config_to_hf
    from mindtrain.trainer.optimizer import AdamW

    os.makedirs(folder)
    ranks = []
    for rank in range(WORLD):
        cfg, ck, share = _share(data, WORLD, rank, [*LAYOUT, *extra], config)
        named = share.layout.named_params
        opt = AdamW.from_config(named, cfg.optimizer, lr=1e-3)
        state = {"step": np.array(5, np.int64)}
        for n, t in named:
            state[f"exp_avg.{n}"], state[f"exp_avg_sq.{n}"] = _moments(t.asnumpy())
        opt.load_state_dict(state)
        pieces = ck.local_pieces(share.layout, share.buffers, opt)
        # its pieces of the weights and both moments, the buffers (every rank holds them whole),
        # the MindFormers constants its pieces size (tokens_per_expert, V4's rms_weight /
        # q_rms_gamma) and the step
        held = (3 * sum(int(t.size) * 4 for _, t in named) + sum(int(p.size) * 4 for _, p in share.buffers)
                + sum(4 * int(np.prod(p.shape)) for p, _ in pieces if mfn.is_companion(p.name, cfg.model)) + 8)
        ranks.append((pieces, held))
    everyone = [[p for p, _ in pieces] for pieces, _ in ranks]
    plan = sharded.plan_files(everyone, "ds3")
    wrote = []
    for rank, (pieces, _) in enumerate(ranks):
        files: dict[str, dict] = {}
        for p, lazy in pieces:
            if plan.writer[p.key] == rank:
                files.setdefault(plan.file[p.key], {})[p.name] = lazy
        for fname, tensors in files.items():
            sharded.write_safetensors(os.path.join(folder, fname), tensors.items())
        wrote.append(sum(t.nbytes for tensors in files.values() for t in tensors.values()))
    with open(os.path.join(folder, mf.METADATA_FILE), "w") as f:
        json.dump(plan.metadata(everyone), f)
    with open(os.path.join(folder, mf.COMMON_FILE), "w") as f:
        json.dump(mf.common_info(5, 10, 2, 10), f)
    with open(os.path.join(folder, "config.json"), "w") as f:  # as rank 0 writes it
        json.dump(config_to_hf(cfg.model), f)
    _, _, one = _share(data, 1, 0, extra, config)
    full = {n: p.asnumpy() for n, p in one.params.items()}
    return full, [h for _, h in ranks], wrote, one.model.config


@pytest.fixture(scope="module")
def saved(tiny_data, tmp_path_factory):
    """(folder, one-process weights, bytes each rank held, bytes each rank wrote, model config)."""
    folder = str(tmp_path_factory.mktemp("mf_sharded") / mf.folder_name(5))
    return (folder, *_save(folder, tiny_data))


@pytest.fixture(scope="module", params=list(V4_CASES))
def saved_v4(request, tiny_data, tmp_path_factory):
    """The same save of DeepSeek-V4 (each case of V4_CASES): (folder, one-process weights and
    buffers, bytes each rank held, bytes each rank wrote, model config, case)."""
    folder = str(tmp_path_factory.mktemp(f"mf_sharded_{request.param}") / mf.folder_name(5))
    return (folder, *_save(folder, tiny_data, V4, V4_CASES[request.param]), request.param)


def test_each_rank_writes_its_pieces_once(saved):
    folder, full, held, wrote, cfg = saved
    trainable = {n for n in full if not n.endswith("e_score_correction_bias")}
    experts = cfg.n_routed_experts
    routers = sum(n.endswith("e_score_correction_bias") for n in full)
    one_copy = (sum(a.nbytes for a in full.values()) + 2 * sum(full[n].nbytes for n in trainable)
                + routers * experts * 4 + 8)  # + tokens_per_expert buffers, global_step
    assert sum(wrote) == one_copy, (wrote, one_copy)
    for w, h in zip(wrote, held):  # nothing beyond its own pieces (replicas written by one of them)
        assert 0 < w <= h, (wrote, held)
    # MindFormers' file names: two boxes of linear_qkv and weight1 per rank -> two files per rank
    files = sorted(f for f in os.listdir(folder) if f.endswith(".safetensors"))
    assert files == sorted(f"ds3-{k}-{i:07d}-{2 * WORLD:07d}.safetensors" for k in ("model", "opt")
                           for i in range(2 * WORLD)), files
    meta = json.load(open(os.path.join(folder, mf.METADATA_FILE)))
    qkv = meta["state_dict_metadata"]["decoder.layers.0.self_attention.linear_qkv.weight"]
    # q_a_proj's 64 rows and kv_a_proj's 48, each cut in 2 by FSDP (replicated over TP)
    assert sorted(c["global_offset"][0] for c in qkv["chunk"]) == [0, 32, 64, 88]
    stores = meta["storage_data"]["('decoder.layers.0.self_attention.linear_qkv.weight', (64, 0))"]
    assert stores == [{"file_name": "ds3-model-0000004-0000008.safetensors", "storage_rank": 0,
                       "rank_group": [0, 1]}]
    fc1 = meta["state_dict_metadata"]["decoder.layers.0.mlp.linear_fc1.weight"]
    assert sorted(tuple(c["global_offset"]) for c in fc1["chunk"]) == [(0, 0), (128, 0), (256, 0), (384, 0)]
    for fname in files:
        with safe_open(os.path.join(folder, fname), framework="np") as f:
            assert mfn.uses_mindformers_names(list(f.keys())) or fname.startswith("ds3-opt"), fname


def test_files_hold_mindformers_tensors_of_the_one_process_weights(saved):
    folder, full, _, _, cfg = saved
    model, opt, common = mf.read_checkpoint(folder)
    assert common["global_step"] == 5 and opt["global_step"].tolist() == [5]
    want = mfn.to_mindformers(full, cfg, buffers=True)
    assert sorted(model) == sorted(want)
    for k, a in want.items():
        np.testing.assert_array_equal(model[k], a, err_msg=k)
    exp_avg, exp_avg_sq = {}, {}
    for n, a in full.items():
        if not n.endswith("e_score_correction_bias"):
            exp_avg[n], exp_avg_sq[n] = _moments(a)
    for prefix, moments in (("adam_m.", exp_avg), ("adam_v.", exp_avg_sq)):
        for k, a in mfn.to_mindformers(moments, cfg).items():
            np.testing.assert_array_equal(opt[prefix + k], a, err_msg=prefix + k)


def test_layouts_say_which_chunk_each_rank_holds_as_mindspore_slices_them(saved):
    """metadata.json's layout of a tensor (what MindFormers' loader reads chunks by) is a
    MindSpore Layout, and MindSpore's own slicing of the full tensor by it gives, for every rank
    of its rank list, the chunk stored for that rank. Only the tensors whose chunks are not an
    even grid (linear_qkv's two FSDP-cut parts, weight1's two TP-cut halves) have none."""
    none = _mindspore_slices(saved[0])
    assert none == sorted(f"{p}.{t}" for p in ("decoder.layers.0", "decoder.layers.1", "mtp.layers.0.transformer_layer")
                          for t in ("self_attention.linear_qkv.weight",) + (
                              ("mlp.experts.weight1",) if p != "decoder.layers.0" else ())), none


def _mindspore_slices(folder: str) -> list[str]:
    """Every layout in the folder's metadata.json is MindSpore's slicing of the tensor into the
    chunks its ranks hold; returns the tensors without one (moments under their weight's name)."""
    from mindspore import Layout, Tensor
    from mindspore.parallel._tensor import _load_tensor

    meta = json.load(open(os.path.join(folder, mf.METADATA_FILE)))
    reader = mf.reader(folder)
    for name, entry in meta["state_dict_metadata"].items():
        lay = entry["layout"]
        if lay is None:
            continue
        names = [lay["alias_name"][len(lay["device_matrix"]) - 1 - m] if m >= 0 else "None" for m in lay["tensor_map"]]
        ms_layout = Layout(tuple(lay["device_matrix"]), tuple(lay["alias_name"]), lay["rank_list"])(*names)
        assert json.loads(json.dumps(ms_layout.to_dict())) == lay, name
        full = reader.read_full(name)
        where = {}
        for c in entry["chunk"]:
            (store,) = meta["storage_data"][sharded.shard_id(name, c["global_offset"])]
            for r in store["rank_group"]:
                where[r] = (c["global_offset"], c["local_shape"])
        for inner, rank in enumerate(lay["rank_list"]):
            want = _load_tensor(Tensor(full), lay["device_matrix"], lay["tensor_map"], list(full.shape), inner)
            np.testing.assert_array_equal(reader.read(name, *where[rank]), want, err_msg=f"{name} rank {rank}")
    return sorted({k.split(".", 1)[1] if k.startswith("adam_") else k
                   for k, e in meta["state_dict_metadata"].items() if e["layout"] is None})


def _loads(folder: str, full: dict, data: str, world: int, rank: int, extra=(), config: str = TINY) -> None:
    """One rank of ``world`` (``extra``) resumes from ``folder``: each of its pieces of the
    weights and moments, and the buffers, equal the saved ones."""
    from mindtrain.trainer.checkpoint import read_pieces, sharded_replace

    _, ck, share = _share(data, world, rank, [f"checkpoint.load_path={folder}", *extra], config)
    assert share.resume is not None and share.resume.state["step"] == 5
    shards = share.layout.shards()
    named = share.layout.named_params
    for sh, (n, t) in zip(shards, named):
        box = tuple(slice(o, o + k) for o, k in zip(sh.offset, sh.shape))
        np.testing.assert_array_equal(sh.take(t.asnumpy()), full[n][box], err_msg=n)
    for n, p in share.buffers:
        np.testing.assert_array_equal(p.asnumpy(), full[n], err_msg=n)
    for kind, which in (("exp_avg", 0), ("exp_avg_sq", 1)):
        moment = [sharded_replace(sh, f"{kind}.{sh.name}") for sh in shards]
        for sh, a in zip(shards, read_pieces(share.resume.reader, moment, [t for _, t in named])):
            box = tuple(slice(o, o + k) for o, k in zip(sh.offset, sh.shape))
            np.testing.assert_array_equal(sh.take(a), _moments(full[sh.name][box])[which], err_msg=sh.name)


@pytest.mark.parametrize("world,rank,extra", [(1, 0, []), (2, 1, ["parallelism.tensor_parallel=2"])])
def test_loads_into_another_layout_and_world_size(saved, tiny_data, world, rank, extra):
    folder, full, _, _, _ = saved
    _loads(folder, full, tiny_data, world, rank, extra)


def _exports(folder: str, full: dict, cfg, out: str, missing=()) -> None:
    """mindtrain-export-hf writes the folder as an HF directory that reads back as ``full``
    (but the weights ``missing``)."""
    from mindtrain.models.hf_checkpoint import HFBoxes
    from mindtrain.trainer.export_hf import main

    from mindtrain.models.hf_checkpoint import read_hf_config
    from mindtrain.models.hf_config import config_from_hf

    assert main([folder, out]) == 0
    with open(os.path.join(out, "config.json"), encoding="utf-8") as f:
        written = json.load(f)
    # the MTP modules under the key HF's config reads (DeepseekV4Config: num_nextn_predict_layers),
    # so a from_pretrained of the directory builds them and reads their weights
    assert written["num_nextn_predict_layers"] == cfg.num_nextn_predict_layers
    cfg = config_from_hf(written)
    # mindtrain's from_pretrained builds the MTP modules the files hold (DeepSeek-V4's config_from_hf
    # alone reads HF's count as 0: HF builds none and skips those tensors)
    assert read_hf_config(out).num_nextn_predict_layers == written["num_nextn_predict_layers"]
    hf = HFBoxes(out, cfg, {n: a.shape for n, a in full.items()}, allow_missing_mtp=bool(missing))
    assert sorted(hf.missing) == sorted(missing)
    for n, a in full.items():
        if n not in missing:
            np.testing.assert_array_equal(hf.read_full(n), a, err_msg=n)


def test_exports_as_an_hf_directory(saved, tmp_path):
    folder, full, _, _, cfg = saved
    _exports(folder, full, cfg, str(tmp_path / "hf"))


def test_v4_ranks_write_mindformers_tensors_once_and_one_process_loads_them(saved_v4, tiny_data, tmp_path):
    """DeepSeek-V4 under ZeRO-3 x TP: the files hold exactly MindFormers' tensors of the
    one-process weights (the int32 hash table, the scales as their alphas, MindFormers'
    constants) and moments, each once, no rank writing more than it holds; a scale cut by
    ZeRO-3 was written by two ranks as different alphas; one process resumes from the folder
    with every weight, buffer and moment as saved, and the folder exports as the released
    checkpoint's names (mindtrain-export-hf)."""
    folder, full, held, wrote, cfg, case = saved_v4
    model, opt, common = mf.read_checkpoint(folder)
    assert common["global_step"] == 5 and opt["global_step"].tolist() == [5]
    want = mfn.to_mindformers(full, cfg, buffers=True)
    assert sorted(model) == sorted(want)
    for k, a in want.items():
        assert model[k].dtype == a.dtype, k
        np.testing.assert_array_equal(model[k], a, err_msg=k)
    assert model["decoder.layers.0.mlp.router.tid2eid"].dtype == np.int32
    buffers = ("tid2eid", "e_score_correction_bias")
    moments = {n: _moments(a) for n, a in full.items() if not n.endswith(buffers)}
    for prefix, which in (("adam_m.", 0), ("adam_v.", 1)):
        for k, a in mfn.to_mindformers({n: m[which] for n, m in moments.items()}, cfg).items():
            np.testing.assert_array_equal(opt[prefix + k], a, err_msg=prefix + k)
    assert sum(wrote) == sum(a.nbytes for a in want.values()) + 2 * sum(a.nbytes for a, _ in moments.values()) + 8
    for w, h in zip(wrote, held):
        assert 0 < w <= h, (wrote, held)
    meta = json.load(open(os.path.join(folder, mf.METADATA_FILE)))
    storage = meta["storage_data"]

    def writer(name):
        (store,) = storage[sharded.shard_id(name, (0,))]
        return store["storage_rank"]

    hc = "decoder.layers.1.ffn_hc."
    assert writer(hc + "alpha_pre") == writer(hc + "alpha_post") != writer(hc + "alpha_res")
    none = _mindspore_slices(folder)  # the alphas, the int32 table, the constants: MindSpore's slicing
    assert not any(n.endswith(("alpha_pre", "alpha_res", "tid2eid", "rms_weight", "tokens_per_expert")) for n in none)
    _loads(folder, full, tiny_data, 1, 0, V4_CASES[case], V4)
    _exports(folder, full, cfg, str(tmp_path / "hf"))  # the MTP modules' weights too


def _refused(data: str, tmp: str, load_path: str, extra=()) -> str:
    """The command line's one error line for ``load_path`` (exit 2, no step run)."""
    items = _overrides(data, ["training.steps=2", "training.global_batch_size=2", "parallelism.data_parallel_shard=1",
                              f"monitor.metrics_dir={os.path.join(tmp, 'metrics')}",
                              f"checkpoint.load_path={load_path}", *extra])
    r = subprocess.run([sys.executable, ENTRY, "--config", TINY, "--mode", "1",
                        *[a for item in items for a in ("--override", item)]],
                       cwd=tmp, capture_output=True, text=True, timeout=900)
    assert r.returncode == 2, r.stdout[-2000:] + r.stderr[-2000:]
    errors = [line for line in r.stderr.splitlines() if "error" in line]
    assert len(errors) == 1 and "Traceback" not in r.stderr and "{ step:" not in r.stdout, r.stderr[-2000:]
    return errors[0]


def test_incomplete_or_foreign_folders_are_one_line(saved, tiny_data, tmp_path):
    import shutil

    folder, _, _, _, _ = saved
    lost = str(tmp_path / mf.folder_name(5))
    shutil.copytree(folder, lost)
    gone = os.path.join(lost, "ds3-model-0000003-0000008.safetensors")
    os.remove(gone)
    line = _refused(tiny_data, str(tmp_path), lost)
    assert f"is stored in '{gone}', which is missing; the checkpoint is incomplete" in line, line
    assert "decoder.layers" in line or "embedding" in line or "output_layer" in line, line
    # another model: the first tensor whose shape differs, by MindFormers' name and the model's
    line = _refused(tiny_data, str(tmp_path), folder, ["model.intermediate_size=128"])
    assert ("'decoder.layers.0.mlp.linear_fc1.weight' (the model's 'model.layers.0.mlp.gate_proj.weight') has "
            "shape [512, 128]" in line and "the model's is [256, 128]; the checkpoint was written for another model"
            in line), line
