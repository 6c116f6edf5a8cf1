"""Train the tiny DeepSeek-V4 for a few steps under the layouts (or alone), compiled.

``python v4_layouts.py OUT_DIR CASE[,CASE...]`` under msrun (or plain python for ``ref``).
Every case loads ``configs/pynative_ds4_tiny.yaml`` with its parallel degrees (validated as
the trainer validates them), builds the model with the same name-seeded weights, compiles
it, lays it out through :func:`mindtrain.parallel.parallelize` (the trainer's entry point),
trains STEPS steps of the same GLOBAL sequences (the trainer's AdamW, clipping's global
grad norm, the aux-loss-free bias update with the global expert load; attention and hidden
dropout 0.1, each step's masks drawn from training.seed and the step), and rank 0 writes
``OUT_DIR/<case>.npz``: per-step losses and grad norms, every final parameter at full shape
and the bytes this rank holds. Cases named ``ref*`` run in one process (each after the other),
the others under msrun; a context-parallel case ``cpN*`` has its own reference ``ref_cpN*`` (its
``_ulysses`` form the same one; test_v4_context_parallel.py).
"""

from __future__ import annotations

import os
import sys


from pinning import pin_to_one_core  # noqa: E402  (before numpy / mindspore)

pin_to_one_core()

import numpy as np  # noqa: E402

import mindspore as ms  # noqa: E402
from mindspore import Tensor  # noqa: E402

from mindtrain.config import ParallelDims, load_config  # noqa: E402
from mindtrain.models import apply_compile, build_model, is_compiled, parallel_plan  # noqa: E402
from mindtrain.parallel import DeviceMesh, collectives as C, init_distributed, parallelize  # noqa: E402
from mindtrain.parallel.pipeline_parallel import relax_receive_timeout  # noqa: E402
from mindtrain.trainer.estimate import estimate  # noqa: E402
from mindtrain.trainer.optimizer import AdamW  # noqa: E402
from synthetic import mesh_with_groups, seed_weights, tokens  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIG = os.path.join(ROOT, "configs", "pynative_ds4_tiny.yaml")
STEPS, GLOBAL, SEQ = int(os.environ.get("V4_STEPS", 2)), 2, 32
PLAIN = ["model.enable_hyper_connections=false", "model.enable_hc_head=false", "model.qk_layernorm=false"]
# case -> (pp, dp_shard, tp, ep, overrides); one process takes the global batch as 4 micro-batches
CASES = {
    "ref": (1, 1, 1, 1, []),
    # tensor parallelism with sequence parallelism: query heads, sinks and the output
    # projection's groups split, the shared key/value head, compressors and indexer whole,
    # the hyper-connection streams split along the sequence, hash routing by each shard's ids
    "tp2": (1, 1, 2, 1, []),
    # expert parallelism over the two data-parallel ranks, ZeRO-3 per decoder layer
    "ep2_zero3": (1, 2, 1, 2, ["parallelism.data_parallel_shard_strategy=optim_grads_params"]),
    # two pipeline stages: the streams [B, S, hc, H] between them, the token ids on both
    "pp2": (2, 1, 1, 1, []),
    # issue 34: plain residual layers (no hyper-connection streams) without the query-latent /
    # key-value norms, two pipeline stages: the one residual [B, S, H] between them; its own
    # one-process reference ``ref_plain``
    "ref_plain": (1, 1, 1, 1, PLAIN),
    "pp2_plain": (2, 1, 1, 1, PLAIN),
    # not in the test's job (its time): ZeRO-1 / ZeRO-2 over two data-parallel ranks
    "zero1": (1, 2, 1, 1, ["parallelism.data_parallel_shard_strategy=optim"]),
    "zero2": (1, 2, 1, 1, ["parallelism.data_parallel_shard_strategy=optim_grads"]),
    "zero3": (1, 2, 1, 1, ["parallelism.data_parallel_shard_strategy=optim_grads_params"]),
    "ep2": (1, 2, 1, 2, []),
}
MODEL = [f"model.seq_length={SEQ}", f"train_dataset.dataloader.config.seq_length={SEQ}",
         # two layers: compressed sparse (its indexer choosing 4 of 8 entries; hash-routed) and
         # heavily compressed (learned routing), each with a sliding window shorter than the
         # sequence; fewer Sinkhorn iterations than the config's 20 (the same code, less time)
         "model.num_hidden_layers=2", "model.compress_ratios=[4, 16]", "model.sliding_window=16",
         "model.index_topk=4", "model.hc_sinkhorn_iters=4", f"training.global_batch_size={GLOBAL}",
         # attention and hidden dropout in every case (issue 34): the masks are a hash of the
         # seed, the step and each token's sample and position, the same in every layout
         "model.attention_dropout=0.1", "model.hidden_dropout=0.1"]
