"""Every layout of the real trainer against one process, on the same global batch, in one run.

    hatch run python benchmarks/bench_parallel.py [--steps 12] [--layouts single,zero2,...]
                                                  [--transport shm|mccl|both]

Each layout runs ``run_mindformer.py --config configs/pynative_ds3_tiny.yaml`` (the quick
start's job: global batch 2 x seq 256) with the layout's overrides: the single process
with ``local_batch_size=2`` as ``python run_mindformer.py``, the others under msrun. The
layouts run one after another, interleaved with the single process (it runs again before
every third layout) so load drift shows up in its spread. From each run:

- median step time of steps 3..N (rank 0's metrics; steps 1-2 compile) and its ratio to the
  single process's median;
- collective calls and seconds per step (``MINDTRAIN_COMM_STATS``: every top-level
  collective call is counted and timed; on the shared-memory transport the time is real,
  on mccl it is only the time to enqueue);
- peak RSS per rank.

Prints a markdown table (the parallel README's). The 4-worker rows run 4 workers on a
2-core host, so their ratio includes 2x oversubscription.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, ROOT)
CONFIG = os.path.join(ROOT, "configs", "pynative_ds3_tiny.yaml")

ZERO = "parallelism.data_parallel_shard_strategy="
LAYOUTS = {  # name: (workers, overrides); global batch 2 everywhere
    "single": (1, ["training.local_batch_size=2", "parallelism.data_parallel_shard=1"]),
    "zero1": (2, [ZERO + "optim"]),
    "zero2": (2, [ZERO + "optim_grads"]),
    "zero3": (2, [ZERO + "optim_grads_params"]),
    # ZeRO-3 keeping each unit's gathered weights from its forward to its backward
    "zero3_never": (2, [ZERO + "optim_grads_params", "parallelism.reshard_after_forward_policy=never"]),
    "tp2": (2, ["parallelism.tensor_parallel=2", "training.local_batch_size=2"]),
    "ep2": (2, ["parallelism.expert_parallel=2"]),
    "cp2": (2, ["parallelism.context_parallel=2", "training.local_batch_size=2"]),
    "pp2": (2, ["parallelism.pipeline_parallel=2", "training.local_batch_size=1"]),
    "dp2_tp2": (4, ["parallelism.tensor_parallel=2"]),
    # ZeRO-3 under TP: per-layer units, compiled pieces between TP's collectives
    "dp2_tp2_zero3": (4, ["parallelism.tensor_parallel=2", ZERO + "optim_grads_params"]),
    "pp2_dp2": (4, ["parallelism.pipeline_parallel=2"]),
    # ZeRO-3 under EP: per-layer units, compiled pieces, each running its own experts
    "ep2_zero3": (2, ["parallelism.expert_parallel=2", ZERO + "optim_grads_params"]),
    # ZeRO-3 in pipeline stages: compiled layers on the stage's gathered weights
    "pp2_dp2_zero3": (4, ["parallelism.pipeline_parallel=2", ZERO + "optim_grads_params"]),
}
# the layouts that compile by regions or in twins, once more with eager layers (compile.enable=false)
for _name in ("zero3", "tp2", "ep2", "cp2", "dp2_tp2_zero3", "ep2_zero3", "pp2_dp2_zero3"):
    LAYOUTS[_name + "_eager"] = (LAYOUTS[_name][0], LAYOUTS[_name][1] + ["compile.enable=false"])


def prepare_data() -> str:
    from mindtrain.trainer.quickstart import prepare_data as prepare

    cwd = os.getcwd()
    os.chdir(ROOT)  # the tiny config's data_path is relative to the repository root
    try:
        return prepare()
    finally:
        os.chdir(cwd)


def run(name: str, steps: int, port: int, work: str, transport: str) -> dict:
    from mindtrain.trainer.quickstart import worker_env

    workers, extra = LAYOUTS[name]
    out = os.path.join(work, f"{name}_{transport}_{port}")
    os.makedirs(out)
    items = [f"training.steps={steps}", "checkpoint.enable_save=false",
             f"monitor.metrics_dir={os.path.join(out, 'metrics')}", *extra]
    args = ["--config", CONFIG, "--mode", "1"] + [a for item in items for a in ("--override", item)]
    env = dict(worker_env(), MINDTRAIN_COMM_STATS=os.path.join(out, "comm"), GLOG_v="3",
               MINDTRAIN_CPU_TRANSPORT=transport)
    entry = os.path.join(ROOT, "run_mindformer.py")
    if workers == 1:
        cmd = [sys.executable, entry, *args]
    else:
        cmd = ["msrun", f"--worker_num={workers}", f"--local_worker_num={workers}", f"--master_port={port}",
               "--join=True", f"--log_dir={os.path.join(out, 'log')}", entry, *args]
    t0 = time.time()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if proc.returncode:
        tail = proc.stdout[-1500:] + proc.stderr[-1500:]
        for log in sorted(glob.glob(os.path.join(out, "log", "worker_*.log"))):
            tail += open(log, errors="replace").read()[-1500:]
        raise SystemExit(f"bench_parallel: {name} failed ({proc.returncode}):\n{tail}")
    rows = [json.loads(line) for f in glob.glob(os.path.join(out, "metrics", "*", "metrics.jsonl"))
            for line in open(f)]
    times = [r["per_step_time_ms"] for r in rows if r["step"] >= 3]
    stats = [json.load(open(f)) for f in sorted(glob.glob(os.path.join(out, "comm.rank*.json")))]
    return {"name": name, "workers": workers, "transport": stats[0]["transport"] if stats else "none",
            "step_ms": statistics.median(times), "spread": (min(times), max(times)),
            "calls": sum(s["calls"] for s in stats) / max(len(stats), 1) / steps,
            "comm_s": sum(s["seconds"] for s in stats) / max(len(stats), 1) / steps,
            "rss_mb": [round(s["peak_rss_mb"]) for s in stats], "wall_s": time.time() - t0}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--layouts", default=",".join(n for n in LAYOUTS if n != "single"))
    p.add_argument("--transport", choices=["shm", "mccl", "both"], default="shm")
    p.add_argument("--port", type=int, default=8790)
    a = p.parse_args()
    names = [n for n in a.layouts.split(",") if n]
    unknown = [n for n in names if n not in LAYOUTS]
    if unknown:
        print(f"bench_parallel: unknown layout(s) {unknown}; choose from {', '.join(LAYOUTS)}", file=sys.stderr)
        return 2
    prepare_data()
    transports = ["shm", "mccl"] if a.transport == "both" else [a.transport]
    results, singles = [], []
    port = a.port
    with tempfile.TemporaryDirectory() as work:
        for i, name in enumerate(names):
            if i % 3 == 0:
                singles.append(run("single", a.steps, port, work, "shm"))
                print(f"single: {singles[-1]['step_ms']:.0f} ms/step", flush=True)
            for tr in transports:
                port += 1
                r = run(name, a.steps, port, work, tr)
                results.append(r)
                print(f"{name} ({r['transport']}): {r['step_ms']:.0f} ms/step, {r['calls']:.0f} collectives/step",
                      flush=True)
    base = statistics.median(s["step_ms"] for s in singles)
    each = ", ".join(f"{s['step_ms']:.0f}" for s in singles)
    print(f"\nsingle process (local batch 2): median {base:.0f} ms/step over {len(singles)} runs ({each})\n")
    print("| layout | workers | transport | ms/step (min-max) | ratio to 1 process | collectives/step | "
          "collective s/step | peak RSS per rank (MB) |")
    print("|---|---|---|---|---|---|---|---|")
    for r in results:
        lo, hi = r["spread"]
        print(f"| {r['name']} | {r['workers']} | {r['transport']} | {r['step_ms']:.0f} ({lo:.0f}-{hi:.0f}) | "
              f"{r['step_ms'] / base:.2f}x | {r['calls']:.0f} | {r['comm_s']:.3f} | "
              f"{', '.join(map(str, r['rss_mb']))} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
