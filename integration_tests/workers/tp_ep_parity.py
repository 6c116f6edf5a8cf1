"""Train the tiny DeepSeek-V3 for a few steps under TP / EP / FSDP layouts (or alone).

``python tp_ep_parity.py OUT_DIR CASE[,CASE...]`` under msrun (or plain python for
``ref``). Every case builds the model with the same name-seeded weights, applies its
layout, trains STEPS steps of GLOBAL sequences as ACC micro-batches per rank (the trainer's
AdamW, aux-loss-free bias update with the global expert load), and rank 0 writes
``OUT_DIR/<case>.npz``: per-step losses, every final parameter at full shape, and the
per-rank parameter / activation bytes measured on this rank.
"""

from __future__ import annotations

import os
import sys
from dataclasses import replace


from pinning import pin_to_one_core  # noqa: E402  (before numpy / mindspore)

pin_to_one_core()

import numpy as np

import mindspore as ms
from mindspore import Tensor

from mindtrain.config import ParallelDims, load_config
from mindtrain.models import apply_compile, build_model, is_compiled, parallel_plan
from mindtrain.parallel import collectives as C, fully_shard, init_distributed
from mindtrain.parallel.expert_parallel import apply_expert_parallel, global_expert_load
from mindtrain.parallel.tensor_parallel import apply_tensor_parallel, param_bytes
from mindtrain.trainer.estimate import estimate
from mindtrain.trainer.optimizer import AdamW
from shards_check import check_shards
from synthetic import mesh_with_groups, seed_weights, tokens

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STEPS, GLOBAL, ACC, SEQ = int(os.environ.get("TP_EP_STEPS", 3)), 8, 2, 16
# case -> (dp_shard, tp, ep, fsdp)
CASES = {"ref": (1, 1, 1, False), "tp2": (1, 2, 1, False), "ep2": (2, 1, 2, False),
         "tp2_fsdp2": (2, 2, 1, True), "ep2_fsdp2": (2, 1, 2, True), "ep2_fsdp4": (4, 1, 2, True),
         "tp2_ep2_fsdp2": (2, 2, 2, True), "ep2_fsdp4_dedup": (4, 1, 2, True)}
# cases whose expert parallelism dispatches with alltoall_deredundancy (one row per token and
# destination rank) instead of alltoall (one row per token and chosen expert)
DEDUP = {"ep2_fsdp4_dedup"}
# cases laid out by ShardedLayout (mindtrain.parallel's composition, as the trainer runs it)
# from a compiled model: TP=2 x EP=2 x ZeRO-3 over dp=2 (EP over the dp ranks), per-layer
# units whose compiled pieces run between the collectives
LAYOUT_CASES = {"tp2_ep2_zero3_compiled": (2, 2, 2), "tp2_ep2_etp1": (2, 2, 2)}
# layout cases with MindFormers' expert_tensor_parallel: 1 (routed experts whole on both TP
# ranks, each dispatching its own sequence shard over its EP group)
ETP1 = {"tp2_ep2_etp1"}


def model_config():
    cfg = load_config(os.path.join(ROOT, "configs", "pynative_ds3_tiny.yaml"), validate=False)
    # one dense and one MoE decoder layer plus the MoE MTP module: every kind of block, less time
    return replace(cfg.model, seq_length=SEQ, num_hidden_layers=2)


def build():
    model = build_model(model_config(), jit=False)
    # norms ones, correction biases zeros
    seed_weights(model.get_parameters(), 0.02, ("norm.weight", "layernorm.weight", "e_score_correction_bias"))
    return model


def data(step):
    return tokens(step, GLOBAL, SEQ)


def activation_bytes(model, ids, labels):
    """Bytes of every Cell output in one forward (a measure of live activations)."""
    total = [0]

    def hook(cell, inputs, outputs):
        outs = outputs if isinstance(outputs, (tuple, list)) else (outputs,)
        for o in outs:
            if isinstance(o, Tensor):
                total[0] += int(o.size) * o.itemsize

    handles = [c.register_forward_hook(hook) for _, c in model.cells_and_names()]
    model(Tensor(ids), Tensor(labels))
    for h in handles:
        h.remove()
    model.take_expert_load()
    return total[0]


