"""msrun worker: every collective and differentiable collective against numpy.

Each rank rebuilds every rank's inputs from seeds, computes the expected results with
numpy and writes {check: max abs error} to <out_dir>/collectives_<rank>.json.
"""

import os

# Before mindspore starts its threads (they inherit the mask): its runtime threads otherwise
# spread over every core and, with more ranks than cores, burn about a third more CPU time.
_cpus = sorted(os.sched_getaffinity(0))
os.sched_setaffinity(0, {_cpus[int(os.environ.get("RANK_ID", 0)) % len(_cpus)]})

import json
import sys

import numpy as np

import mindspore as ms
from mindspore import Tensor

from mindtrain.config import ParallelismConfig
from mindtrain.parallel import DeviceMesh, collectives as C, functional as F, init_distributed

ms.set_device("CPU")
ms.runtime.launch_blocking()  # eager ops in the calling thread, as the trainer runs them on CPU
world, rank = init_distributed()
expected = os.environ["EXPECT_TRANSPORT"]
if C.transport() != expected:
    sys.exit(f"rank {rank}: transport {C.transport()}, expected {expected}")
out_dir = sys.argv[1]
errors: dict[str, float] = {}


def check(name, got, want):
    got = got.asnumpy() if isinstance(got, Tensor) else np.asarray(got)
    want = np.asarray(want)
    if got.shape != want.shape:
        errors[name] = float("inf")
        print(f"rank {rank} {name}: shape {got.shape} != {want.shape}", flush=True)
        return
    errors[name] = float(np.abs(got.astype(np.float64) - want).max()) if got.size else 0.0


def data(r, shape, salt=0):
    return np.random.RandomState(1000 * salt + r).randn(*shape).astype(np.float32)


