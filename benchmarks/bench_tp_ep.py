"""Communication volume and time share per training step for TP / EP / FSDP layouts.

    hatch run python benchmarks/bench_tp_ep.py            # launches msrun itself

Runs the tiny DeepSeek-V3 training of integration_tests/workers/tp_ep_parity.py (8
sequences of 32 tokens per step, 2 micro-batches per rank) for each layout, next to the
single-process run, with every collective of ``mindtrain.parallel.collectives`` counted:
bytes this rank sends (a ring estimate: all_reduce 2(n-1)/n, all_gather / reduce_scatter
(n-1)/n of the full tensor, all_to_all the rows that leave the rank) and wall time inside
collectives. Prints one row per layout (rank 0) for the steps after the first.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WORKER_DIR = ROOT / "integration_tests" / "workers"
LAUNCHES = [(1, "ref"), (2, "tp2,ep2"), (4, "tp2_fsdp2,ep2_fsdp4")]


def _instrument(stats):
    from mindtrain.parallel import collectives as C

    def nbytes(t):
        return int(t.size) * t.itemsize

    def wrap(name, volume):
        fn = getattr(C, name)

        def counted(x, *args, **kwargs):
            if stats["depth"]:  # a collective composed of others counts once
                return fn(x, *args, **kwargs)
            stats["depth"] += 1
            t0 = time.perf_counter()
            try:
                out = fn(x, *args, **kwargs)
            finally:
                stats["depth"] -= 1
            stats["time"] += time.perf_counter() - t0
            g = kwargs.get("group", args[0] if args and not isinstance(args[0], (int, str)) else None)
            n = (g.size if g is not None else C.world_size()) if name != "send" else 2
            if n > 1:
                stats["bytes"] += volume(x, out, n)
                stats["calls"] += 1
            return out

        setattr(C, name, counted)

    wrap("all_reduce", lambda x, out, n: 2 * (n - 1) * nbytes(x) // n)
    wrap("all_gather", lambda x, out, n: (n - 1) * nbytes(x))
    wrap("reduce_scatter", lambda x, out, n: (n - 1) * nbytes(x) // n)
    # rows leaving the rank: everything sent minus what it keeps (approximated by 1/n)
    wrap("all_to_all", lambda x, out, n: (n - 1) * nbytes(x) // n)


def worker(out_dir: str, cases: str) -> None:
    sys.path.insert(0, str(WORKER_DIR))
    os.environ.setdefault("TP_EP_STEPS", "2")  # the second step is measured
    import mindspore as ms
    import tp_ep_parity as W
    from mindtrain.parallel import init_distributed

    ms.set_device("CPU")
    ms.runtime.launch_blocking()  # eager ops in the calling thread, as the trainer runs them on CPU
    world, rank = init_distributed()
    stats = {"bytes": 0, "time": 0.0, "calls": 0, "depth": 0}
    _instrument(stats)
    rows = {}
    for case in cases.split(","):
        step_marks = []

        orig_data = W.data

        def data(step, _orig=orig_data):
            step_marks.append((time.perf_counter(), dict(stats)))
            return _orig(step)

        W.data = data
        W.run(case, world, rank, out_dir)
        step_marks.append((time.perf_counter(), dict(stats)))
        W.data = orig_data
        # marks: one from activation_bytes' data(0), then one per step, then the end
        steps = step_marks[2:]
        t = [b[0] - a[0] for a, b in zip(steps, steps[1:])]
        vol = [b[1]["bytes"] - a[1]["bytes"] for a, b in zip(steps, steps[1:])]
        ct = [b[1]["time"] - a[1]["time"] for a, b in zip(steps, steps[1:])]
        calls = [b[1]["calls"] - a[1]["calls"] for a, b in zip(steps, steps[1:])]
        rows[case] = {"step_s": sum(t) / len(t), "mib_per_step": sum(vol) / len(vol) / 2 ** 20,
                      "comm_share": sum(ct) / sum(t), "calls_per_step": sum(calls) / len(calls)}
    if rank == 0:
        Path(out_dir, f"bench_{cases.replace(',', '_')}.json").write_text(json.dumps(rows))


def main() -> None:
    env = dict(os.environ)
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    env.setdefault("GLOG_v", "3")
    rows = {}
    with tempfile.TemporaryDirectory() as d:
        for port, (workers, cases) in enumerate(LAUNCHES, start=8480):
            if workers == 1:
                cmd = [sys.executable, __file__, "worker", d, cases]
            else:
                cmd = ["msrun", f"--worker_num={workers}", f"--local_worker_num={workers}",
                       f"--master_port={port}", f"--log_dir={d}/log_{workers}", "--join=True",
                       __file__, "worker", d, cases]
            subprocess.run(cmd, env=env, check=True, cwd=d, capture_output=True)
            rows.update(json.loads(Path(d, f"bench_{cases.replace(',', '_')}.json").read_text()))
    base = rows["ref"]["step_s"]
    print("| layout | workers | comm MiB/step/rank | collective calls/step | comm time share | step time vs 1 process |")
    print("|---|---|---|---|---|---|")
    workers = {"ref": 1, "tp2": 2, "ep2": 2, "tp2_fsdp2": 4, "ep2_fsdp4": 4}
    for case, r in rows.items():
        print(f"| {case} | {workers[case]} | {r['mib_per_step']:.2f} | {r['calls_per_step']:.0f} | "
              f"{100 * r['comm_share']:.0f}% | {r['step_s'] / base:.2f}x |")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "worker":  # msrun rejects a "--worker" flag (ambiguous)
        worker(sys.argv[2], sys.argv[3])
    else:
        main()
