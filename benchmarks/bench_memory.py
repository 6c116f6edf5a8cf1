"""Activation memory: peak RSS above the process's baseline and step time with recompute
off / select / full, each in its own process (ru_maxrss is a per-process high-water mark).

    hatch run python benchmarks/bench_memory.py [--seq 4096] [--steps 2] [--jit 1]

Model: the benchmark size of bench_model.py (hidden 256, 4 layers, 8 experts), batch 1.
Baseline = RSS after the model is built and its inputs made, before the first step; the
reported figure is the peak during the steps minus that (activations, gradients, the
optimizer-free step's temporaries). select = self_attn.core_attention and mlp.experts of
every layer.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

MODES = {
    "off": None,
    "select": {"mode": "select", "select_module": {"self_attn.core_attention": True, "mlp.experts": True}},
    "full": {"mode": "full"},
}
SIZES = dict(vocab_size=4096, hidden_size=256, num_hidden_layers=4, first_k_dense_replace=1,
             n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2, n_shared_experts=1,
             moe_intermediate_size=128, intermediate_size=512, num_attention_heads=8, num_key_value_heads=8,
             q_lora_rank=128, kv_lora_rank=64, qk_rope_head_dim=16, qk_nope_head_dim=32, v_head_dim=32)


def _rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _current_rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def run_one(mode: str, seq: int, steps: int, jit: bool) -> dict:
    import numpy as np
    import mindspore as ms
    from mindspore import Tensor

    import mindtrain.models as mm
    from mindtrain.config import ModelConfig
    from mindtrain.config.schema import RecomputeConfig

    ms.set_device("CPU")
    ms.runtime.launch_blocking()  # eager ops in the calling thread, as the trainer runs them on CPU
    ms.set_seed(0)
    rc = MODES[mode]
    cfg = ModelConfig(**SIZES, seq_length=seq, max_position_embeddings=max(seq, 4096))
    model = mm.build_model(cfg, jit=jit, recompute=RecomputeConfig(**rc) if rc else None)
    rng = np.random.default_rng(0)
    ids = Tensor(rng.integers(0, cfg.vocab_size, (1, seq)).astype(np.int32))
    labels = Tensor(rng.integers(0, cfg.vocab_size, (1, seq)).astype(np.int32))
    mask = Tensor(np.ones((1, seq), np.float32))
    params = model.trainable_params()
    grad_fn = ms.value_and_grad(lambda: model(ids, labels=labels, loss_mask=mask)[0], None, params)
    baseline = _current_rss_mb()
    times, losses = [], []
    for _ in range(steps):
        t = time.perf_counter()
        loss, grads = grad_fn()
        losses.append(float(loss.asnumpy()))
        times.append(time.perf_counter() - t)
        del grads
    return {"mode": mode, "seq": seq, "jit": jit, "baseline_mb": round(baseline, 1),
            "peak_above_baseline_mb": round(_rss_mb() - baseline, 1),
            "first_step_s": round(times[0], 2), "step_s": round(min(times[1:] or times), 2), "loss": losses[0]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--jit", type=int, default=1)
    ap.add_argument("--modes", default="off,select,full")
    ap.add_argument("--one", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        print("RESULT " + json.dumps(run_one(args.one, args.seq, args.steps, bool(args.jit))), flush=True)
        return
    rows = []
    for mode in args.modes.split(","):
        out = subprocess.run([sys.executable, __file__, "--one", mode, "--seq", str(args.seq),
                              "--steps", str(args.steps), "--jit", str(args.jit)],
                             capture_output=True, text=True, check=False)
        line = next((l for l in out.stdout.splitlines() if l.startswith("RESULT ")), None)
        if line is None:
            sys.exit(f"bench_memory: mode {mode} failed:\n{out.stderr[-2000:]}")
        rows.append(json.loads(line[7:]))
    off = next((r for r in rows if r["mode"] == "off"), rows[0])
    print(f"seq {args.seq}, batch 1, jit {bool(args.jit)}, {args.steps} steps (step time: fastest after the first)")
    print("| recompute | peak RSS above baseline (MB) | vs off | step time (s) | vs off | loss |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['mode']} | {r['peak_above_baseline_mb']:.0f} | "
              f"{r['peak_above_baseline_mb'] / off['peak_above_baseline_mb']:.2f}x | {r['step_s']:.2f} | "
              f"{r['step_s'] / off['step_s']:.2f}x | {r['loss']:.6f} |")


if __name__ == "__main__":
    main()
