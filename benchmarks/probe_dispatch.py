"""Eager vs compiled forward + backward of the tiny DeepSeek-V3 under MindSpore's dispatch modes.

    hatch run python benchmarks/probe_dispatch.py [--steps 6]

Each mode runs in its own process (the dispatch settings are process-wide): the tiny config
at seq 32 with 2 decoder layers and MTP, batch 1, ``ms.value_and_grad`` over every
parameter, synced with ``.asnumpy()``. Modes: MindSpore's default asynchronous dispatch,
``op_tuning.threads_num(1)``, ``dispatch_threads_num(1)`` and synchronous dispatch
(``ms.runtime.launch_blocking()``, what ``mindtrain.models.synchronous_cpu_dispatch`` sets),
each eager and with compiled layers. Prints one markdown row per mode: per-step ms (step 1
includes compilation) and the median of steps 2..N.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
MODES = ["async", "threads_1", "dispatch_1", "sync"]


def run(mode: str, jit: bool, steps: int) -> list[float]:
    import numpy as np

    import mindspore as ms

    ms.set_device("CPU")
    if mode == "threads_1":
        ms.device_context.cpu.op_tuning.threads_num(1)
    elif mode == "dispatch_1":
        ms.runtime.dispatch_threads_num(1)
    elif mode == "sync":
        ms.runtime.launch_blocking()
    from mindtrain.config import load_config
    from mindtrain.models import build_model

    cfg = load_config(os.path.join(ROOT, "configs", "pynative_ds3_tiny.yaml"),
                      ["model.seq_length=32", "train_dataset.dataloader.config.seq_length=32",
                       "model.num_hidden_layers=2"], validate=False)
    ms.set_seed(1)
    model = build_model(cfg.model, jit=jit)
    ids = ms.Tensor(np.random.RandomState(0).randint(0, cfg.model.vocab_size, (1, 32)).astype(np.int32))
    mask = ms.Tensor(np.ones((1, 32), np.float32))

    def loss_fn(ids):
        return model(ids, labels=ids, loss_mask=mask)[0]

    grad_fn = ms.value_and_grad(loss_fn, None, model.trainable_params())
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        loss, grads = grad_fn(ids)
        loss.asnumpy()
        grads[0].asnumpy()
        times.append((time.perf_counter() - t) * 1000)
    return times


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--one", nargs=2, help=argparse.SUPPRESS)  # mode, jit: the child process
    args = ap.parse_args()
    if args.one:
        print("RESULT " + json.dumps(run(args.one[0], args.one[1] == "1", args.steps)), flush=True)
        return
    env = dict(os.environ, GLOG_v="3")
    print("| dispatch | layers | step 1 (ms) | median of steps 2.. (ms) | every step (ms) |")
    print("|---|---|---|---|---|")
    for mode in MODES:
        for jit in (False, True):
            if jit and mode in ("threads_1", "dispatch_1"):
                continue
            out = subprocess.run([sys.executable, __file__, "--steps", str(args.steps), "--one", mode, str(int(jit))],
                                 capture_output=True, text=True, env=env, cwd=ROOT)
            line = next((x for x in out.stdout.splitlines() if x.startswith("RESULT ")), None)
            if line is None:
                print(f"| {mode} | {'compiled' if jit else 'eager'} | failed: {out.stderr.strip()[-200:]} | | |")
                continue
            t = json.loads(line[len("RESULT "):])
            print(f"| {mode} | {'compiled' if jit else 'eager'} | {t[0]:.0f} | {statistics.median(t[1:]):.0f} | "
                  f"{' / '.join(f'{x:.0f}' for x in t)} |", flush=True)


if __name__ == "__main__":
    main()