def run_layout(case, world, rank, out_dir):
    """A case laid out by ShardedLayout: the model compiled (whole layers, as the trainer
    builds it; the layout picks regions), the trainer's step (run_step, gradients,
    grad_norm, AdamW, finish_step, the global expert load)."""
    from mindtrain.parallel.compose import ShardedLayout

    dp, tp_size, ep_size = LAYOUT_CASES[case]
    dims = ParallelDims(world_size=dp * tp_size, pp=1, dp_shard=dp, cp=1, tp=tp_size, ep=ep_size)
    assert dims.world_size == world, (case, world)
    mesh = mesh_with_groups(dims, rank)
    overrides = (["parallelism.data_parallel_shard_strategy=optim_grads_params",
                  f"parallelism.tensor_parallel={tp_size}", f"parallelism.expert_parallel={ep_size}"]
                 + (["parallelism.expert_tensor_parallel=1"] if case in ETP1 else []))
    config = load_config(os.path.join(ROOT, "configs", "pynative_ds3_tiny.yaml"), overrides, validate=False)
    model = build()
    apply_compile(model)
    plan = parallel_plan(model)
    layout = ShardedLayout(model, plan, mesh, config, ACC, ["input_ids", "labels"])
    opt = AdamW(layout.named_params, lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.01)
    dpg = mesh.group("dp_cp")
    d = dpg.index
    micro = GLOBAL // (dpg.size * ACC)
    losses, norms = [], []
    for step in range(STEPS):
        ids, labels = data(step)
        rows = [slice((d * ACC + m) * micro, (d * ACC + m + 1) * micro) for m in range(ACC)]
        figures = layout.run_step([{"input_ids": ids[r], "labels": labels[r]} for r in rows])
        grads = layout.gradients()
        norms.append(layout.grad_norm(grads))
        opt.step(grads)
        layout.finish_step()
        model.update_expert_bias(layout.expert_load())
        local_loss = sum(f.loss for f in figures) / ACC
        losses.append(float(C.all_reduce(Tensor([local_loss]), dpg, op="avg").asnumpy()[0]))
    state = layout.to_full([t for _, t in layout.named_params])
    check_shards(layout, state)  # what a sharded checkpoint writes and reads back
    for router in model.moe_routers():  # untrained: the aux-loss-free bias update's
        bias = router.e_score_correction_bias
        state[bias.name] = bias.asnumpy()
    fsdp = layout.fsdp
    result = {"losses": np.array(losses), "grad_norms": np.array(norms),
              "compiled": is_compiled(model), "units": len(fsdp.units), "transport": C.transport(),
              "whole_layers": sum(layer.can_run_whole() for layer in model.model.layers),
              "param_bytes_layout": layout.memory_bytes(),
              "shard_bytes": sum(int(p.size) * p.itemsize for p in fsdp.params),
              "expert_bytes": layout.ep.param_bytes() if layout.ep is not None else 0}
    # mindtrain-estimate's bytes of this rank (parameters resident between steps, AdamW state)
    # for the same config and sizes, loaded as the trainer loads it
    est = estimate(load_config(os.path.join(ROOT, "configs", "pynative_ds3_tiny.yaml"), overrides
                               + [f"model.seq_length={SEQ}", f"train_dataset.dataloader.config.seq_length={SEQ}",
                                  "model.num_hidden_layers=2", f"training.global_batch_size={GLOBAL}"],
                               world_size=world), world, "CPU").stages[0]
    result.update(param_bytes_estimate=est.params, optimizer_bytes=opt.state_bytes(),
                  optimizer_bytes_estimate=est.optimizer)
    if rank == 0:
        np.savez(os.path.join(out_dir, f"{case}.npz"), **result, **{f"p:{n}": v for n, v in state.items()})
    C.barrier()
    return losses


