"""The MTP loss scale is one model config field that every layout follows (issue 14).

The model's ``combine_losses`` is the only code that reads ``mtp_loss_scaling_factor``
(and ``aux_loss_alpha`` and the mean over MTP depths): the single-process forward, the
pipeline stages, and the TP / CP paths (which run the model's own pieces and head + loss
cell, with hooks and a swapped cross-entropy component) all call it. Changing the field
alone must move every layout's loss and gradients the same way.

The fast test runs the model and a two-stage pipeline split (both stages in one process,
in sequence) for two scales; the msrun test runs TP=2, CP=2 and PP=2 on
2 workers against the single-process model for the same two scales.
"""

import dataclasses
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parent.parent
WORKERS = Path(__file__).parent / "workers"
SCALES = (0.1, 0.7)
PORT = 8633


def _worker():
    import importlib.util

    spec = importlib.util.spec_from_file_location("mtp_scale_worker", WORKERS / "mtp_scale.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _split_run(model, batch):
    """The model's units in two pipeline stages, run one after the other in this process:
    (figures summed over the stages, {param name: gradient})."""
    from mindtrain.models import parallel_plan
    from mindtrain.parallel.context_parallel import split_batch
    from mindtrain.config.pipeline import partition_units
    from mindtrain.parallel.pipeline_stage import METRICS, ModelStage

    plan = parallel_plan(model)
    first, last = (ModelStage(model, plan, part) for part in partition_units(plan["units"], 2))
    mb = split_batch(batch, 1, 0, model.config.num_attention_heads, len(last.mtp_ids),
                     inputs=model.whole_sequence_inputs)
    h, _ = first.forward_only(None, mb)
    gh, g_last, f_last, _, _ = last.backward(h, None, mb)
    _, g_first, f_first, _, _ = first.backward(None, gh, mb)
    figures = dict(zip(METRICS, (f_first.asnumpy() + f_last.asnumpy()).tolist()))
    grads = {}
    for stage, g in ((first, g_first), (last, g_last)):
        for n, x in zip(stage.param_names, g):   # a tied weight's gradient is the stages' sum
            grads[n] = grads[n] + x.asnumpy() if n in grads else x.asnumpy()
    return figures, grads


def test_mtp_scale_reaches_the_model_and_a_pipeline_split():
    import mindspore as ms
    from mindspore import Tensor

    ms.set_device("CPU")
    ms.runtime.launch_blocking()  # eager ops in the calling thread, as the trainer runs them on CPU
    w = _worker()
    batch = w.micro_batch()
    base = w.model_config(SCALES[0])
    seen = {}
    for scale in SCALES:
        cfg = dataclasses.replace(base, mtp_loss_scaling_factor=scale)   # the one edit
        model = w.fresh_model(cfg, jit=False)
        params = model.trainable_params()

        def fwd(*t):
            loss, m = model(t[0], labels=t[1], loss_mask=t[2], position_ids=t[3], attention_mask=t[4])
            return loss, m

        t = [Tensor(batch[k]) for k in ("input_ids", "labels", "loss_mask", "position_ids", "attention_mask")]
        (loss, m), grads = ms.value_and_grad(fwd, None, params, has_aux=True)(*t)
        ref = {k: float(v.asnumpy()) for k, v in m.items()}
        ref["loss"] = float(loss.asnumpy())
        assert ref["loss"] == pytest.approx(ref["lm_loss"] + scale * ref["mtp_loss"]
                                            + cfg.aux_loss_alpha * ref["load_balancing_loss"], rel=1e-6)
        ref_grads = {p.name: g.asnumpy() for p, g in zip(params, grads)}

        figures, split_grads = _split_run(model, batch)   # same model, no update in between
        for k in ("loss", "lm_loss", "mtp_loss", "load_balancing_loss"):
            assert figures[k] == pytest.approx(ref[k], rel=1e-6), (scale, k)
        assert sorted(split_grads) == sorted(ref_grads)
        for n, g in ref_grads.items():   # relative error of each gradient as a whole
            err = np.linalg.norm(split_grads[n] - g) / max(float(np.linalg.norm(g)), 1e-30)
            assert err < 1e-5, (scale, n, err)
        seen[scale] = (ref, ref_grads)

    (a, ga), (b, gb) = seen[SCALES[0]], seen[SCALES[1]]
    # the same weights: only the MTP term moved, by the change of scale
    assert b["mtp_loss"] == a["mtp_loss"] and b["lm_loss"] == a["lm_loss"]
    assert b["loss"] - a["loss"] == pytest.approx((SCALES[1] - SCALES[0]) * a["mtp_loss"], rel=1e-5)
    # an MTP depth's own output norm feeds only that depth's loss: its gradient scales with it
    for n in (n for n in ga if ".shared_head.norm." in n):
        np.testing.assert_allclose(gb[n], ga[n] * (SCALES[1] / SCALES[0]), rtol=1e-4, atol=1e-9, err_msg=n)


@pytest.mark.msrun
def test_mtp_scale_reaches_tp_cp_and_pp(tmp_path):
    env = dict(os.environ)
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    env.setdefault("GLOG_v", "3")
    log_dir = tmp_path / "log"
    cmd = ["msrun", "--worker_num=2", "--local_worker_num=2", f"--master_port={PORT}", f"--log_dir={log_dir}",
           "--join=True", str(WORKERS / "mtp_scale.py"), str(tmp_path)]
    # a hang guard, not a timing check; the whole process group goes on timeout
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=tmp_path,
                            start_new_session=True)
    try:
        out = proc.communicate(timeout=1200)[0]
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out = proc.communicate()[0]
    logs = "\n".join(p.read_text(errors="replace")[-3000:] for p in sorted(log_dir.glob("worker_*.log")))
    assert proc.returncode == 0, logs + out[-2000:]
    for rank in range(2):
        res = json.loads((tmp_path / f"mtp_scale_{rank}.json").read_text())
        for scale in SCALES:
            ref = res[f"reference@{scale}"]
            for layout in ("tp2", "cp2", "pp2"):
                got = res[f"{layout}@{scale}"]
                for k, v in ref.items():
                    assert got[k] == pytest.approx(v, rel=1e-5), (rank, layout, scale, k)
        a, b = res[f"reference@{SCALES[0]}"], res[f"reference@{SCALES[1]}"]
        assert b["loss"] - a["loss"] == pytest.approx((SCALES[1] - SCALES[0]) * a["mtp_loss"], rel=1e-5)
