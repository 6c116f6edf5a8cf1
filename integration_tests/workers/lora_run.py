"""LoRA (lora_config) on the tiny DeepSeek-V3: ``python lora_run.py OUT DATA_PREFIX CASE[,CASE...]``,
under msrun (cases ``zero3``: FSDP ZeRO-3 over 2 ranks, ``tp2``: tensor + sequence parallel
over 2 ranks, ``pp2``: two pipeline stages, ``cp2``: context parallelism (colossal), ``zero3_muon``:
ZeRO-3 with Muon on the adapters, ``v4_zero3``: the tiny DeepSeek-V4 under ZeRO-3, one after the
other in the same job) or as a plain process (``ref``, ``ref_muon``, ``v4_ref``).

Per case, each rank trains STEPS steps with the trainer (saving at step 2 and at the end),
checks on its own pieces that every base weight is bit-identical and only adapters moved,
that the optimizer holds the adapters' moments only, then resumes from step 2 in a new
Trainer and checks that step 3 and the final pieces are the same to the bit (``ref`` skips
the resume). The adapters have ``lora_dropout: 0.1``: they run unmerged in the steps, on masks
that do not depend on the layout. Each rank writes
``OUT/<case>.<rank>.json``: the per-step figures and the seconds the case took.
"""

from __future__ import annotations

import json
import os
import sys
import time

import numpy as np

from mindtrain.config import load_config
from mindtrain.trainer.runtime import start
from mindtrain.trainer.trainer import Trainer

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = os.path.join(ROOT, "configs", "pynative_ds3_tiny.yaml")
TINY_V4 = os.path.join(ROOT, "configs", "pynative_ds4_tiny.yaml")
STEPS = 3
# every Linear of the decoder layers and of the MTP module (its eh_proj too), and the head
LORA = ("lora_config={target_modules: 'linear_(qkv|qb|kvb|proj|fc1|fc2)|eh_proj|output_layer', lora_b_std: 0.01, "
        "lora_dropout: 0.1}")  # unmerged adapters in the steps, masks the same in every layout
# DeepSeek-V4 (cases v4_*): 2 layers (sliding, compressed sparse) and an MTP module; every Linear
# (attention, compressors, indexer, shared experts, eh_proj) and the head
V4 = ["model.compress_ratios=[0, 4]", "model.num_nextn_predict_layers=1",
      "lora_config={target_modules: 'linear_|eh_proj|output_layer', lora_b_std: 0.01, lora_dropout: 0.1}"]
LAYOUTS = {"ref": [], "zero3": ["parallelism.data_parallel_shard_strategy=optim_grads_params"],
           "tp2": ["parallelism.tensor_parallel=2"], "pp2": ["parallelism.pipeline_parallel=2"],
           "cp2": ["parallelism.context_parallel=2"],
           # Muon on the adapters (MindFormers' optimizer sees only them): whole matrices gathered
           # from their ZeRO-3 shards for Newton-Schulz, against one process's Muon
           "ref_muon": ["optimizer.type=Muon"],
           "zero3_muon": ["parallelism.data_parallel_shard_strategy=optim_grads_params", "optimizer.type=Muon"],
           "v4_ref": V4, "v4_zero3": V4 + ["parallelism.data_parallel_shard_strategy=optim_grads_params"]}


def config(out: str, prefix: str, case: str, *extra):
    return load_config(TINY_V4 if case.startswith("v4") else TINY, [
        "model.seq_length=32", "train_dataset.dataloader.config.seq_length=32", "model.num_hidden_layers=2",
        f"training.steps={STEPS}", "training.global_batch_size=2", "compile.enable=false",
        f"train_dataset.dataloader.config.data_path=['1', '{prefix}']", LORA,
        f"monitor.metrics_dir={out}/{case}/metrics", "checkpoint.enable_save=true",
        f"checkpoint.save_path={out}/{case}/ck", "checkpoint.save_interval=2", *LAYOUTS[case], *extra])


def run(out: str, prefix: str, case: str, rt) -> dict:
    began = time.perf_counter()
    trainer = Trainer(config(out, prefix, case), rt, out=lambda _line: None)
    before = {n: p.asnumpy().copy() for n, p in trainer.params}
    history = trainer.train()
    after = {n: p.asnumpy().copy() for n, p in trainer.params}
    adapters = {n for n in before if n.endswith((".lora_a", ".lora_b"))}
    changed = {n for n in before if not np.array_equal(before[n], after[n])}
    assert changed <= adapters, sorted(changed - adapters)[:3]  # the frozen base: bit-identical pieces
    assert changed, "no adapter moved"
    moments = {n for kind, idx, _ in trainer.optimizer.moment_sets() for n in (trainer.params[i][0] for i in idx)}
    assert moments == adapters, sorted(moments ^ adapters)[:3]
    dropped = sum(1 for c in _cells(trainer.model) if getattr(c, "lora_dropout", 0) == 0.1 and c.lora_b.name in before)
    # every adapted layer drops its adapter input (each holds a lora_b; a fused layer's parts share a lora_a)
    assert dropped == sum(n.endswith(".lora_b") for n in adapters), (dropped, len(adapters))
    if case.startswith("ref"):  # the one-process resume is test_lora.py's
        return result(history, adapters, changed, began)
    resumed = Trainer(config(out, prefix, case, f"checkpoint.load_path={out}/{case}/ck/iter_0000002",
                             "checkpoint.enable_save=false"), rt, out=lambda _line: None)
    again = resumed.train()
    assert [r["step"] for r in again] == [STEPS]
    for key in ("loss", "grad_norm", "load_balancing_loss", "mtp_loss"):
        assert again[0][key] == history[-1][key], (key, again[0][key], history[-1][key])
    for n, p in resumed.params:
        assert np.array_equal(p.asnumpy(), after[n]), n
    return result(history, adapters, changed, began)


def _cells(cell):
    """Every cell of ``cell``, into ZeRO-3's units (their layer is held aside)."""
    for _, c in cell.cells_and_names():
        yield c
        inner = c.__dict__.get("_ctx")
        if inner is not None:
            yield from _cells(inner[2])


def result(history, adapters, changed, began) -> dict:
    return {"rows": [{k: r[k] for k in ("step", "loss", "grad_norm", "mtp_loss", "load_balancing_loss")}
                     for r in history],
            "adapters": len(adapters), "changed": len(changed), "seconds": time.perf_counter() - began}


def main() -> int:
    out, prefix, cases = sys.argv[1], sys.argv[2], sys.argv[3].split(",")
    rt, _ = start("CPU")
    for case in cases:
        result = run(out, prefix, case, rt)
        with open(os.path.join(out, f"{case}.{rt.rank}.json"), "w") as f:
            json.dump(result, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
