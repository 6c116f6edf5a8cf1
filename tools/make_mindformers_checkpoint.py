"""Generate packages/trainer/tests/fixtures/mindformers_ckpt/ with MindFormers' own
checkpoint code (mindformers.checkpoint.save_checkpoint, as its PyNative CheckpointCallback
calls it), for a tiny mindtrain model.

Two environments (mindformers is never a package dependency):

1. the weights, from mindtrain (project env):
       hatch run python tools/make_mindformers_checkpoint.py weights /tmp/mf_src
2. the checkpoint, from MindFormers' code (throwaway venv on top of the project env's
   MindSpore; the wheel's own pins, mindspore 2.11 and numpy<2, are not met here but its
   checkpoint module runs):
       pip download mindformers==2.1.0 --no-deps -d /tmp/mfdl
       mkdir /tmp/mfpkg && cd /tmp/mfpkg && unzip -q /tmp/mfdl/mindformers-2.1.0-py3-none-any.whl
       python3 -m venv /tmp/mfvenv   # from the project env's python
       echo <project env site-packages> > /tmp/mfvenv/lib/python3.X/site-packages/zz_env.pth
       echo /tmp/mfpkg > /tmp/mfvenv/lib/python3.X/site-packages/zz_mf.pth
       /tmp/mfvenv/bin/pip install deprecated setproctitle ftfy jieba tiktoken astunparse \
           rouge_chinese datasets sentencepiece mindpet opencv-python-headless
       /tmp/mfvenv/bin/python tools/make_mindformers_checkpoint.py mindformers /tmp/mf_src

3. optional: MindFormers' own load_checkpoint reads a checkpoint mindtrain wrote with
   checkpoint.layout: mindformers (same venv):
       /tmp/mfvenv/bin/python tools/make_mindformers_checkpoint.py check <save_path>

4. optional: MindFormers' own PyNativeDeepseekV3ForCausalLM built for the fixture's tiny
   config, its parameter names and shapes compared with what mindtrain's name map
   (mindtrain.trainer.mindformers_names) writes (same venv; the env's site-packages first so
   MindSpore sees the numpy it was built with):
       PYTHONPATH=<project env site-packages> /tmp/mfvenv/bin/python \
           tools/make_mindformers_checkpoint.py names packages/trainer/tests/fixtures/mindformers_ckpt_model.json
   The model code imports hyper_parallel (MindFormers' DTensor package, not on the package
   index) and, through mindformers/__init__, datasets/pandas/pyarrow (built for numpy 2):
   none of them runs while the model is built on one card, so this stage puts empty stand-in
   modules for them on sys.meta_path. Measured (mindformers 2.1.0): its 47 parameters match
   the map's names and shapes exactly.
5. optional: a checkpoint mindtrain wrote with checkpoint.layout: mindformers (config.json
   beside its files) loaded by MindFormers' load_checkpoint into that model (all parameters
   must equal the file's), then saved by MindFormers' save_checkpoint to
   <save_path>_by_mindformers (same command line as 4):
       ... tools/make_mindformers_checkpoint.py network <save_path>
   packages/trainer/tests/fixtures/mindformers_ds3_ckpt/ is that output for a checkpoint
   mindtrain wrote of the tiny model of mindformers_ckpt_model.json (random weights, no
   optimizer state): MindFormers' own DeepSeek-V3 saved it. Measured: 47 of 47 loaded equal.

Stage 2 saves twice (iterations 1 and 2, keep_max_num=1, user_prefix "tiny") so MindFormers'
own retention and tracker are exercised: the fixture holds iteration_00000002 only. The
model's HF config goes beside it, to mindformers_ckpt_model.json.
"""

import json
import os
import shutil
import sys

import numpy as np

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
OUT = os.path.join(ROOT, "packages", "trainer", "tests", "fixtures", "mindformers_ckpt")
# the smallest DeepSeek-V3 shape mindtrain builds with every part present (MLA, a dense
# layer, a MoE layer with shared and routed experts, one MTP layer)
TINY = ["model.vocab_size=32", "model.hidden_size=16", "model.intermediate_size=32", "model.moe_intermediate_size=8",
        "model.num_hidden_layers=2", "model.num_attention_heads=2", "model.num_key_value_heads=2",
        "model.kv_lora_rank=8", "model.q_lora_rank=8", "model.qk_rope_head_dim=4", "model.qk_nope_head_dim=4",
        "model.v_head_dim=4", "model.n_routed_experts=4", "model.n_group=2", "model.topk_group=1",
        "model.num_experts_per_tok=2", "model.seq_length=8", "train_dataset.dataloader.config.seq_length=8"]


