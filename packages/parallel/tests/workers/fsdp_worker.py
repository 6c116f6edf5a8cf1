"""msrun worker: FSDP (three strategies) against the single-process run of the same model.

    python fsdp_worker.py reference REF.npz     # the single-process run, once per test module
    msrun ... fsdp_worker.py OUT_DIR REF.npz    # every rank compares against REF.npz

The reference trains one process on the full global batch, no sharding; each rank then
trains each strategy with the global batch split over ranks and over two accumulation
micro-batches, global-norm clipping on. Writes <out>/fsdp_<rank>.json.
"""

import os

# Before mindspore starts its threads (they inherit the mask): its runtime threads otherwise
# spread over every core and, with more ranks than cores, burn about a third more CPU time.
# msrun rank r takes core r mod #cores, the plain reference process the last one.
_cpus = sorted(os.sched_getaffinity(0))
_rank_id = os.environ.get("RANK_ID")
os.sched_setaffinity(0, {_cpus[int(_rank_id) % len(_cpus)] if _rank_id is not None else _cpus[-1]})

import json
import sys
import time

import numpy as np

import mindspore as ms
from mindspore import Tensor

from mindtrain.config import ParallelismConfig
from mindtrain.parallel import DeviceMesh, Group, collectives as C, fully_shard, init_distributed
from tiny_lm import SHARED, UNITS, AdamW, TinyLM, batch

ms.set_device("CPU")
ms.runtime.launch_blocking()  # eager ops in the calling thread, as the trainer runs them on CPU
STEPS, ACCUM, MAX_NORM, GLOBAL = 2, 2, 1.0, 8


def rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))


def tensor_bytes(ts):
    return int(sum(t.size * t.itemsize for t in ts))


# ---- single-process reference -----------------------------------------------------------
def reference(path):
    """Train one process on the full batch; save per-step losses and norms, the bytes it
    holds, its final weights and AdamW first moments, and its loss on the next batch."""
    ref = TinyLM()
    ref_named = [(p.name, p) for p in ref.trainable_params()]
    ref_opt = AdamW(ref_named)
    ref_grad = ms.value_and_grad(ref, None, weights=[p for _, p in ref_named])
    ref_losses, ref_norms = [], []
    for step in range(STEPS):
        ids, labels = batch(step, GLOBAL)
        loss, grads = ref_grad(Tensor(ids), Tensor(labels))
        norm = float(np.sqrt(sum((g.asnumpy().astype(np.float64) ** 2).sum() for g in grads)))
        coef = MAX_NORM / (norm + 1e-6)
        if coef < 1:
            grads = [g * coef for g in grads]
        if step == 0:
            ref_bytes = (tensor_bytes([p for _, p in ref_named]) + tensor_bytes(grads)
                         + ref_opt.state_bytes())
        ref_opt.step(grads)
        ref_losses.append(float(loss.asnumpy()))
        ref_norms.append(norm)
    ids, labels = batch(STEPS, GLOBAL)
    ref_next = float(ref(Tensor(ids), Tensor(labels)).asnumpy())
    arrays = {f"state/{n}": p.asnumpy() for n, p in ref_named}
    arrays.update({f"m/{n}": m for (n, _), m in zip(ref_named, ref_opt.m)})
    tmp = path + ".tmp.npz"
    np.savez(tmp, losses=np.array(ref_losses), norms=np.array(ref_norms), bytes=np.array(ref_bytes),
             full_param_bytes=np.array(tensor_bytes([p for _, p in ref_named])), next_loss=np.array(ref_next),
             **arrays)
    os.replace(tmp, path)  # the msrun ranks wait for this file


def load_reference(path):
    """The reference's results (it runs beside the msrun job: wait for its file)."""
    deadline = time.monotonic() + 1200
    while not os.path.exists(path):
        if os.path.exists(path + ".error") or time.monotonic() > deadline:
            raise RuntimeError(f"no single-process reference at {path}")
        time.sleep(0.5)
    return np.load(path)


if sys.argv[1] == "reference":
    try:
        reference(sys.argv[2])
    except BaseException:
        open(sys.argv[2] + ".error", "w").close()
        raise
    sys.exit(0)

world, rank = init_distributed()
mesh = DeviceMesh.from_config(ParallelismConfig(), world, rank).init_process_groups()
dp = mesh.group("dp")
out_dir = sys.argv[1]
_ref = load_reference(sys.argv[2])
ref_losses, ref_norms = _ref["losses"].tolist(), _ref["norms"].tolist()
ref_bytes, full_param_bytes = int(_ref["bytes"]), int(_ref["full_param_bytes"])
ref_state = {k[len("state/"):]: _ref[k] for k in _ref.files if k.startswith("state/")}
ref_m = {k[len("m/"):]: _ref[k] for k in _ref.files if k.startswith("m/")}

results = {"world": world, "ref_bytes": ref_bytes, "ref_losses": ref_losses, "units": len(UNITS),
           "micro_steps": STEPS * ACCUM}
