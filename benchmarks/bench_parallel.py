"""FSDP step time: 2 msrun workers x 1 core each vs 1 process on both cores, same global batch.

    hatch run python benchmarks/bench_parallel.py [--sizes tiny,bench] [--steps 3]

For each model size it runs (a) one process, unpinned (MindSpore's CPU kernels use both
cores), training the plain model on the whole global batch, and (b) msrun with 2 workers,
each pinned to one core, training the same model with FSDP (each strategy asked for) on
half the batch each. Prints ms/step, the ratio, and the share of the FSDP step spent in
collectives (timed with a sync after each collective, so the share is an upper bound).
The optimizer is plain SGD written with set_data, the same in both runs.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

SIZES = {  # vocab, hidden, layers, heads, ffn, seq, global batch
    "tiny": dict(V=512, D=128, L=3, H=4, FF=256, S=64, B=8),
    "bench": dict(V=4096, D=256, L=4, H=8, FF=1024, S=128, B=8),
}


def build(cfg, seed=0):
    import numpy as np
    import mindspore as ms
    from mindspore import Parameter, Tensor, mint, nn, ops

    V, D, L, H, FF, S = (cfg[k] for k in ("V", "D", "L", "H", "FF", "S"))
    rng = np.random.RandomState(seed)

    def p(*shape, scale=0.05):
        return Parameter(Tensor((rng.randn(*shape) * scale).astype(np.float32)))

    def rms(x, g):
        return x * mint.rsqrt((x * x).mean(-1, keep_dims=True) + 1e-6) * g

    matmul_t = ops.MatMul(transpose_b=True)

    def lin(x, w):
        return matmul_t(x.reshape(-1, x.shape[-1]), w).reshape(x.shape[:-1] + (w.shape[0],))

    class Block(nn.Cell):
        def __init__(self):
            super().__init__()
            self.n1, self.n2 = Parameter(Tensor(np.ones(D, np.float32))), Parameter(Tensor(np.ones(D, np.float32)))
            self.wqkv, self.wo, self.w1, self.w2 = p(3 * D, D), p(D, D), p(FF, D), p(D, FF)

        def construct(self, x, mask):
            b = x.shape[0]
            q, k, v = mint.split(lin(rms(x, self.n1), self.wqkv), D, -1)
            q, k, v = (t.reshape(b, S, H, D // H).transpose(0, 2, 1, 3) for t in (q, k, v))
            att = ops.softmax(mint.matmul(q, k.transpose(0, 1, 3, 2)) * (D // H) ** -0.5 + mask, -1)
            x = x + lin(mint.matmul(att, v).transpose(0, 2, 1, 3).reshape(b, S, D), self.wo)
            return x + lin(ops.silu(lin(rms(x, self.n2), self.w1)), self.w2)

    class LM(nn.Cell):
        def __init__(self):
            super().__init__()
            self.embed = p(V, D, scale=0.5)
            self.blocks = nn.CellList([Block() for _ in range(L)])
            self.norm, self.head = Parameter(Tensor(np.ones(D, np.float32))), p(V, D)
            self.mask = Tensor(np.triu(np.full((S, S), -1e9, np.float32), 1))

        def construct(self, ids, labels):
            x = self.embed[ids]
            for blk in self.blocks:
                x = blk(x, self.mask)
            logits = lin(rms(x, self.norm), self.head)
            return ops.cross_entropy(logits.reshape(-1, V), labels.reshape(-1))

    return LM(), [f"blocks.{i}" for i in range(L)]


def batches(cfg, steps):
    import numpy as np

    rng = np.random.RandomState(0)
    for _ in range(steps):
        ids = rng.randint(0, cfg["V"], (cfg["B"], cfg["S"] + 1)).astype(np.int32)
        yield ids[:, :-1], ids[:, 1:]


def sgd(params, grads, lr=0.1):
    for prm, g in zip(params, grads):
        prm.set_data(prm - lr * g)


def run_single(cfg, steps, warmup):
    import mindspore as ms
    from mindspore import Tensor

    ms.set_device("CPU")
    model, _ = build(cfg)
    params = model.trainable_params()
    grad_fn = ms.value_and_grad(model, None, weights=params)
    times = []
    for i, (ids, labels) in enumerate(batches(cfg, warmup + steps)):
        t0 = time.perf_counter()
        loss, grads = grad_fn(Tensor(ids), Tensor(labels))
        sgd(params, grads)
        loss = float(loss.asnumpy())
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return {"ms_per_step": 1000 * sum(times) / len(times), "loss": loss}


def run_worker(cfg, steps, warmup, strategy):
    import mindspore as ms
    from mindspore import Tensor

    from mindtrain.config import ParallelismConfig
    from mindtrain.parallel import DeviceMesh, collectives as C, fully_shard, init_distributed

    ms.set_device("CPU")
    world, rank = init_distributed()
    os.sched_setaffinity(0, {rank % os.cpu_count()})
    mesh = DeviceMesh.from_config(ParallelismConfig(), world, rank).init_process_groups()
    model, units = build(cfg)
    fsdp = fully_shard(model, mesh, units=units, strategy=strategy)
    step_fn = fsdp.value_and_grad(model)
    local = cfg["B"] // world
    times, comm = [], []
    for i, (ids, labels) in enumerate(batches(cfg, warmup + steps)):
        C.barrier()
        C.reset_timing(True)
        t0 = time.perf_counter()
        rows = slice(rank * local, (rank + 1) * local)
        loss = step_fn(Tensor(ids[rows]), Tensor(labels[rows]))
        sgd(fsdp.params, fsdp.grads)
        fsdp.finish_step()
        loss = float(C.all_reduce(Tensor([float(loss.asnumpy())]), mesh.group("dp"), op="avg").asnumpy()[0])
        if i >= warmup:
            times.append(time.perf_counter() - t0)
            comm.append(C.reset_timing(False))
    return {"ms_per_step": 1000 * sum(times) / len(times), "comm_ms": 1000 * sum(comm) / len(comm),
            "loss": loss, "rank": rank}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="tiny,bench")
    ap.add_argument("--strategies", default="optim_grads_params,optim_grads")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--port", type=int, default=8290)
    ap.add_argument("--bench-worker", nargs=3, metavar=("SIZE", "STRATEGY", "OUT"), help=argparse.SUPPRESS)
    ap.add_argument("--bench-single", nargs=2, metavar=("SIZE", "OUT"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.bench_worker:
        res = run_worker(SIZES[a.bench_worker[0]], a.steps, a.warmup, a.bench_worker[1])
        if res["rank"] == 0:
            json.dump(res, open(a.bench_worker[2], "w"))
        return
    if a.bench_single:
        json.dump(run_single(SIZES[a.bench_single[0]], a.steps, a.warmup), open(a.bench_single[1], "w"))
        return

    env = dict(os.environ, PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
    tmp = tempfile.mkdtemp(prefix="bench_parallel_")
    me = os.path.abspath(__file__)
    common = ["--steps", str(a.steps), "--warmup", str(a.warmup)]
    rows = []
    for size in a.sizes.split(","):
        out = os.path.join(tmp, f"single_{size}.json")
        subprocess.run([sys.executable, me, "--bench-single", size, out, *common], env=env, check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        single = json.load(open(out))
        for strategy in a.strategies.split(","):
            out = os.path.join(tmp, f"fsdp_{size}_{strategy}.json")
            subprocess.run(["msrun", "--worker_num=2", "--local_worker_num=2", f"--master_port={a.port}",
                            f"--log_dir={tmp}/log_{size}_{strategy}", "--join=True", me,
                            "--bench-worker", size, strategy, out, *common], env=env, check=True,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            fsdp = json.load(open(out))
            rows.append((size, strategy, single, fsdp))
    print(f"load average at end: {os.getloadavg()[0]:.1f}")
    print("| model | strategy | 1 worker x 2 cores ms/step | 2 workers x 1 core FSDP ms/step | ratio (FSDP/single) "
          "| comm ms/step | comm share | loss single / FSDP |")
    print("|---|---|---|---|---|---|---|---|")
    for size, strategy, s, f in rows:
        print(f"| {size} | {strategy} | {s['ms_per_step']:.0f} | {f['ms_per_step']:.0f} | "
              f"{f['ms_per_step'] / s['ms_per_step']:.2f} | {f['comm_ms']:.0f} | "
              f"{f['comm_ms'] / f['ms_per_step']:.0%} | {s['loss']:.4f} / {f['loss']:.4f} |")


if __name__ == "__main__":
    main()