def weights(src: str) -> None:
    """The tiny model's parameters under its own names, AdamW-like moments, config.json."""
    import mindspore as ms

    from mindtrain.config import load_config
    from mindtrain.models import build_model, config_to_hf

    ms.set_device("CPU")
    ms.runtime.launch_blocking()  # eager ops in the calling thread, as the trainer runs them on CPU
    ms.set_seed(0)
    cfg = load_config(os.path.join(ROOT, "configs", "pynative_ds3_tiny.yaml"), TINY)
    model = build_model(cfg.model, jit=False)
    params = {p.name: p.asnumpy() for p in model.get_parameters()}
    rng = np.random.default_rng(0)
    moments = {}
    for name, a in params.items():
        moments[f"adam_m.{name}"] = (rng.standard_normal(a.shape) * 1e-3).astype(np.float32)
        moments[f"adam_v.{name}"] = (rng.random(a.shape) * 1e-6).astype(np.float32)
    from safetensors.numpy import save_file

    os.makedirs(src, exist_ok=True)
    save_file(params, os.path.join(src, "weights.safetensors"))
    save_file(moments, os.path.join(src, "moments.safetensors"))
    with open(os.path.join(src, "config.json"), "w") as f:
        json.dump(config_to_hf(cfg.model), f, indent=1, sort_keys=True)
    print(f"{len(params)} parameters, {sum(a.size for a in params.values())} values -> {src}")


def mindformers(src: str) -> None:
    """MindFormers' save_checkpoint on a Cell holding those parameters (one card)."""
    from mindspore import Parameter, Tensor, nn
    from safetensors.numpy import load_file

    from mindformers.checkpoint.checkpoint import CommonInfo, save_checkpoint
    from mindformers.core.context.build_context import build_context

    # MindFormers' PyNative branch first unwraps DTensor parameters, which needs its companion
    # package hyper_parallel (not on the package index here: ImportError "DTensor is required
    # for PyNative mode"). For one card that unwrap is the only difference between the two
    # branches of save_checkpoint (file names, tracker, common.json, retention are shared), so
    # the Graph-mode branch writes the same files from these plain Parameters.
    build_context({"context": {"mode": "GRAPH_MODE", "device_target": "CPU"}, "parallel": {}})

    class Holder(nn.Cell):
        def __init__(self, arrays):
            super().__init__(auto_prefix=False)
            for i, (name, a) in enumerate(sorted(arrays.items())):
                setattr(self, f"p{i}", Parameter(Tensor(a), name=name))

    params = load_file(os.path.join(src, "weights.safetensors"))
    moments = load_file(os.path.join(src, "moments.safetensors"))
    network = Holder(params)
    optimizer = Holder({**moments, "global_step": np.array([2], np.int64)})
    tmp = OUT + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    steps = []
    for iteration in (1, 2):
        common = CommonInfo(epoch_num=1, step_num=10, global_step=iteration, loss_scale=1.0,
                            global_batch_size=4, consumed_samples=4 * iteration)
        save_checkpoint(iteration=iteration, network=network, optimizer=optimizer, common_info=common,
                        keep_max_num=1, user_prefix="tiny", save_checkpoint_path=tmp,
                        current_ckpt_step_list=steps)
    # the model's HF config beside MindFormers' output (untouched), for the test to build the model
    shutil.copy(os.path.join(src, "config.json"), OUT + "_model.json")
    shutil.rmtree(OUT, ignore_errors=True)
    os.replace(tmp, OUT)
    for d, _, files in sorted(os.walk(OUT)):
        for f in sorted(files):
            print(os.path.relpath(os.path.join(d, f), OUT), os.path.getsize(os.path.join(d, f)))


