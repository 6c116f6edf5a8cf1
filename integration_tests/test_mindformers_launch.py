"""A MindFormers user's config and launch line, unchanged but for data path and sizes.

Real files only (``configs/mindformers_ds3_tiny.yaml``, our file in MindFormers' names, is
loaded by mindtrain-config's tests and by the README's commands, not here): MindFormers'
own ``configs/deepseek3/pretrain_deepseek3_1b_8p_pynative.yaml`` as published (commit
27f7683, in packages/config/tests/fixtures/mindformers: no dataset seed, ``params_dtype:
bfloat16``); and MindFormers' PyNative template ``train_config.yaml`` (Qwen3, commit 167a50d,
``tests/st/test_ut/test_pynative/test_config/train_config.yaml``), with its placeholder
callbacks removed, ``device_target`` set to CPU and the quick start's dataset block added
(the template has none: MindFormers' loader needs ``datasets_type``, ``sizes`` and ``config``).
A copy of each with only the data path, the sizes and the step count changed
trains under msrun with 2 workers, launched with the real ``run_mindformer.py`` flags
``--run_mode train --use_parallel True --output_dir D``. Every worker's log shows the step
lines; start-up notes come once, from rank 0.

A fourth: MindFormers' DeepSeek-V4 system-test config ``pynative_deepseek4.yaml`` as published
(commit 167a50d, in the same fixtures folder: V4 with ``experimental_attention_variant: mla``,
hyper-connections, hash routing, MTP, Muon with QK-clip, selective recompute in MindFormers'
module names, a MindDataset loader), with the data (MindRecord files of the same corpus), the
sizes, the batch sizes (global 4, the ramp ``[2, 2, 8]``: 2 in the 4 steps), the recompute layer ranges (cut to
the 4 layers there are) and the parallel degrees changed to fit 2 workers: its
``data_parallel_shard: 2`` (with the default FSDP strategy, ZeRO-3: the MTP module is a unit)
and ``expert_parallel: 2`` stay; tensor and pipeline parallelism (2 each, with 2-way
interleaving) are set to 1 (the V4 layout parity test runs those).
"""

from __future__ import annotations

import math
import os
import re
import subprocess

import numpy as np
import pytest
import yaml

from mindtrain.trainer.quickstart import free_port, prepare_data, worker_env

pytestmark = pytest.mark.msrun

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
ENTRY = os.path.join(ROOT, "run_mindformer.py")
CONFIGS = {
    # MindFormers' file as published; its model shrunk to CPU test size
    "published": (os.path.join(ROOT, "packages", "config", "tests", "fixtures", "mindformers",
                               "pretrain_deepseek3_1b_8p_pynative.yaml"),
                  {"vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                   "num_attention_heads": 2, "kv_lora_rank": 16, "q_lora_rank": 32, "qk_rope_head_dim": 8,
                   "v_head_dim": 16, "qk_nope_head_dim": 16, "moe_intermediate_size": 32,
                   "moe_shared_expert_intermediate_size": 32}),
    # MindFormers' DeepSeek-V4 system-test file as published; its model shrunk to CPU test size
    "published-v4": (os.path.join(ROOT, "packages", "config", "tests", "fixtures", "mindformers",
                                  "pynative_deepseek4.yaml"),
                     {"vocab_size": 512, "hidden_size": 64, "num_hidden_layers": 3, "num_attention_heads": 2,
                      "kv_lora_rank": 16, "q_lora_rank": 32, "qk_rope_head_dim": 8, "v_head_dim": 16,
                      "qk_nope_head_dim": 16, "moe_intermediate_size": 32, "moe_shared_expert_intermediate_size": 32,
                      "n_routed_experts": 8, "seq_length": 32}),
    # MindFormers' PyNative template (Qwen3, dense); its model shrunk to CPU test size
    "template": (os.path.join(ROOT, "packages", "config", "tests", "fixtures", "mindformers",
                              "train_config.yaml"),
                 {"vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                  "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16}),
}
# the quick start's dataset block, for a file that has none (the template)
QUICKSTART_LOADER = {"datasets_type": "GPTDataset",
                     "config": {"seq_length": 64, "split": "1, 0, 0", "eod": 1, "pad": -1,
                                "create_attention_mask": False, "create_compressed_eod_mask": False}}
STEPS = 4
MOE_FIELDS = r"load_balancing_loss: +\d+\.\d{6}, mtp_1_loss: +\d+\.\d{6}, "


def step_line(name):
    """The seed's step line; a dense Qwen3 has no balance or MTP loss to print."""
    extra = "" if name == "template" else MOE_FIELDS
    return re.compile(rf"^\{{ step:\[ {{0,4}}(\d+)/ {{0,4}}{STEPS}\], loss: +(\d+\.\d{{6}}), per_step_time: +\d+ms, "
                      + extra + r"lr: \d\.\d{6}e[-+]\d\d, grad_norm: +(\d+\.\d{6}), throughput: +\d+\.\d+T \}$")