def run_group(tag, g):
    n, me, members = g.size, g.index, g.ranks
    xs = [data(r, (4 * n, 3, 2)) for r in members]
    base = Tensor(np.stack([np.zeros_like(xs[me]), xs[me]], axis=-1))
    view = base[..., 1]  # a strided view: collectives must still see its values
    total = sum(xs)
    check(f"{tag}/all_reduce_sum_view", C.all_reduce(view, g), total)
    check(f"{tag}/all_reduce_avg", C.all_reduce(Tensor(xs[me]), g, op="avg"), total / n)
    check(f"{tag}/all_reduce_keeps_input", view, xs[me])
    # 1.2 MB moves the shared-memory transport to a larger segment; the next call uses it
    bigs = [data(r, (300_000,), 5) for r in members]
    check(f"{tag}/all_reduce_big", C.all_reduce(Tensor(bigs[me]), g), sum(bigs))
    check(f"{tag}/all_reduce_float64", C.all_reduce(Tensor(xs[me].astype(np.float64)), g), total)
    check(f"{tag}/all_gather_dim0", C.all_gather(view, g), np.concatenate(xs, 0))
    check(f"{tag}/all_gather_dim1", C.all_gather(Tensor(xs[me]), g, dim=1), np.concatenate(xs, 1))
    check(f"{tag}/reduce_scatter_dim0", C.reduce_scatter(view, g), np.split(total, n, 0)[me])
    ys = [data(r, (3, 2 * n), 1) for r in members]
    check(f"{tag}/reduce_scatter_dim1_avg", C.reduce_scatter(Tensor(ys[me]), g, dim=1, op="avg"),
          np.split(sum(ys) / n, n, 1)[me])
    check(f"{tag}/all_to_all_equal", C.all_to_all(Tensor(xs[me]), g),
          np.concatenate([np.split(xs[j], n, 0)[me] for j in range(n)], 0))
    # unequal: member i sends (i + j) % 3 rows to member j (some zero)
    splits = [[(i + j) % 3 for j in range(n)] for i in range(n)]
    zs = [data(r, (sum(splits[i]), 5), 2) for i, r in enumerate(members)]

    def chunk(i, j):
        off = sum(splits[i][:j])
        return zs[i][off:off + splits[i][j]]

    want = np.concatenate([chunk(j, me) for j in range(n)], 0)
    recv = [splits[j][me] for j in range(n)]
    check(f"{tag}/all_to_all_unequal", C.all_to_all(Tensor(zs[me]), g, splits[me], recv), want)
    check(f"{tag}/all_to_all_unequal_auto_recv", C.all_to_all(Tensor(zs[me]), g, splits[me]), want)
    src = n - 1
    check(f"{tag}/broadcast", C.broadcast(Tensor(xs[me]), src, g), xs[src])
    check(f"{tag}/broadcast_int", C.broadcast(Tensor(np.arange(5) * (me + 1)), src, g), np.arange(5) * n)
    # send/recv ring; even members send first so the blocking calls pair up
    nxt, prv = (me + 1) % n, (me - 1) % n
    payload = Tensor(xs[me][:, :, 0])
    if me % 2 == 0:
        C.send(payload, nxt, g)
        got = C.recv(payload.shape, payload.dtype, prv, g)
    else:
        got = C.recv(payload.shape, payload.dtype, prv, g)
        C.send(payload, nxt, g)
    check(f"{tag}/send_recv_ring", got, xs[prv][:, :, 0])
    # three messages in a row, the second large enough to move the channel to a bigger segment
    msgs = {r: [data(r, (7,), 6), data(r, (300_000,), 7), data(r, (3, 2), 8)] for r in members}
    if me % 2 == 0:
        for m in msgs[members[me]]:
            C.send(Tensor(m), nxt, g)
        got3 = [C.recv(m.shape, ms.float32, prv, g) for m in msgs[members[prv]]]
    else:
        got3 = [C.recv(m.shape, ms.float32, prv, g) for m in msgs[members[prv]]]
        for m in msgs[members[me]]:
            C.send(Tensor(m), nxt, g)
    check(f"{tag}/send_recv_three", np.concatenate([t.asnumpy().reshape(-1) for t in got3]),
          np.concatenate([m.reshape(-1) for m in msgs[members[prv]]]))
    C.barrier(g)

    # differentiable forms: loss_r = sum(c_r * f(x_r)); the sum of losses over members has
    # a known gradient for x_me.
    cs = [data(r, (4 * n * n, 3, 2), 3) for r in members]

    def grad(f, x, c):
        return ms.grad(lambda t: (f(t) * Tensor(c)).sum())(Tensor(x))

    c_ag = [c[:4 * n * n] for c in cs]
    check(f"{tag}/d_all_gather", grad(lambda t: F.all_gather(t, g), xs[me], c_ag[me]),
          np.split(sum(c_ag), n, 0)[me])
    c_rs = [c[:4] for c in cs]
    check(f"{tag}/d_reduce_scatter", grad(lambda t: F.reduce_scatter(t, g), xs[me], c_rs[me]),
          np.concatenate(c_rs, 0))
    c_a2a = [data(r, (sum(splits[j][i] for j in range(n)), 5), 4) for i, r in enumerate(members)]
    # reverse exchange: the rows member me sent to j come back from j's coefficient block
    back = []
    for j in range(n):
        off = sum(splits[k][j] for k in range(me))
        back.append(c_a2a[j][off:off + splits[me][j]])
    check(f"{tag}/d_all_to_all", grad(lambda t: F.all_to_all(t, g, splits[me], recv), zs[me], c_a2a[me]),
          np.concatenate(back, 0))
    c_cp = [c[:4 * n] for c in cs]
    check(f"{tag}/d_copy_to_group", grad(lambda t: F.copy_to_group(t, g), xs[me], c_cp[me]), sum(c_cp))
    check(f"{tag}/d_reduce_from_group_fwd", F.reduce_from_group(Tensor(xs[me]), g), total)
    check(f"{tag}/d_reduce_from_group", grad(lambda t: F.reduce_from_group(t, g), xs[me], c_cp[me]),
          c_cp[me])
    c_sp = [c[:4] for c in cs]
    check(f"{tag}/d_split_to_group", grad(lambda t: F.split_to_group(t, g), xs[0], c_sp[me]),
          np.concatenate(c_sp, 0))


mesh = DeviceMesh.from_config(ParallelismConfig(), world, rank).init_process_groups()
run_group("world", mesh.group("dp"))
if world == 4:
    sub = DeviceMesh.from_config(ParallelismConfig(tensor_parallel=2), world, rank).init_process_groups()
    run_group("dp_of_tp2", sub.group("dp"))  # ranks {0,2} and {1,3}
    run_group("tp2", sub.group("tp"))  # ranks {0,1} and {2,3}

with open(f"{out_dir}/collectives_{rank}.json", "w") as f:
    json.dump(errors, f)
print(f"rank {rank} done: {len(errors)} checks, max error {max(errors.values()):.3g}", flush=True)