def check(save_path: str) -> None:
    """MindFormers' own load_checkpoint on a checkpoint mindtrain wrote with
    checkpoint.layout: mindformers (tracker, metadata.json, model and optimizer files): it
    must put every tensor, moments and global_step into Cells holding those names."""
    from mindspore import Parameter, Tensor, nn
    from safetensors.numpy import load_file

    from mindformers.checkpoint.checkpoint import get_checkpoint_path, load_checkpoint
    from mindformers.core.context.build_context import build_context

    build_context({"context": {"mode": "GRAPH_MODE", "device_target": "CPU"}, "parallel": {}})
    folder = get_checkpoint_path(save_path)  # MindFormers' tracker resolution
    files = {kind: [f for f in os.listdir(folder) if f"-{kind}-" in f] for kind in ("model", "opt")}
    want = {kind: {k: v for f in fs for k, v in load_file(os.path.join(folder, f)).items()}
            for kind, fs in files.items()}

    class Holder(nn.Cell):
        def __init__(self, arrays):
            super().__init__(auto_prefix=False)
            for i, (name, a) in enumerate(sorted(arrays.items())):
                setattr(self, f"p{i}", Parameter(Tensor(np.zeros_like(a)), name=name))

    network, optimizer = Holder(want["model"]), Holder(want["opt"])
    load_checkpoint(checkpoint=save_path, network=network, optimizer=optimizer)
    bad = [p.name for cell, kind in ((network, "model"), (optimizer, "opt")) for p in cell.get_parameters()
           if not np.array_equal(p.asnumpy(), want[kind][p.name])]
    print(f"MindFormers loaded {folder}: {len(want['model'])} model and {len(want['opt'])} optimizer tensors, "
          f"{len(bad)} differ {bad[:3]}")
    sys.exit(1 if bad else 0)


class _StandIns:
    """Empty modules for packages MindFormers imports but never runs while building a model
    on one card: every attribute is a fresh class (so isinstance(x, DTensor) is False)."""

    NAMES = ("hyper_parallel", "datasets", "pandas", "pyarrow")

    def find_spec(self, name, path, target=None):
        import importlib.machinery

        if name.split(".")[0] in self.NAMES:
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        import types

        module = types.ModuleType(spec.name)
        module.__path__ = []
        made = {}

        def attribute(attr):
            if attr.startswith("__"):
                raise AttributeError(attr)
            return made.setdefault(attr, type(attr, (), {"__init__": lambda self, *a, **k: None}))

        module.__getattr__ = attribute
        return module

    def exec_module(self, module):
        pass


def _mindformers_model(hf_config_path: str):
    """MindFormers' own PyNativeDeepseekV3ForCausalLM for an HF config.json (one card, fp32)."""
    sys.meta_path.insert(0, _StandIns())
    # the venv sees the env's site-packages but not its editable installs of mindtrain
    sys.path[:0] = [os.path.join(ROOT, "packages", p, "src") for p in ("config", "models", "trainer")]
    import mindspore as ms

    from mindformers.generation.text_generator import GenerationMixin
    from mindformers.models.deepseek3.configuration_deepseek_v3 import DeepseekV3Config
    from mindformers.models.deepseek3.modeling_deepseek_v3_pynative import PyNativeDeepseekV3ForCausalLM

    ms.set_context(mode=ms.PYNATIVE_MODE, device_target="CPU")
    with open(hf_config_path, encoding="utf-8") as f:
        hf = json.load(f)
    keys = ["vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers",
            "num_attention_heads", "num_key_value_heads", "n_shared_experts", "n_routed_experts", "kv_lora_rank",
            "q_lora_rank", "qk_rope_head_dim", "v_head_dim", "qk_nope_head_dim", "n_group", "topk_group",
            "num_experts_per_tok", "first_k_dense_replace", "norm_topk_prob", "max_position_embeddings",
            "rms_norm_eps", "rope_theta", "routed_scaling_factor"]
    # qk_layernorm and moe_grouped_gemm as MindFormers' shipped deepseek3 yamls set them (the
    # PyNative MoE spec refuses moe_grouped_gemm False)
    cfg = DeepseekV3Config(**{k: hf[k] for k in keys}, seq_length=hf["seq_length"], compute_dtype="fp32",
                           params_dtype="fp32", mtp_num_layers=hf["num_nextn_predict_layers"],
                           moe_grouped_gemm=True, qk_layernorm=True)
    # GenerationMixin.__init__ makes a bf16 tensor through numpy, which this mixed environment
    # cannot; it holds no parameters
    GenerationMixin.__init__ = lambda self: None
    return PyNativeDeepseekV3ForCausalLM(cfg), hf