# MindFormers' published variant: DeepSeek-V3's attention in every layer, an MTP module
MLA = ["model.experimental_attention_variant=mla", "model.kv_lora_rank=32", "model.qk_nope_head_dim=16",
       "model.v_head_dim=16", f"model.num_nextn_predict_layers={os.environ.get('V4_MTP', '1')}",
       "model.enable_hc_head=false"]
if os.environ.get("V4_VARIANT") == "mla":
    MODEL += MLA
# context parallelism (test_v4_context_parallel.py), each case with its one-process ``ref_*``,
# the global batch in one micro-batch: 32 tokens in 4 load-balanced chunks of 8; one decoder
# layer (hash-routed) and an MTP module (learned routing; its attention under CP, its inputs
# shifted across the chunks). Hybrid: the layer compressed sparse (each chunk two ratio-4
# windows, the boundary window from the chunk before, the indexer choosing 4 of 8 entries),
# the MTP module sliding-window, each with a 15-key halo from the two chunks before
CP = ["model.num_hidden_layers=1", "model.compress_ratios=[4]", "model.num_nextn_predict_layers=1"]
ONE_MICRO_BATCH = set()
for name, extra in (("cp2", CP), ("cp2_mla", CP + MLA)):
    CASES["ref_" + name] = (1, 1, 1, 1, extra)
    CASES[name] = (1, 1, 1, 1, extra + ["parallelism.context_parallel=2"])
    # Ulysses (issue 34), against the same reference: the hybrid attention's queries to 2 of
    # the 4 heads of the whole sequence by all-to-all, its shared keys and entries all-gathered;
    # mla: DeepSeek-V3's Ulysses core
    CASES[name + "_ulysses"] = (1, 1, 1, 1, extra + ["parallelism.context_parallel=2",
                                                     "parallelism.context_parallel_method=ulysses"])
    ONE_MICRO_BATCH |= {name, "ref_" + name, name + "_ulysses"}


def config(case: str):
    pp, dp, tp, ep, extra = CASES[case]
    cp = 2 if "parallelism.context_parallel=2" in extra else 1
    return load_config(CONFIG, MODEL + [f"parallelism.pipeline_parallel={pp}", f"parallelism.tensor_parallel={tp}",
                                        f"parallelism.expert_parallel={ep}", *extra],
                       world_size=pp * dp * cp * tp)


def build(cfg):
    model = build_model(cfg.model, jit=False)
    seed_weights(model.trainable_params(), 0.05, ("norm.weight", "layernorm.weight", ".scale", "hc_scale"))  # ones
    apply_compile(model)
    return model


def data(step):
    return tokens(step, GLOBAL, SEQ)


