"""Peak RSS of one trainer rank phase by phase: what each part of a step adds.

    hatch run python benchmarks/probe_memory_phases.py DATA_PREFIX OUT_DIR [SECTION.FIELD=VALUE ...]
    msrun --worker_num=2 ... benchmarks/probe_memory_phases.py DATA_PREFIX OUT_DIR ...   # per rank

Builds the trainer of ``benchmarks/configs/ds3_375m.yaml`` (with the overrides) as
``run_mindformer.py`` does, then runs the step by hand: each micro-batch's forward (a mark
when the loss is made) and backward, the gradients and their norm, clipping, the optimizer,
``finish_step``; then the save (skipped with NOSAVE=1). After each phase it prints the RSS
and the peak since the previous mark (``/proc/self/clear_refs`` "5" resets VmHWM at every
mark), so a phase's line shows what it alone reached. Data: ``hatch run quickstart``'s
prefix, or ``mindtrain.trainer.quickstart.prepare_data``.
"""

from __future__ import annotations

import importlib
import os
import sys
import time

T0 = time.time()
ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))


def _status() -> dict:
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("VmRSS:", "VmHWM:", "RssAnon:", "RssShmem:")):
                out[line.split(":")[0]] = int(line.split()[1]) / 2 ** 20
    return out


def mark(label: str) -> None:
    s = _status()
    print(f"PROBE {label:34s} rss {s['VmRSS']:7.3f} GB  peak since last {s['VmHWM']:7.3f} GB  "
          f"(anon {s['RssAnon']:6.3f}, shm {s['RssShmem']:6.3f})  t {time.time() - T0:6.1f}s", flush=True)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def main() -> None:
    mark("python start")
    data, out, extra = sys.argv[1], sys.argv[2], sys.argv[3:]
    importlib.import_module("mindspore")
    mark("import mindspore")
    from mindtrain.config import load_config
    from mindtrain.trainer import runtime

    cfg = load_config(os.path.join(ROOT, "benchmarks", "configs", "ds3_375m.yaml"),
                      [f"train_dataset.dataloader.config.data_path=['1', '{data}']",
                       f"checkpoint.save_path={out}/ckpt", f"monitor.metrics_dir={out}/metrics", *extra])
    rt, _ = runtime.start("CPU")
    import mindtrain.parallel.compose as compose
    from mindtrain.trainer.trainer import Trainer

    made = compose.model_forward

    def marked(model, columns):  # a mark where each micro-batch's forward has made its loss
        forward = made(model, columns)

        def run(*inputs):
            figures = forward(*inputs)
            figures.loss.asnumpy()
            mark("  forward end")
            return figures
        return run

    compose.model_forward = marked
    mark("runtime started")
    tr = Trainer(cfg, rt)
    mark("Trainer() built")
    print(f"PROBE param_bytes {tr.layout.memory_bytes()} optimizer_bytes {tr.optimizer.state_bytes()}", flush=True)
    lay = tr.layout
    batches = iter(tr.loader)
    for step in range(1, cfg.training.steps + 1):
        for k in range(tr.accum):
            lay.run_step([next(batches)])
            mark(f"step {step} micro-batch {k} backward end")
        grads = lay.gradients()
        norm = lay.grad_norm(grads)
        mark(f"step {step} gradients + norm")
        coef = cfg.training.max_norm / (norm + 1e-6)
        if cfg.training.max_norm > 0 and coef < 1.0:
            grads = [g * coef for g in grads]  # as Trainer.train_step clips
        mark(f"step {step} clip")
        tr.optimizer.step(grads, lr=tr.schedule(step))
        del grads
        mark(f"step {step} optimizer")
        lay.finish_step()
        tr.step += 1
    if not os.environ.get("NOSAVE"):
        tr.save()
        tr._finish_saves()
        mark("save")


if __name__ == "__main__":
    main()