def names(hf_config_path: str) -> None:
    """MindFormers' PyNative DeepSeek-V3 for an HF config: its parameter names and shapes
    against those mindtrain's name map gives the same model's parameters."""
    network, hf = _mindformers_model(hf_config_path)
    from mindtrain.models import build_model, config_from_hf
    from mindtrain.trainer import mindformers_names

    theirs = {p.name: tuple(p.shape) for p in network.get_parameters()}
    ours_model = build_model(config_from_hf(hf), jit=False)
    ours = {n: tuple(a.shape) for n, a in mindformers_names.to_mindformers(
        {p.name: p.asnumpy() for p in ours_model.get_parameters()}, ours_model.config, buffers=True).items()}
    for n in sorted(theirs):
        print(f"{n} {theirs[n]}{'' if ours.get(n) == theirs[n] else f'  mindtrain: {ours.get(n)}'}")
    extra = sorted(set(ours) - set(theirs))
    print(f"MindFormers: {len(theirs)} parameters; mindtrain's map: {len(ours)}; "
          f"differ: {sum(ours.get(n) != s for n, s in theirs.items())}, only in mindtrain's map: {extra}")
    sys.exit(1 if extra or any(ours.get(n) != s for n, s in theirs.items()) else 0)


def network(save_path: str) -> None:
    """A checkpoint mindtrain wrote with checkpoint.layout: mindformers, loaded by MindFormers'
    load_checkpoint into MindFormers' own DeepSeek-V3 network (every parameter must equal the
    file's), then saved by MindFormers' save_checkpoint to <save_path>_by_mindformers for
    mindtrain to read back (mindformers_checkpoint.read_checkpoint + network_tensors)."""
    sys.meta_path.insert(0, _StandIns())
    from mindformers.checkpoint.checkpoint import get_checkpoint_path

    folder = get_checkpoint_path(save_path)
    model, _ = _mindformers_model(os.path.join(folder, "config.json"))
    import mindspore as ms
    from safetensors.numpy import load_file

    from mindformers.checkpoint.checkpoint import CommonInfo, load_checkpoint, save_checkpoint

    for p in model.get_parameters():
        p.set_data(ms.Tensor(np.zeros(p.shape, np.float32)))
    load_checkpoint(checkpoint=save_path, network=model, optimizer=None)
    want = {k: v for f in os.listdir(folder) if "-model-" in f or f.startswith("model-")
            for k, v in load_file(os.path.join(folder, f)).items()}
    bad = [p.name for p in model.get_parameters() if not np.array_equal(p.asnumpy(), want[p.name])]
    out = save_path.rstrip("/") + "_by_mindformers"
    shutil.rmtree(out, ignore_errors=True)
    with open(os.path.join(folder, "common.json"), encoding="utf-8") as f:
        common = json.load(f)
    ms.set_context(mode=ms.GRAPH_MODE)  # the save branch that needs no hyper_parallel DTensor (see above)
    save_checkpoint(iteration=common["global_step"], network=model, optimizer=None,
                    common_info=CommonInfo(epoch_num=1, step_num=common["step_num"], global_step=common["global_step"],
                                           loss_scale=1.0, global_batch_size=common["global_batch_size"],
                                           consumed_samples=common["consumed_samples"]),
                    keep_max_num=1, user_prefix="mf", save_checkpoint_path=out, current_ckpt_step_list=[])
    print(f"MindFormers' DeepSeek-V3 loaded {folder}: {len(list(model.get_parameters()))} parameters, "
          f"{len(bad)} differ {bad[:3]}; saved by MindFormers to {out}")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    stages = {"weights": weights, "mindformers": mindformers, "check": check, "names": names, "network": network}
    if len(sys.argv) != 3 or sys.argv[1] not in stages:
        sys.exit(__doc__)
    stages[sys.argv[1]](sys.argv[2])