def run(case, world, rank, out_dir):
    pp, dp, tp, ep, _ = CASES[case]
    cfg = config(case)
    cp = cfg.parallelism.context_parallel
    dims = ParallelDims(world_size=pp * dp * cp * tp, pp=pp, dp_shard=dp, cp=cp, tp=tp, ep=ep)
    assert dims.world_size == world, (case, world)
    mesh = mesh_with_groups(dims, rank) if dims.world_size > 1 else DeviceMesh(dims, rank)
    model = build(cfg)
    plan = parallel_plan(model)
    acc = 1 if case in ONE_MICRO_BATCH else GLOBAL // dp  # else one sequence per micro-batch
    mbs = GLOBAL // dp // acc
    layout = parallelize(model, plan, mesh, cfg, accumulation=acc, columns=["input_ids", "labels"], connect=False)
    # eps 1e-6, not 1e-8: layer 0's hyper-connection streams are identical copies of the
    # embedding, and the norm after the collapse makes the loss blind to the collapse weights'
    # scale and to the Sinkhorn mixing, so those rows of attn_hc.fn / base / scale get
    # gradients of float round-off only (1e-9 .. 1e-12, analytically 0); with eps 1e-8 AdamW
    # turns that round-off into updates of about lr that differ between any two summation
    # orders (one process against another would differ as much). Real gradients here are
    # 1e-4 .. 1e-1, far above eps either way.
    opt = AdamW(layout.named_params, lr=1e-3, betas=(0.9, 0.95), eps=1e-6, weight_decay=0.01)
    d = mesh.group("dp").index  # CP ranks take the same sequences (the layout cuts them)
    losses, norms = [], []
    import time
    for step in range(STEPS):
        t0 = time.perf_counter()
        ids, labels = data(step)
        rows = [slice((d * acc + m) * mbs, (d * acc + m + 1) * mbs) for m in range(acc)]
        model.dropout.begin_step(step + 1, cfg.training.seed)  # the trainer's: on for the step's forwards
        figures = layout.run_step([{"input_ids": ids[r], "labels": labels[r]} for r in rows])
        model.dropout.end_step()
        grads = layout.gradients()
        norms.append(layout.grad_norm(grads))
        opt.step(grads)
        layout.finish_step()
        model.update_expert_bias(layout.expert_load())
        local = sum(f.loss for f in figures) / len(figures)
        print(f"{case} step {step} {time.perf_counter() - t0:.2f}s", flush=True)
        losses.append(float(C.all_reduce(Tensor([local]), mesh.group("dp"), op="avg").asnumpy()[0])
                      if world > 1 and mesh.group("dp").size > 1 else local)
    state = layout.to_full([t for _, t in layout.named_params])
    for i, layer in enumerate(model.model.layers):  # untrained: the aux-loss-free bias update's
        gate = layer.mlp.gate
        if hasattr(gate, "e_score_correction_bias"):
            state[gate.e_score_correction_bias.name] = gate.e_score_correction_bias.asnumpy()
    # mindtrain-estimate's bytes of this rank's stage (parameters resident between steps, AdamW state)
    est = estimate(cfg, world, "CPU").stages[mesh.group("pp").index]
    result = {"losses": np.array(losses), "grad_norms": np.array(norms), "compiled": is_compiled(model),
              "param_bytes_layout": layout.memory_bytes(), "param_bytes_estimate": est.params,
              "optimizer_bytes": opt.state_bytes() if hasattr(opt, "state_bytes") else -1,
              "optimizer_bytes_estimate": est.optimizer,
              # ZeRO-3 units releasing their weights in place (no forward replayed), as the trainer's
              "zero3_in_place": bool(getattr(layout.fsdp, "in_place", False)),
              # attention cells running Ulysses: the hybrid attention's all-to-all hook, or a replaced core
              "ulysses_cells": sum(getattr(layer.self_attn, "head_exchange", None) is not None or type(getattr(
                  getattr(layer.self_attn, "core_attention", None), "construct", None)).__name__ == "_UlyssesCore"
                  for layer in model.model.layers)}
    if rank == 0:
        np.savez(os.path.join(out_dir, f"{case}.npz"), **result, **{f"p:{n}": v for n, v in state.items()})
    if world > 1:
        C.barrier()


def main():
    out_dir, cases = sys.argv[1], sys.argv[2].split(",")
    ms.runtime.launch_blocking()  # eager ops in the calling thread, as the trainer runs them on CPU
    if all(c.startswith("ref") for c in cases):  # one process
        for case in cases:
            run(case, 1, 0, out_dir)
        return
    relax_receive_timeout()  # a pipeline stage waits a whole neighbour's step
    world, rank = init_distributed()
    for case in cases:
        run(case, world, rank, out_dir)


if __name__ == "__main__":
    main()
