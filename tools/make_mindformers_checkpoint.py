"""Generate packages/trainer/tests/fixtures/mindformers_ckpt/ with MindFormers' own
checkpoint code (mindformers.checkpoint.save_checkpoint, as its PyNative CheckpointCallback
calls it), for a tiny mindtrain model.

Two stages, two environments (mindformers is never a package dependency):

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


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] not in ("weights", "mindformers", "check"):
        sys.exit(__doc__)
    {"weights": weights, "mindformers": mindformers, "check": check}[sys.argv[1]](sys.argv[2])
