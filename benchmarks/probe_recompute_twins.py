"""Probe (issue 16): compiled layers with recompute keep one graph workspace per layer; run
every layer through a compiled twin per kind of layer and the memory goes.

    hatch run python benchmarks/probe_recompute_twins.py MODE SEQ     # MODE: off | full | twins

One compiled training step of bench_memory.py's model (hidden 256, 4 layers, 8 experts,
batch 1); prints the peak RSS above the baseline and the step times. ``off``: plain
compiled model. ``full``: full recompute (mindtrain's Recompute around each compiled
layer). ``twins``: every decoder layer and the MTP module a ZeRO-3 unit of FSDP over a
1-rank group: each unit recomputes its forward in backward (what full recompute does), and
all units of a kind run in one compiled twin (mindtrain.parallel.fsdp), so 2 graphs hold
workspaces instead of 5.

Measured (2026-12-02, 2 cores, nothing else running), peak RSS above baseline, second step:
seq 2048: off 4,081 MB, 2.87 s; full 3,561 MB (0.87x), 2.99 s; twins 2,360 MB (0.58x),
3.19 s (1.11x); the same loss 8.374350. seq 4096: twins 8,379 MB, 9.30 s, loss 8.363642,
against bench_memory's compiled off 13,516 MB and compiled full 11,849 MB (0.62x and 0.71x
of them). The route for compiled full recompute; not wired into the trainer yet.
"""
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import numpy as np
import mindspore as ms
from mindspore import Tensor
from bench_memory import SIZES, _rss_mb, _current_rss_mb
ms.set_device("CPU"); ms.runtime.launch_blocking(); ms.set_seed(0)
import mindtrain.models as mm
from mindtrain.config import ModelConfig
from mindtrain.config.schema import RecomputeConfig
from mindtrain.parallel import Group, fully_shard
mode, seq = sys.argv[1], int(sys.argv[2])
cfg = ModelConfig(**SIZES, seq_length=seq, max_position_embeddings=max(seq, 4096))
rc = RecomputeConfig(mode="full") if mode == "full" else None
model = mm.build_model(cfg, jit=True, recompute=rc)
rng = np.random.default_rng(0)
ids = Tensor(rng.integers(0, cfg.vocab_size, (1, seq)).astype(np.int32))
labels = Tensor(rng.integers(0, cfg.vocab_size, (1, seq)).astype(np.int32))
mask = Tensor(np.ones((1, seq), np.float32))


def fn():
    return model(ids, labels=labels, loss_mask=mask)[0]


if mode == "twins":
    plan = mm.parallel_plan(model)
    units = [u.path for u in plan.units if u.kind in ("decoder", "mtp")]
    shared = {n: [] for n, p in plan.params.items() if p.applied_outside and p.trainable}
    fs = fully_shard(model, Group("dp", (0,), 0), units=units, strategy="optim_grads_params", shared=shared)
    step = fs.value_and_grad(fn)
    print("twins", len(fs.twins))
else:
    g = ms.value_and_grad(fn, None, model.trainable_params())
    step = lambda: g()[0]
base = _current_rss_mb()
ts, losses = [], []
for _ in range(2):
    t = time.perf_counter(); loss = step(); losses.append(float(loss.asnumpy())); ts.append(time.perf_counter() - t)
print("RESULT", json.dumps({"mode": mode, "seq": seq, "peak_above": round(_rss_mb() - base), "step_s": [round(x, 2) for x in ts], "loss": losses[0]}))
