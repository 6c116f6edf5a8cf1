"""Train the tiny DeepSeek-V3 for a few steps single-process or under CP / PP, and save the
per-step figures and final parameters.

    python cp_pp_parity.py reference OUT.npz [--docs]          # the single-process run
    msrun ... cp_pp_parity.py parallel OUT_DIR REF.npz NAME:pp:cp:schedule[:tp:ep:sharding:micro:chunks] ...

(data-parallel degree = workers / (pp x cp x tp); each data-parallel rank takes its share of
every step's ``micro`` micro-batches (default CP_PP_MICRO); ``chunks`` model chunks per
pipeline stage (interleaved 1F1B when > 1, default 1); ``sharding`` is the stage's FSDP
strategy over dp (optim / optim_grads / optim_grads_params) or "-" for none; a ``{micro}``
in REF.npz is replaced by the spec's micro-batch count, so specs can use different references).

The reference is the model's own ``construct`` (not the stage code under test) in the
trainer's loop: micro-batch mean losses averaged over accumulation, clipping, the
trainer's AdamW and the aux-loss-free bias update. Each parallel configuration rebuilds
the model from the same seed, runs the same steps through
:class:`mindtrain.parallel.pipeline_parallel.PipelineSchedule` and compares on every rank.
"""

from __future__ import annotations

import json
import os
import sys
import time


from pinning import pin_to_one_core  # noqa: E402  (before numpy / mindspore)

if os.environ.get("CP_PP_PIN", "1") == "1":  # the reference's core: CP_PP_REF_CORE spreads references
    pin_to_one_core(int(os.environ.get("CP_PP_REF_CORE", "-1")))

import numpy as np  # noqa: E402

import mindspore as ms  # noqa: E402

ms.set_device("CPU")
ms.runtime.launch_blocking()  # eager ops in the calling thread, as the trainer runs them on CPU

from mindspore import Tensor, ops  # noqa: E402

from mindtrain.config import load_config  # noqa: E402
from mindtrain.config import RecomputePlan  # noqa: E402
from mindtrain.models import apply_recompute, build_model, is_compiled, parallel_plan  # noqa: E402
from mindtrain.models.attention import max_attention_logits, track_max_attention_logits  # noqa: E402
from mindtrain.trainer.max_logits import synced_max_logits  # noqa: E402
from mindtrain.trainer.optimizer import AdamW  # noqa: E402
from shards_check import check_shards  # noqa: E402

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
SEQ = int(os.environ.get("CP_PP_SEQ", "16"))
STEPS = int(os.environ.get("CP_PP_STEPS", "3"))
MICRO = int(os.environ.get("CP_PP_MICRO", "3"))   # micro-batches per step (accumulation)
MBS = 1
LR, MAX_NORM = 1e-3, 1.0
OPTIMIZER = os.environ.get("CP_PP_OPT", "adamw")
# configurations (by name) whose parallel run builds the model's compiled layers; the others
# build eager ones (a few steps cost less than compiling every layer in every rank)
COMPILED = set(filter(None, os.environ.get("CP_PP_COMPILED", "").split(",")))


class SGD:
    """``p -= lr * g`` (ops.assign writes the Parameter in place on CPU)."""

    def __init__(self, named_params, lr):
        self.params = [p for _, p in named_params]
        self.lr = lr

    def step(self, grads):
        for p, g in zip(self.params, grads):
            ops.assign(p, p - self.lr * g)


def make_optimizer(named_params):
    if OPTIMIZER == "sgd":
        return SGD(named_params, lr=0.05)
    return AdamW(named_params, lr=LR, betas=(0.9, 0.95), weight_decay=0.01)


DROPOUT_SEED = 1234


def model_config(dropout: bool = False):
    """The tiny DeepSeek-V3; ``dropout``: attention and hidden dropout 0.1 (issue 34), whose
    masks each step draws from (DROPOUT_SEED, the step) whatever the layout."""
    cfg = load_config(os.path.join(ROOT, "configs", "pynative_ds3_tiny.yaml"),
                      [f"model.seq_length={SEQ}", f"train_dataset.dataloader.config.seq_length={SEQ}"]
                      + (["model.attention_dropout=0.1", "model.hidden_dropout=0.1"] if dropout else []),
                      validate=False)
    return cfg.model


