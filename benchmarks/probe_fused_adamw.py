"""Probe: one compiled AdamW update over every parameter against the trainer's per-parameter
fused kernel, on the tiny config's (and the benchmark model's) parameter shapes.

    hatch run python benchmarks/probe_fused_adamw.py [--steps 8] [--config configs/pynative_ds3_tiny.yaml]

The per-parameter path is ``mindtrain.trainer.optimizer.AdamW.step`` (one
``ops.AdamWeightDecay`` launch per parameter). The compiled path is one ``ms.jit`` function
taking every parameter, moment and gradient as positional inputs (so it reads whatever
storage they have at the call: no rebinding problem after ``set_data``) and doing the same
kernel per parameter inside one graph, clipping scale folded in. Prints both medians, their
ratio, the compile time and the largest weight difference (0 means bit-identical).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--config", default=os.path.join(ROOT, "configs", "pynative_ds3_tiny.yaml"))
    args = ap.parse_args()

    import mindspore as ms
    from mindspore import Parameter, Tensor, ops

    ms.set_device("CPU")
    ms.runtime.launch_blocking()
    from mindtrain.config import load_config
    from mindtrain.models import build_model
    from mindtrain.trainer.optimizer import AdamW

    cfg = load_config(args.config, validate=False)
    model = build_model(cfg.model, jit=False)
    named = [(p.name, p) for p in model.trainable_params()]
    rng = np.random.RandomState(0)
    grads = [Tensor(rng.randn(*p.shape).astype(np.float32)) for _, p in named]
    twin = [(n, Parameter(Tensor(p.asnumpy().copy()), name=n + ".twin")) for n, p in named]
    eager = AdamW(named, lr=1e-3, betas=(0.9, 0.95), weight_decay=0.01)
    ref = AdamW(twin, lr=1e-3, betas=(0.9, 0.95), weight_decay=0.01)  # its moments, stepped by the graph
    kernel = ops.AdamWeightDecay()

    @ms.jit
    def update(lr, beta1, beta2, eps, wd, scale, decays, *tensors):
        n = len(tensors) // 4
        no_decay = wd * 0.0
        out = ()
        for i in range(n):
            out = out + (kernel(tensors[i], tensors[n + i], tensors[2 * n + i], lr, beta1, beta2, eps,
                                wd if decays[i] else no_decay, tensors[3 * n + i] * scale),)
        return out

    scale = 0.5
    t_eager, t_fused, compile_s = [], [], 0.0
    for step in range(1, args.steps + 1):
        t = time.perf_counter()
        eager.step([g * scale for g in grads])
        named[0][1].asnumpy()
        t_eager.append(time.perf_counter() - t)
        bc1, bc2 = 1 - 0.9 ** step, 1 - 0.95 ** step
        lr_t, eps_t, wd_t = 1e-3 * bc2 ** 0.5 / bc1, 1e-8 * bc2 ** 0.5, 0.01 * bc1 / bc2 ** 0.5
        decays = tuple(bool(d) for d in ref.decay)  # constant: one compile
        t = time.perf_counter()
        update(Tensor(lr_t, ms.float32), 0.9, 0.95, Tensor(eps_t, ms.float32), Tensor(wd_t, ms.float32),
               Tensor(scale, ms.float32), decays,
               *[p for _, p in twin], *ref.exp_avg, *ref.exp_avg_sq, *grads)
        twin[0][1].asnumpy()
        if step == 1:
            compile_s = time.perf_counter() - t
        else:
            t_fused.append(time.perf_counter() - t)
    diff = max(float(np.abs(a.asnumpy() - b.asnumpy()).max()) for (_, a), (_, b) in zip(named, twin))
    e, f = statistics.median(t_eager[1:]) * 1000, statistics.median(t_fused) * 1000
    print(f"{len(named)} parameters, {sum(p.size for _, p in named):,} elements: per-parameter AdamW {e:.1f} ms, "
          f"one compiled update {f:.1f} ms (ratio {f / e:.2f}), compile {compile_s:.1f} s, max |weight diff| {diff:.3g}")


if __name__ == "__main__":
    main()