micro = GLOBAL // (world * ACCUM)


def train(strategy, param_groups=None, reshard_after_forward=True, bucket_bytes=0):
    model = TinyLM()
    fsdp = fully_shard(model, mesh, units=UNITS, strategy=strategy, shared=SHARED, param_groups=param_groups,
                       reshard_after_forward=reshard_after_forward, bucket_bytes=bucket_bytes)
    opt = AdamW(fsdp.named_parameters())

    def loss_fn(ids, labels):
        return model(ids, labels) / ACCUM

    step_fn = fsdp.value_and_grad(loss_fn)
    losses, norms = [], []
    for step in range(STEPS):
        ids, labels = batch(step, GLOBAL)
        local = 0.0
        for k in range(ACCUM):
            rows = slice((rank * ACCUM + k) * micro, (rank * ACCUM + k + 1) * micro)
            local += float(step_fn(Tensor(ids[rows]), Tensor(labels[rows])).asnumpy())
        losses.append(float(C.all_reduce(Tensor([local]), dp, op="avg").asnumpy()[0]))
        if step == 0:  # before ZeRO-1 reduces its full local gradients to shards
            mem = fsdp.memory_bytes()
            held = mem["params"] + mem["grads"] + opt.state_bytes()
        norms.append(fsdp.clip_grad_norm(MAX_NORM))
        grads = fsdp.grads
        opt.step(grads)
        fsdp.finish_step()
    state = fsdp.full_state_dict()
    m_full = dict(zip([n for n, _ in fsdp.named_parameters()],
                      fsdp.gather_full([Tensor(m) for m in opt.m])))
    return {
        "loss_rel": max(rel(a, b) for a, b in zip(losses, ref_losses)),
        "norm_rel": max(rel(a, b) for a, b in zip(norms, ref_norms)),
        "param_rel": max(rel(state[n], ref_state[n]) for n in ref_state),
        "adam_m_rel": max(rel(m_full[n], ref_m[n]) for n in ref_state),
        "clipped": int(ref_norms[0] > MAX_NORM),
        "bytes": held, "bytes_ratio": held / ref_bytes,
        "peak_gathered_bytes": fsdp.peak_gathered_bytes, "gathers": fsdp.gather_count,
        # what ZeRO-3 holds gathered at its peak: the root (for the micro-batch) and one unit
        "root_plus_unit_bytes": 4 * (sum(int(np.prod(s.shape)) for s in fsdp.root.slots)
                                     + max((sum(int(np.prod(s.shape)) for s in b.slots) for b in fsdp.units),
                                           default=0)),
        "full_param_bytes": full_param_bytes,
        "losses": losses,
    }, state


for strategy in ("optim", "optim_grads", "optim_grads_params"):
    results[strategy], last_state = train(strategy)
    print(f"rank {rank} {strategy}: {results[strategy]}", flush=True)
if world == 2:
    # MLP weights sharded over a second group object (same members): two collectives per
    # unit, the path expert weights take when sharded over "edp".
    mlp = {f"blocks.{i}.{w}": "dp_cp" for i in range(2) for w in ("w1", "w2", "b1")}
    results["param_groups"], _ = train("optim_grads_params", mlp)
    # reshard_after_forward_policy "never": each unit stays gathered from forward to backward
    results["no_reshard"], _ = train("optim_grads_params", reshard_after_forward=False)
    # every unit in one bucket: gathered by one collective, gradients reduce-scattered by one
    results["one_bucket"], _ = train("optim_grads_params", bucket_bytes=1 << 30)

# Full-state import into another data-parallel degree: the N-way ZeRO-3 export into a
# 1-rank FSDP, and the single-process weights into an N-way ZeRO-3 model.
alone = fully_shard(TinyLM(seed=7), Group("dp", (rank,), 0), units=UNITS, shared=SHARED)
alone.load_full_state_dict(last_state)
back = alone.full_state_dict()
results["import_into_dp1_rel"] = max(rel(back[n], ref_state[n]) for n in ref_state)
wide = fully_shard(TinyLM(seed=7), mesh, units=UNITS, shared=SHARED)
wide.load_full_state_dict(ref_state)
ids, labels = batch(STEPS, GLOBAL)
rows = slice(rank * (GLOBAL // world), (rank + 1) * (GLOBAL // world))
loss = wide.value_and_grad(lambda i, t: wide.model(i, t))(Tensor(ids[rows]), Tensor(labels[rows]))
loss = float(C.all_reduce(Tensor([float(loss.asnumpy())]), dp, op="avg").asnumpy()[0])
results["import_into_dpN_loss_rel"] = rel(loss, float(_ref["next_loss"]))
results["import_shards_rel"] = max(rel(wide.full_state_dict()[n], ref_state[n]) for n in ref_state)

with open(f"{out_dir}/fsdp_{rank}.json", "w") as f:
    json.dump(results, f)
print(f"rank {rank} done", flush=True)