def dropout_step(model, step: int):
    """Dropout on for training step ``step`` (1-based) when the model has it configured."""
    model.dropout.begin_step(step, DROPOUT_SEED)


def batches(docs: bool, micro: int = MICRO):
    """STEPS x ``micro`` micro-batches of [MBS, SEQ] synthetic tokens; with ``docs`` packed
    documents (EOD = 1, reset positions, compressed EOD mask, loss masked after EOD)."""
    rng = np.random.default_rng(7)
    out = []
    for _ in range(STEPS * micro):
        tok = rng.integers(2, 512, size=(MBS, SEQ + 1)).astype(np.int32)
        b = {}
        if docs:
            ends = np.full((MBS, 8), SEQ, np.int32)
            pos = np.zeros((MBS, SEQ), np.int32)
            for r in range(MBS):
                cuts = np.sort(rng.choice(np.arange(3, SEQ - 2), size=3, replace=False))
                tok[r, cuts] = 1
                ends[r, :3] = cuts + 1
                start = 0
                for e in list(cuts + 1) + [SEQ]:
                    pos[r, start:e] = np.arange(e - start)
                    start = e
            b["position_ids"] = pos
            b["attention_mask"] = ends
        b["input_ids"] = tok[:, :-1].copy()
        b["labels"] = tok[:, 1:].copy()
        mask = np.ones((MBS, SEQ), np.float32)
        if docs:
            mask[b["input_ids"] == 1] = 0.0
        b["loss_mask"] = mask
        out.append(b)
    return [out[i * micro:(i + 1) * micro] for i in range(STEPS)]


def fresh_model(jit: bool = False, dropout: bool = False):
    ms.set_seed(42)
    np.random.seed(42)
    # the reference runs eager layers; a parallel run named in COMPILED builds compiled ones,
    # which the schedule keeps where no layer is patched (PP alone, PP x FSDP ZeRO-1/2) and
    # turns eager otherwise
    return build_model(model_config(dropout), jit=jit)


def clip(grads, norm):
    coef = MAX_NORM / (norm + 1e-6)
    return [g * coef for g in grads] if coef < 1.0 else grads


def reference(out_path: str, docs: bool) -> None:
    model = fresh_model(dropout=os.environ.get("CP_PP_DROPOUT") == "1")
    track_max_attention_logits(model)  # the per-step max logits the "logits" runs compare with
    params = [(p.name, p) for p in model.trainable_params()]
    opt = make_optimizer(params)

    def fwd(ids, labels, mask, pos, att):
        loss, m = model(ids, labels=labels, loss_mask=mask, position_ids=pos, attention_mask=att)
        return loss, (m["lm_loss"], m["load_balancing_loss"], m["mtp_loss"])

    grad_fn = ms.value_and_grad(fwd, None, [p for _, p in params], has_aux=True)
    rows, logits = [], []
    for i, step in enumerate(batches(docs)):
        dropout_step(model, i + 1)
        acc, figs = None, []
        for b in step:
            t = [Tensor(b["input_ids"]), Tensor(b["labels"]), Tensor(b["loss_mask"]),
                 Tensor(b["position_ids"]) if "position_ids" in b else None,
                 Tensor(b["attention_mask"]) if "attention_mask" in b else None]
            (loss, (lm, bal, mtp)), grads = grad_fn(*t)
            acc = list(grads) if acc is None else [a + g for a, g in zip(acc, grads)]
            figs.append([float(lm.asnumpy()), float(bal.asnumpy()), float(mtp.asnumpy()), float(loss.asnumpy())])
        model.dropout.end_step()
        grads = [g / float(len(step)) for g in acc]
        norm = float(np.sqrt(sum(float((g * g).sum().asnumpy()) for g in grads)))
        opt.step(clip(grads, norm))
        model.update_expert_bias(model.take_expert_load())
        rows.append(np.mean(figs, axis=0).tolist() + [norm])
        table = max_attention_logits(model, reset=True)
        logits.append([table[j] for j in sorted(table)])
    final = {f"param/{p.name}": p.asnumpy() for p in model.get_parameters()}
    tmp = out_path + ".tmp.npz"
    np.savez(tmp, figures=np.array(rows), logits=np.array(logits), **final)
    os.replace(tmp, out_path)  # parallel workers wait for this file