def run(case, world, rank, out_dir):
    if case in LAYOUT_CASES:
        return run_layout(case, world, rank, out_dir)
    dp, tp_size, ep_size, fsdp_on = CASES[case]
    dims = ParallelDims(world_size=dp * tp_size, pp=1, dp_shard=dp, cp=1, tp=tp_size, ep=ep_size)
    assert dims.world_size == world, (case, world)
    mesh = mesh_with_groups(dims, rank)
    model = build()
    plan = parallel_plan(model)
    full_bytes = param_bytes(model)
    tp = apply_tensor_parallel(model, plan, mesh)
    ep = apply_expert_parallel(model, plan, mesh, "alltoall_deredundancy" if case in DEDUP else "alltoall")
    local_bytes = param_bytes(model)
    dpg = mesh.group("dp_cp")
    d = dpg.index
    acc = ACC
    micro = GLOBAL // (dpg.size * acc)
    ids0, labels0 = data(0)
    # one sequence; only the reference and TP=2 figures are asserted, so only they pay the forward
    act = activation_bytes(model, ids0[:1], labels0[:1]) if case in ("ref", "tp2", "tp2_fsdp2", "tp2_ep2_fsdp2") else -1

    dense = [(p.name, p) for p in model.trainable_params()]
    fsdp = None
    if fsdp_on:
        fsdp = fully_shard(model, mesh, units=(), strategy="optim_grads_params")
        dense_named = fsdp.named_parameters()
    else:
        dense_named = dense
    opt = AdamW(dense_named + ep.named_parameters(), lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.01)
    names = [n for n, _ in dense_named]

    def loss_fn(ids, labels):
        loss, _ = model(ids, labels)
        return loss / acc

    if fsdp is not None:
        step_fn = fsdp.value_and_grad(loss_fn)
    else:
        grad_fn = ms.value_and_grad(loss_fn, None, weights=[p for _, p in dense])

    losses, norms = [], []
    for step in range(STEPS):
        ids, labels = data(step)
        local_loss, grads = 0.0, None
        for m in range(acc):
            row = slice((d * acc + m) * micro, (d * acc + m + 1) * micro)
            if fsdp is not None:
                value = step_fn(Tensor(ids[row]), Tensor(labels[row]))
            else:
                value, g = grad_fn(Tensor(ids[row]), Tensor(labels[row]))
                grads = list(g) if grads is None else [a + b for a, b in zip(grads, g)]
            local_loss += float(value.asnumpy())
        if fsdp is not None:
            grads = fsdp.grads
        elif dpg.size > 1:
            grads = [C.all_reduce(g, dpg, op="avg") for g in grads]
        grads = tp.sync_grads(names, grads)
        if case == "ref":
            norms.append(float(np.sqrt(sum(np.sum(g.asnumpy().astype(np.float64) ** 2) for g in grads))))
        opt.step(list(grads) + ep.grads)
        if fsdp is not None:
            fsdp.finish_step()
        ep.zero_grad()
        load = global_expert_load(model.take_expert_load(), mesh)
        model.update_expert_bias(load)
        losses.append(float(C.all_reduce(Tensor([local_loss]), dpg, op="avg").asnumpy()[0]))

    # final parameters at full shape
    if fsdp is not None:
        state = fsdp.full_state_dict()
    else:
        state = {n: p.asnumpy() for n, p in dense}
    for p in model.get_parameters():
        if not p.requires_grad and p.name not in ep.slots:
            state[p.name] = p.asnumpy()  # router correction biases
    state = {n: tp.full_param(n, state[n]) for n in sorted(state)}
    state.update(ep.full_state())
    result = {"losses": np.array(losses), "grad_norms": np.array(norms), "param_bytes_full": full_bytes, "param_bytes_local": local_bytes,
              "activation_bytes": act, "ep_sent_bytes": ep.sent_bytes}
    if fsdp is not None:
        result["fsdp_param_bytes"] = sum(int(p.size) * p.itemsize for _, p in fsdp.named_parameters()) \
            + ep.memory_bytes()
    if rank == 0:
        np.savez(os.path.join(out_dir, f"{case}.npz"), **result, **{f"p:{n}": v for n, v in state.items()})
    C.barrier()
    return losses


def main():
    ms.set_device("CPU")
    ms.runtime.launch_blocking()  # eager ops in the calling thread, as the trainer runs them on CPU
    world, rank = init_distributed()
    out_dir, cases = sys.argv[1], sys.argv[2].split(",")
    for case in cases:
        losses = run(case, world, rank, out_dir)
        print(f"rank {rank} {case} losses {losses}", flush=True)


if __name__ == "__main__":
    main()
