"""The trainer under every parallel layout equals the single-process run.

``run_mindformer.py`` trains the tiny DeepSeek-V3 (two decoder layers, dense and MoE, and
its MoE MTP module) for 5 steps of the same global batch (4 sequences of 32 tokens, AdamW,
clipping, the aux-loss-free bias update) as one process (compiled layers, 4 accumulation
micro-batches) and under msrun as FSDP ZeRO-3 (2 workers, eager, gathered per decoder
layer), TP=2 with sequence parallelism, EP=2 over the two data-parallel ranks, and PP=2 x
CP=2 x EP=2 on 4 workers (EP over the context-parallel ranks). Each run's per-step loss
figures and grad norm (from its metrics file) and its final checkpoint (full weights with HF
names and full AdamW moments) must equal the single process within 1e-5 relative; ZeRO-3
must hold half the parameter and optimizer bytes per rank. A single process then resumes
from the ZeRO-3 run's step-4 checkpoint (sharded state saved at full shape, in MindFormers'
layout: checkpoint.layout=mindformers) and must reproduce step 5. The other combinations are proven against the model itself in
test_cp_pp_parity.py and test_tp_ep_parity.py.
"""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from mindtrain.trainer.quickstart import free_port, worker_env

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
ENTRY = os.path.join(ROOT, "run_mindformer.py")
TINY = os.path.join(ROOT, "configs", "pynative_ds3_tiny.yaml")
STEPS = 5
FIGURES = ("loss", "load_balancing_loss", "mtp_loss", "grad_norm")
LAYOUTS = {  # name: (workers, overrides)
    # MindFormers' checkpoint layout (iteration_NNNNNNNN/, ds3-model/-opt files)
    "zero3": (2, ["parallelism.data_parallel_shard_strategy=optim_grads_params",
                  "checkpoint.layout=mindformers", "checkpoint.prefix=ds3"]),
    "tp2": (2, ["parallelism.tensor_parallel=2"]),
    "ep2": (2, ["parallelism.expert_parallel=2"]),
    # PP=2 x CP=2 x EP=2 (EP over the two context-parallel ranks), compiled layers off
    "pp2_cp2_ep2": (4, ["parallelism.pipeline_parallel=2", "parallelism.context_parallel=2",
                        "parallelism.expert_parallel=2"]),
}


def _args(tmp: str, name: str, extra=()) -> list[str]:
    prefix = os.path.join(tmp, "data", "pydoc_text_document")
    # two decoder layers (the dense one and a MoE one) and the MoE MTP module: every kind of block
    items = [f"training.steps={STEPS}", "training.global_batch_size=4", "model.seq_length=32",
             "train_dataset.dataloader.config.seq_length=32", "model.num_hidden_layers=2",
             f"train_dataset.dataloader.config.data_path=['1', '{prefix}']",
             "checkpoint.enable_save=true", f"checkpoint.save_interleaved_steps={STEPS - 1}",
             f"checkpoint.save_path={os.path.join(tmp, name, 'ckpt')}",
             f"monitor.metrics_dir={os.path.join(tmp, name, 'metrics')}", *extra]
    return ["--config", TINY, "--mode", "1"] + [a for item in items for a in ("--override", item)]


def _run(tmp: str, name: str, workers: int, extra=()) -> dict:
    if workers == 1:
        cmd = [sys.executable, ENTRY, *_args(tmp, name, extra)]
    else:
        cmd = ["msrun", f"--worker_num={workers}", f"--local_worker_num={workers}", f"--master_port={free_port(8340)}",
               "--join=True", f"--log_dir={os.path.join(tmp, name, 'log')}", ENTRY, *_args(tmp, name, extra)]
    r = subprocess.run(cmd, cwd=tmp, env=worker_env(), capture_output=True, text=True, timeout=1500)
    logs = "".join(open(f, errors="replace").read()[-3000:] for f in glob.glob(os.path.join(tmp, name, "log", "*.log")))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:] + logs
    (metrics,) = glob.glob(os.path.join(tmp, name, "metrics", "run_*", "metrics.jsonl"))
    rows = [json.loads(line) for line in open(metrics)]
    return {"steps": [r["step"] for r in rows], "figures": np.array([[r[k] for k in FIGURES] for r in rows]),
            "ckpt": os.path.join(tmp, name, "ckpt"), "rows": rows}


