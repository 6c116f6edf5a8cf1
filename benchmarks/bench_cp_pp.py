"""Pipeline bubble of the 1F1B schedule, measured against the theory (P-1)/(V M+P-1).

    hatch run python benchmarks/bench_cp_pp.py [--micro 2,4,8] [--seq 64] [--steps 3] [--port 8590] [--chunks 1]

(``--chunks V`` > 1 runs interleaved 1F1B with V model chunks per stage.)

Launches msrun with 2 workers (PP = 2, tiny DeepSeek-V3 from configs/pynative_ds3_tiny.yaml,
eager) and, for each number of micro-batches M, times every step: the bubble of a stage is
the share of the step it spends outside its own forward/backward compute (waiting for its
neighbour). Prints one table row per M: measured (mean over stages, steps after the first)
and theoretical bubble and their ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))


def worker(out_dir: str, micros: list[int], seq: int, steps: int, chunks: int = 1) -> None:
    import numpy as np
    import mindspore as ms

    ms.set_device("CPU")
    ms.runtime.launch_blocking()  # eager ops in the calling thread, as the trainer runs them on CPU
    from mindtrain.config import ParallelDims, load_config
    from mindtrain.models import build_model, parallel_plan
    from mindtrain.parallel import DeviceMesh
    from mindtrain.parallel.collectives import init_distributed
    from mindtrain.parallel.pipeline_parallel import PipelineSchedule

    world, rank = init_distributed()
    cfg = load_config(os.path.join(ROOT, "configs", "pynative_ds3_tiny.yaml"),
                      [f"model.seq_length={seq}", f"train_dataset.dataloader.config.seq_length={seq}"],
                      validate=False)
    mesh = DeviceMesh(ParallelDims(world_size=world, pp=world, dp_shard=1, cp=1, tp=1, ep=1), rank)
    mesh.init_process_groups()
    ms.set_seed(1)
    model = build_model(cfg.model, jit=False)
    sched = PipelineSchedule(model, parallel_plan(model), mesh, seq, schedule="1f1b", chunks=chunks)
    rng = np.random.default_rng(0)
    rows = {}
    for m in micros:
        fractions = []
        for step in range(steps):
            mbs = []
            for _ in range(m):
                tok = rng.integers(2, cfg.model.vocab_size, size=(1, seq + 1)).astype(np.int32)
                mbs.append({"input_ids": tok[:, :-1], "labels": tok[:, 1:]})
            sched.step(mbs)
            t = sched.last_timing
            if step:  # the first step pays one-time set-up
                fractions.append(1.0 - t["busy_s"] / t["step_s"])
        rows[m] = float(np.mean(fractions))
    with open(os.path.join(out_dir, f"bubble_{rank}.json"), "w") as f:
        json.dump(rows, f)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--micro", default="2,4,8")
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--port", type=int, default=8590)
    ap.add_argument("--chunks", type=int, default=1)
    a = ap.parse_args()
    micros = [int(v) for v in a.micro.split(",")]
    from mindtrain.parallel.pipeline_schedule import bubble_fraction

    out = tempfile.mkdtemp(prefix="bench_cp_pp_")
    env = dict(os.environ)
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    env.setdefault("GLOG_v", "3")
    # settings travel by environment: msrun's own parser would take "--worker" for "--worker_num"
    env["BENCH_CP_PP"] = json.dumps({"out": out, "micros": micros, "seq": a.seq, "steps": a.steps,
                                      "chunks": a.chunks})
    cmd = ["msrun", "--worker_num=2", "--local_worker_num=2", f"--master_port={a.port}", "--join=True",
           f"--log_dir={out}/log", os.path.abspath(__file__)]
    subprocess.run(cmd, env=env, check=True, capture_output=True, cwd=out)
    per_rank = [json.load(open(os.path.join(out, f"bubble_{r}.json"))) for r in range(2)]
    print("| P | V | M | measured bubble (stage 0 / stage 1 / mean) | theory (P-1)/(V M+P-1) | measured / theory |")
    print("|---|---|---|---|---|---|")
    for m in micros:
        vals = [r[str(m)] for r in per_rank]
        mean = sum(vals) / len(vals)
        theory = bubble_fraction(2, m, a.chunks)
        print(f"| 2 | {a.chunks} | {m} | {vals[0]:.3f} / {vals[1]:.3f} / {mean:.3f} | {theory:.3f} | {mean / theory:.2f} |")


if __name__ == "__main__":
    if "BENCH_CP_PP" in os.environ:
        s = json.loads(os.environ["BENCH_CP_PP"])
        worker(s["out"], s["micros"], s["seq"], s["steps"], s.get("chunks", 1))
    else:
        main()