def parallel(out_dir: str, ref_path: str, specs: list[str], docs: bool) -> None:
    from mindtrain.config import ParallelDims
    from mindtrain.parallel import DeviceMesh
    from mindtrain.parallel.collectives import init_distributed
    from mindtrain.parallel.pipeline_parallel import PipelineSchedule, relax_receive_timeout

    from mindtrain.parallel import collectives as C

    world, rank = init_distributed()
    world_group = C.world_group()
    # before any collective: a stage may wait longer than 30 s for its neighbour on a busy machine
    relax_receive_timeout()
    results = {}
    for spec in specs:
        fields = spec.split(":")
        fields += ["1", "1", "-", str(MICRO), "1"][len(fields) - 4:]
        name, pp, cp, schedule, tp, ep, sharding, micro, chunks = fields
        pp, cp, tp, ep, micro, chunks = int(pp), int(cp), int(tp), int(ep), int(micro), int(chunks)
        dp = world // (pp * cp * tp)
        # "hsdp1": HSDP, the dense weights sharded within groups of 1 data-parallel rank and
        # replicated over the 2 groups (gradients reduced over the replicas)
        dims = ParallelDims(world_size=world, pp=pp, dp_shard=dp, cp=cp, tp=tp, ep=ep,
                            dense_shard=1 if "hsdp1" in name else 0)
        mesh = DeviceMesh(dims, rank).init_process_groups()
        dropout = "dropout" in name  # compared with the reference that has dropout too
        model = fresh_model(jit=name in COMPILED, dropout=dropout)
        if "logits" in name:  # the max attention logits (QK-clip, MaxLogitsMonitor), compared per step
            track_max_attention_logits(model)
        hybrid = "hybrid" in name
        if "recompute" in name and not hybrid:
            # the trainer's order (recompute at build, then the layout): layer 0 whole, the
            # attention core alone in the others, in blocks of 4 query rows (64 scores)
            _recompute(model, RecomputePlan(full=(0,), select={"self_attn.core_attention": (1, 2, 3)}))
        plan = parallel_plan(model)
        sched = PipelineSchedule(model, plan, mesh, SEQ, schedule=schedule,
                                 dp_sharding=None if sharding == "-" else sharding, chunks=chunks,
                                 cp_method="ulysses" if "ulysses" in name else "hybrid" if hybrid
                                 else "colossal", ulysses_degree=2 if hybrid else None)
        if "recompute" in name and hybrid:  # the other order: every layer whole, after the layout
            _recompute(model, RecomputePlan(full=(0, 1, 2, 3)))
        opt = make_optimizer(list(zip(sched.param_names, sched.params)))
        if name.startswith("fail") and sched.stage_index == 1:
            _inject_failure(sched.stage, at_call=micro // dp + 1)
        rows, logits, local_logits = [], [], []
        t0 = time.perf_counter()
        for i, step in enumerate(batches(docs, micro)):
            dropout_step(model, i + 1)
            grads, figures, load = sched.step(step[mesh.rank("dp")::dp])
            model.dropout.end_step()
            if "logits" in name:
                # this rank's record (every head of each layer it ran), then the table over all ranks
                mine = max_attention_logits(model, reset=False)
                local_logits.append({j: m.tolist() for j, m in mine.items()})
                table = synced_max_logits(model, lambda a: C.all_reduce(Tensor(a), world_group).asnumpy(),
                                          rank, world)
                logits.append([table[j].tolist() for j in sorted(table)])
            grads = [g / float(len(step) // dp) for g in grads]
            norm = sched.grad_norm(grads)
            opt.step(clip(grads, norm))
            sched.finish_step()
            model.update_expert_bias(load)
            rows.append(list(figures) + [norm])
        elapsed = time.perf_counter() - t0
        rows = np.array(rows)
        # bytes of dense stage weights this rank keeps between steps (full weights + shards)
        full_bytes = sum(int(np.prod(sched.fsdp.slots[n].shape)) * 4 for n in sched.dense_names) \
            if sched.fsdp is not None else sum(p.size * p.itemsize for p in sched.stage_params)
        resident = sum(p.size * p.itemsize for p in sched.stage_params)
        if sched.fsdp is not None:
            resident += sum(p.size * p.itemsize for p in sched.fsdp.params)
        # the one full-state gather (every stage's weights, broadcast over pp, experts whole);
        # the router correction biases are not among them: every rank updates all of them
        # with the same global load, so its own model holds them
        state = sched.to_full(sched.params)
        check_shards(sched, state)  # what a sharded checkpoint writes and reads back
        state.update({p.name: p.asnumpy() for p in model.get_parameters() if p.name not in state})
        ref_file = ref_path.replace("{micro}", str(micro))
        if dropout:
            ref_file = ref_file.replace("reference_", "reference_dropout_")
        while not os.path.exists(ref_file):  # the reference runs beside this job
            time.sleep(0.5)
        ref = np.load(ref_file)
        fig_err = float(np.max(np.abs(rows - ref["figures"]) / np.maximum(np.abs(ref["figures"]), 1e-30)))
        logit_err = local_logit_err = None
        if logits:  # relative to the reference's largest logit
            scale = float(np.abs(ref["logits"]).max())
            logit_err = float(np.abs(np.array(logits) - ref["logits"]).max()) / scale
            local_logit_err = max(float(np.abs(np.array(m[j]) - ref["logits"][s, j]).max()) / scale
                                  for s, m in enumerate(local_logits) for j in m)
        param_err = 0.0
        checked = 0
        per_param = {}
        # the whole model at full shape, gathered over every dimension, on every rank
        assert sorted(state) == sorted(k[len("param/"):] for k in ref.files if k.startswith("param/"))
        for n in sorted(state):
            want = ref[f"param/{n}"]
            got = state[n]
            # relative error of the tensor as a whole: ||got - want|| / ||want||
            err = float(np.linalg.norm(got - want) / max(float(np.linalg.norm(want)), 1e-30))
            per_param[n] = (err, float(np.max(np.abs(got - want))))
            param_err = max(param_err, err)
            checked += 1
        results[name] = {"figures": rows.tolist(), "ref_figures": ref["figures"].tolist(), "figure_rel_err": fig_err,
                         "param_rel_err": param_err, "params_checked": checked,
                         "logit_rel_err": logit_err, "local_logit_rel_err": local_logit_err,
                         "row_blocks": sum(1 for _, c in model.cells_and_names() if getattr(
                             c.__dict__.get("construct"), "inner", None) == getattr(c, "_row_blocks", 0)),
                         "recomputed": sum(w.forward_calls for w in model.recompute_wrappers.values()),
                         "worst_params": sorted(per_param.items(), key=lambda kv: -kv[1][0])[:5], "seconds": elapsed,
                         "stage_units": sched.parts[sched.stage_index],
                         "stage_bytes": int(full_bytes), "resident_bytes": int(resident),
                         "compiled": is_compiled(model),
                         # HSDP: the ranks holding the same dense shards (gradients reduced over them)
                         "hsdp_replicas": sched.fsdp.replicate.size if sched.fsdp is not None
                         and sched.fsdp.replicate is not None else None,
                         # attention cores running Ulysses, and the size of their key/value ring (hybrid CP)
                         "ulysses_rings": [getattr(c.construct, "ring", None) and c.construct.ring.size
                                           for _, c in model.cells_and_names()
                                           if type(c.construct).__name__ == "_UlyssesCore"]}
        print(f"cp_pp_parity {name}: figures {fig_err:.3e} params {param_err:.3e} ({elapsed:.1f} s)", flush=True)
        with open(os.path.join(out_dir, f"cp_pp_{rank}.json"), "w") as f:
            json.dump(results, f)


def _recompute(model, plan) -> None:
    apply_recompute(model, plan)
    for _, cell in model.cells_and_names():
        if hasattr(cell, "recompute_in_row_blocks"):
            cell.row_block_elements = 64


def _inject_failure(stage, at_call: int) -> None:
    """Make this stage's backward raise on its ``at_call``-th call (a failing stage)."""
    real = stage.backward
    calls = [0]

    def failing(*args, **kwargs):
        calls[0] += 1
        if calls[0] == at_call:
            raise RuntimeError("injected stage failure")
        return real(*args, **kwargs)

    stage.backward = failing


if __name__ == "__main__":
    mode = sys.argv[1]
    docs = "--docs" in sys.argv
    args = [a for a in sys.argv[2:] if a != "--docs"]
    if mode == "reference":
        reference(args[0], docs)
    else:
        parallel(args[0], args[1], args[2:], docs)