def mindrecords(prefix: str, folder: str, seq: int, count: int) -> str:
    """``count`` samples of the corpus (the Megatron loader's) as MindRecord files with the
    published file's four columns; returns the folder."""
    from mindspore.mindrecord import FileWriter

    from mindtrain.config import load_config
    from mindtrain.data import build_dataset

    cfg = load_config(os.path.join(ROOT, "configs", "pynative_ds3_tiny.yaml"),
                      [f"model.seq_length={seq}", f"train_dataset.dataloader.config.seq_length={seq}",
                       f"train_dataset.dataloader.config.data_path=['1', '{prefix}']",
                       f"train_dataset.dataloader.sizes=[{count}, 0, 0]"])
    gpt = build_dataset(cfg.train_dataset)
    os.makedirs(folder)
    writer = FileWriter(os.path.join(folder, "train.mindrecord"), shard_num=1, overwrite=True)
    writer.add_schema({c: {"type": "int32" if c != "loss_mask" else "float32", "shape": [-1]}
                       for c in ("input_ids", "labels", "loss_mask", "position_ids")}, "pretrain")
    rows = [gpt[i] for i in range(count)]
    writer.write_raw_data([{c: np.asarray(r[c]).astype(np.float32 if c == "loss_mask" else np.int32)
                            for c in ("input_ids", "labels", "loss_mask", "position_ids")} for r in rows])
    writer.commit()
    return folder


def published_v4(raw: dict, prefix: str, tmp: str) -> None:
    """The V4 file's data, batch sizes, recompute layer ranges and parallel degrees (see the module doc)."""
    raw["train_dataset"]["dataloader"]["dataset_files"] = mindrecords(prefix, os.path.join(tmp, "records"), 32, 32)
    raw["training"]["global_batch_size"] = 4
    raw["training"]["rampup_batch_size"] = [2, 2, 8]  # 2 for the 4 steps (8 samples), then 4
    raw["recompute"]["select_module"] = {"layers.*.self_attention.*": ["0-3"], "layers.*.mlp.*": ["0-2"]}
    raw["parallelism"].update(tensor_parallel=1, pipeline_parallel=1, pipeline_parallel_interleave_num=1)


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def run(request, tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("mf"))
    prefix = prepare_data(os.path.join(tmp, "data", "pydoc"))
    path, sizes = CONFIGS[request.param]
    with open(path, encoding="utf-8") as f:
        raw = yaml.safe_load(f)
    if request.param == "published-v4":
        published_v4(raw, prefix, tmp)
    if request.param == "template":
        raw.pop("callbacks")  # placeholders (callbackA / callbackB)
        raw["context"]["device_target"] = "CPU"
        raw["train_dataset"]["dataloader"].update(QUICKSTART_LOADER)
    # only the data path and the sizes change
    if request.param != "published-v4":
        raw["train_dataset"]["dataloader"]["config"]["data_path"] = ["1", prefix]
        raw["train_dataset"]["dataloader"]["config"]["seq_length"] = 64
        raw["train_dataset"]["dataloader"]["sizes"] = [200, 0, 0]
    raw["model"]["seq_length"] = 64
    raw["model"].update(sizes)
    raw["training"]["steps"] = STEPS
    if request.param == "published":  # the template's batch (2 per rank, 4 in all) fits 2 workers
        raw["training"]["global_batch_size"] = 2
    config = os.path.join(tmp, "my_ds3.yaml")
    with open(config, "w", encoding="utf-8") as f:
        yaml.safe_dump(raw, f, sort_keys=False)
    out = os.path.join(tmp, "out")
    log_dir = os.path.join(tmp, "log")
    cmd = ["msrun", "--worker_num=2", "--local_worker_num=2", f"--master_port={free_port(int(os.environ.get('MINDTRAIN_TEST_PORT', 8550)))}", "--join=True",
           f"--log_dir={log_dir}", ENTRY, "--config", config, "--mode", "1", "--run_mode", "train",
           "--use_parallel", "True", "--output_dir", out]
    r = subprocess.run(cmd, cwd=tmp, env=worker_env(), capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    logs = {}
    for rank in (0, 1):
        with open(os.path.join(log_dir, f"worker_{rank}.log"), encoding="utf-8", errors="replace") as f:
            logs[rank] = f.read().splitlines()
    return request.param, logs


def test_every_worker_prints_the_seed_format_steps(run):
    STEP = step_line(run[0])
    for rank, lines in run[1].items():
        steps = [STEP.match(line) for line in lines if line.startswith("{ step:")]
        assert len(steps) == STEPS and all(steps), (rank, lines[-20:])
        assert [int(m.group(1)) for m in steps] == list(range(1, STEPS + 1))
        assert all(math.isfinite(float(m.group(2))) and math.isfinite(float(m.group(3))) for m in steps)


def test_startup_notes_once_from_rank_zero(run):
    name, logs = run
    # every file's context has a field without effect on CPU; the note comes once, from rank 0
    field = "max_device_memory" if name == "template" else "use_flash_attention"
    notes = [line for line in logs[0] if line.startswith("mindtrain: ") and field in line]
    assert len(notes) == 1, logs[0][:40]
    assert not [line for line in logs[1] if line.startswith("mindtrain: ") and field in line]
    # the config's recompute section acts (#16): no start-up note about it
    assert not [line for line in logs[0] if line.startswith("mindtrain: ") and "recompute" in line]
    # params_dtype: bfloat16 (the published file) is float32 on CPU, said once
    dtype = [line for line in logs[0] if line.startswith("mindtrain: model.param_init_dtype=bfloat16")]
    assert len(dtype) == name.startswith("published"), logs[0][:40]
