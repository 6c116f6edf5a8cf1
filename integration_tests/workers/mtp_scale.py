"""For two MTP loss scales: the single-process model, then TP=2, CP=2 and PP=2 (each through
:class:`mindtrain.parallel.pipeline_parallel.PipelineSchedule`), on one micro-batch of packed
documents; writes each rank's figures and gradient norms.

    msrun --worker_num=2 ... mtp_scale.py OUT_DIR

Nothing in the parallel package is told the scale: it is a model config field, read by the
model's ``combine_losses`` only.
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np

import mindspore as ms

ms.set_device("CPU")
ms.runtime.launch_blocking()  # eager ops in the calling thread, as the trainer runs them on CPU

from mindspore import Tensor  # noqa: E402

from mindtrain.config import ParallelDims, load_config  # noqa: E402
from mindtrain.models import build_model, parallel_plan  # noqa: E402

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
SEQ = 16
SCALES = (0.1, 0.7)
LAYOUTS = {"tp2": (1, 1, 2), "cp2": (1, 2, 1), "pp2": (2, 1, 1)}   # name -> (pp, cp, tp)


def model_config(scale: float):
    """The tiny config with two MTP depths and the given ``model.mtp_loss_scaling_factor``."""
    return load_config(os.path.join(ROOT, "configs", "pynative_ds3_tiny.yaml"),
                       [f"model.seq_length={SEQ}", f"train_dataset.dataloader.config.seq_length={SEQ}",
                        "model.num_nextn_predict_layers=2", f"model.mtp_loss_scaling_factor={scale}"],
                       validate=False).model


def fresh_model(cfg, jit: bool):
    ms.set_seed(42)
    np.random.seed(42)
    return build_model(cfg, jit=jit)


def micro_batch() -> dict:
    """[1, SEQ] tokens in three packed documents (reset positions, compressed EOD mask)."""
    rng = np.random.default_rng(3)
    tok = rng.integers(2, 512, size=(1, SEQ + 1)).astype(np.int32)
    ends = np.array([[5, 11, SEQ, SEQ]], np.int32)
    pos = np.concatenate([np.arange(5), np.arange(6), np.arange(SEQ - 11)])[None].astype(np.int32)
    mask = (rng.random((1, SEQ)) > 0.2).astype(np.float32)
    return {"input_ids": tok[:, :-1].copy(), "labels": tok[:, 1:].copy(), "loss_mask": mask,
            "position_ids": pos, "attention_mask": ends}


def reference(cfg, batch) -> dict:
    """The model's own forward and backward in one process."""
    model = fresh_model(cfg, jit=False)
    params = model.trainable_params()

    def fwd(*t):
        loss, m = model(t[0], labels=t[1], loss_mask=t[2], position_ids=t[3], attention_mask=t[4])
        return loss, (m["lm_loss"], m["load_balancing_loss"], m["mtp_loss"])

    t = [Tensor(batch[k]) for k in ("input_ids", "labels", "loss_mask", "position_ids", "attention_mask")]
    (loss, (lm, bal, mtp)), grads = ms.value_and_grad(fwd, None, params, has_aux=True)(*t)
    norm = float(np.sqrt(sum(float((g.asnumpy().astype(np.float64) ** 2).sum()) for g in grads)))
    return {"loss": float(loss.asnumpy()), "lm_loss": float(lm.asnumpy()), "load_balancing_loss": float(bal.asnumpy()),
            "mtp_loss": float(mtp.asnumpy()), "grad_norm": norm}


def main(out_dir: str) -> None:
    from mindtrain.parallel import DeviceMesh
    from mindtrain.parallel.collectives import init_distributed
    from mindtrain.parallel.pipeline_parallel import PipelineSchedule, relax_receive_timeout

    world, rank = init_distributed()
    relax_receive_timeout()
    batch = micro_batch()
    results = {}
    for scale in SCALES:
        cfg = model_config(scale)
        results[f"reference@{scale}"] = reference(cfg, batch)
        for name, (pp, cp, tp) in LAYOUTS.items():
            dims = ParallelDims(world_size=world, pp=pp, dp_shard=world // (pp * cp * tp), cp=cp, tp=tp, ep=1)
            mesh = DeviceMesh(dims, rank).init_process_groups()
            # eager layers: one step costs less than compiling them (compiled layers under PP
            # are proven in test_cp_pp_parity.py)
            model = fresh_model(cfg, jit=False)
            sched = PipelineSchedule(model, parallel_plan(model), mesh, SEQ)
            grads, figures, _ = sched.step([batch])
            results[f"{name}@{scale}"] = {"loss": figures.loss, "lm_loss": figures.lm_loss,
                                          "load_balancing_loss": figures.load_balancing_loss,
                                          "mtp_loss": figures.mtp_loss, "grad_norm": sched.grad_norm(grads)}
    with open(os.path.join(out_dir, f"mtp_scale_{rank}.json"), "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main(sys.argv[1])
