"""Probe (issue 33): the clipped AdamW update three ways, on a model's parameter shapes, taking
turns in one process.

    hatch run python benchmarks/probe_one_pass_update.py [--steps 30] [--config configs/pynative_ds3_tiny.yaml | --bench]

- ``per-param``: the trainer's update before mindtrain-trainer 0.14: a pass multiplying each
  gradient by the clipping coefficient, then ``ops.AdamWeightDecay`` per parameter;
- ``one-pass``: the trainer's AdamW now (``AdamW.step(grads, grad_scale=coef)``): one
  ``ops.FusedCastAdamWeightDecay`` call per parameter, the coefficient its ``global_norm``;
- ``graph``: the same kernel for every parameter inside one ``ms.jit`` graph (parameters,
  moments and gradients as positional inputs, the scalars as one tensor input: one compile).

And the global norm's per-tensor square sums: ``mindtrain.parallel.grad_norm`` (float64
blocks, BLAS dot) against the float64 copies it replaced and one compiled graph.
Prints medians (ms), the graph's compile time and each update's largest weight difference
from ``per-param``.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time

import numpy as np

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--config", default=os.path.join(ROOT, "configs", "pynative_ds3_tiny.yaml"))
    ap.add_argument("--bench", action="store_true", help="bench_model.py's sizes (6.0M parameters)")
    args = ap.parse_args()

    import mindspore as ms
    from mindspore import Parameter, Tensor, ops

    ms.set_device("CPU")
    ms.runtime.launch_blocking()
    import mindtrain.models as mm
    from mindtrain.parallel import Group, grad_norm
    from mindtrain.trainer.optimizer import AdamW

    if args.bench:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        import bench_model
        from mindtrain.config import ModelConfig

        cfg = ModelConfig(**bench_model.SIZES, seq_length=bench_model.SEQ, num_nextn_predict_layers=0)
    else:
        from mindtrain.config import load_config

        cfg = load_config(args.config, validate=False).model
    with ms.DeviceCtx("meta"):  # shapes and names only
        model = mm.build_model(cfg, jit=False)
    named0 = [(p.name, tuple(p.shape)) for p in model.trainable_params()]
    rng = np.random.default_rng(0)
    init = [rng.standard_normal(s).astype(np.float32) * 0.02 for _, s in named0]
    grads = [Tensor(rng.standard_normal(s).astype(np.float32) * 1e-2) for _, s in named0]
    sets = {k: [(n, Parameter(Tensor(a.copy()), name=f"{k}.{n}")) for (n, _), a in zip(named0, init)]
            for k in ("per-param", "one-pass", "graph")}
    opts = {k: AdamW(v, lr=1e-3, betas=(0.9, 0.95), weight_decay=0.01) for k, v in sets.items()}
    adw, fused = ops.AdamWeightDecay(), ops.FusedCastAdamWeightDecay()

    @ms.jit
    def update_all(scalars, decays, *tensors):
        n = len(tensors) // 4
        lr, beta1, beta2, eps, wd, norm = scalars[0], scalars[1], scalars[2], scalars[3], scalars[4], scalars[5]
        no_decay = wd * 0.0
        out = ()
        for i in range(n):
            out = out + (fused(tensors[i], tensors[n + i], tensors[2 * n + i], lr, beta1, beta2, eps,
                               wd if decays[i] else no_decay, tensors[3 * n + i], norm),)
        return out

    def folded(o, t):
        bc1, bc2 = 1 - o.beta1 ** t, 1 - o.beta2 ** t
        return o.lr * math.sqrt(bc2) / bc1, o.eps * math.sqrt(bc2), o.weight_decay * bc1 / math.sqrt(bc2)

    def per_param(t, coef):
        o = opts["per-param"]
        lr, eps, wd = folded(o, t)
        for p, m, v, g, d in zip(o.params, o.exp_avg, o.exp_avg_sq, [g * coef for g in grads], o.decay):
            adw(p, m, v, lr, o.beta1, o.beta2, eps, wd if d else 0.0, g)
        o.params[0].asnumpy()

    def one_pass(t, coef):
        opts["one-pass"].step(grads, grad_scale=coef)
        opts["one-pass"].params[0].asnumpy()

    def graph(t, coef):
        o = opts["graph"]
        lr, eps, wd = folded(o, t)
        update_all(Tensor(np.array([lr, o.beta1, o.beta2, eps, wd, 1.0 / coef], np.float32)), tuple(o.decay),
                   *o.params, *o.exp_avg, *o.exp_avg_sq, *grads)
        o.params[0].asnumpy()

    def host_copies(_t, _coef):
        math.sqrt(sum(float(np.sum(np.square(g.asnumpy().astype(np.float64)))) for g in grads))

    def blocks(_t, _coef):
        grad_norm(grads, Group("world", (0,), 0))

    @ms.jit
    def sq_sums(*gs):
        return ops.cat([ops.square(g).sum().reshape(1) for g in gs])

    def graph_sums(_t, _coef):
        float(np.sum(sq_sums(*grads).asnumpy().astype(np.float64)))

    updates = {"per-param": per_param, "one-pass": one_pass, "graph": graph}
    norms = {"norm: float64 copies": host_copies, "norm: grad_norm": blocks, "norm: graph": graph_sums}
    coef = 0.5
    compile_s = 0.0
    for k, f in {**updates, **norms}.items():  # step 1: compiles, kernels' first launches
        t = time.perf_counter()
        f(1, coef)
        if k == "graph":
            compile_s = time.perf_counter() - t
    times = {k: [] for k in (*updates, *norms)}
    for step in range(2, args.steps + 2):
        order = list(updates) if step % 2 else list(reversed(updates))
        for k in order + list(norms):
            f = updates.get(k) or norms[k]
            t = time.perf_counter()
            f(step, coef)
            times[k].append((time.perf_counter() - t) * 1e3)
    ref = [p.asnumpy() for _, p in sets["per-param"]]
    n_el = sum(int(np.prod(s)) for _, s in named0)
    print(f"{len(named0)} parameters, {n_el:,} values, {args.steps} steps, clipping coefficient {coef}")
    for k, v in times.items():
        diff = (f", max |weight - per-param| {max(float(np.abs(p.asnumpy() - r).max()) for (_, p), r in zip(sets[k], ref)):.2g}"
                if k in updates else "")
        print(f"{k:22s} median {statistics.median(v):6.1f} ms, min {min(v):6.1f}{diff}")
    print(f"graph compile {compile_s:.1f} s")


if __name__ == "__main__":
    main()