def _weights(ckpt: str, step: int, name: str = "model.safetensors") -> dict:
    from safetensors.numpy import load_file

    folder = os.path.join(ckpt, f"iter_{step:07d}")
    if os.path.isdir(folder):
        return load_file(os.path.join(folder, name))
    return _from_mindformers_layout(os.path.join(ckpt, f"iteration_{step:08d}"), name)


def _from_mindformers_layout(folder: str, name: str) -> dict:
    """A checkpoint.layout=mindformers folder, tensors named as mindtrain's files name them."""
    from mindtrain.models import config_from_hf, hf_state_dict
    from mindtrain.trainer import mindformers_checkpoint as mf

    model, opt, _ = mf.read_checkpoint(folder)
    if name == "optimizer.safetensors":  # adam_m./adam_v./global_step -> exp_avg./exp_avg_sq./step
        out = {"step": opt.pop("global_step").reshape(())}
        out.update({f"{mf.MOMENTS[k.split('.', 1)[0]]}.{k.split('.', 1)[1]}": v for k, v in opt.items()})
        return out

    class Param:
        def __init__(self, n, a):
            self.name, self._a = n, a

        def asnumpy(self):
            return self._a

    class View:  # what hf_state_dict reads of a model: its config and named parameters
        config = config_from_hf(json.load(open(os.path.join(folder, "config.json"))))

        def get_parameters(self):
            return iter(Param(n, a) for n, a in model.items())

    return hf_state_dict(View())


def _rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(float(np.linalg.norm(b)), 1e-30))


def _assert_same(run: dict, ref: dict, first_step: int = 1) -> None:
    assert run["steps"] == list(range(first_step, STEPS + 1))
    want = ref["figures"][first_step - 1:]
    err = np.abs(run["figures"] - want) / np.maximum(np.abs(want), 1e-30)
    assert err.max() < 1e-5, (run["figures"], want)
    for name in ("model.safetensors", "optimizer.safetensors"):  # weights and AdamW moments, full shape
        got, exp = _weights(run["ckpt"], STEPS, name), _weights(ref["ckpt"], STEPS, name)
        assert sorted(got) == sorted(exp)
        worst = max((_rel(got[n], exp[n]), n) for n in exp)
        assert worst[0] < 1e-5, (name, worst)


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    from mindtrain.trainer.quickstart import prepare_data

    tmp = str(tmp_path_factory.mktemp("layouts"))
    prepare_data(os.path.join(tmp, "data", "pydoc"))
    return tmp


@pytest.fixture(scope="module")
def reference(work):
    return _run(work, "ref", 1)


@pytest.fixture(scope="module")
def zero3(work):
    return _run(work, "zero3", *LAYOUTS["zero3"])


def test_fsdp_zero3_equals_one_process(reference, zero3):
    _assert_same(zero3, reference)
    # rank 0 holds half the parameters and half the AdamW moments (dim-0 shards, padded)
    for key in ("param_bytes", "optimizer_bytes"):
        ratio = zero3["rows"][-1][key] / reference["rows"][-1][key]
        assert 0.45 < ratio < 0.55, (key, ratio)


@pytest.mark.parametrize("layout", ["tp2", "ep2", "pp2_cp2_ep2"])
def test_layout_equals_one_process(work, reference, layout):
    _assert_same(_run(work, layout, *LAYOUTS[layout]), reference)


def test_one_process_resumes_a_sharded_checkpoint(work, reference, zero3):
    folder = os.path.join(zero3["ckpt"], f"iteration_{STEPS - 1:08d}")
    resumed = _run(work, "resume", 1, [f"checkpoint.load_path={folder}"])
    _assert_same(resumed, reference, first_step=STEPS)
