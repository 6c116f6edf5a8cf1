"""DeepSeek-V3 training-step throughput: mindtrain-models (MindSpore) vs HF transformers (PyTorch).

Both run forward + backward + AdamW on CPU in fp32 with the sizes of issue 8, interleaved in
one run (each side in its own process; they take turns, so they never compete for cores):

    hatch run python benchmarks/bench_model.py [--rounds 4 --steps 3 --torch-python /tmp/hfvenv/bin/python]
    hatch run python benchmarks/bench_model.py --trainer [--rounds 3]
    hatch run python benchmarks/bench_model.py --update-ab [--rounds 3 --steps 8 --warmup 30]

The PyTorch side runs at its CPU defaults as users run it: sdpa attention, grouped_mm experts,
``clip_grad_norm_(1.0)``, ``torch.optim.AdamW``. The MindSpore side (model + the trainer's
AdamW) clips the same way, as the trainer does (the layouts' float64 norm, then the update with
the clipping coefficient as its gradient scale), and reports how much of its step the norm,
the clip and the update take. ``--update-ab`` runs MindSpore only: one
worker per update (the per-parameter one of 0.13: host norm of whole float64 copies, a pass
multiplying each gradient, ``ops.AdamWeightDecay`` per parameter; 0.14's fused kernel per
tensor with clipping folded in; the trainer's flat buffers, one kernel per group), taking turns
round by round, and prints each one's share of its steps per round (norm + clip + update
against model + norm + clip + update; issue 33). ``--trainer`` times what users
run instead: ``run_mindformer.py --config benchmarks/configs/ds3_bench.yaml`` in one process
(the same model, batch and clipping) each round, its per_step_time of steps 3 to 10 (step 1
compiles, step 2 is its first warm step; the PyTorch worker warms up before round 1), against
the PyTorch steps of the same round.

The PyTorch side needs a venv with torch==2.13.0 and transformers (see tools/make_hf_fixtures.py).
Prints per-round tokens/s, the ratio, MindSpore's compile time (first step), achieved GFLOP/s
against a measured MindSpore matmul peak, and each process's peak RSS.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

SIZES = dict(vocab_size=4096, hidden_size=256, num_hidden_layers=4, first_k_dense_replace=1,
             n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2, n_shared_experts=1,
             moe_intermediate_size=128, intermediate_size=512, num_attention_heads=8, num_key_value_heads=8,
             q_lora_rank=128, kv_lora_rank=64, qk_rope_head_dim=16, qk_nope_head_dim=32, v_head_dim=32,
             routed_scaling_factor=2.5, norm_topk_prob=True, max_position_embeddings=4096, rope_theta=10000.0)
SEQ, BATCH = 512, 2
LR = 1e-4
MAX_NORM = 1.0
ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
TRAINER_CONFIG = os.path.join(ROOT, "benchmarks", "configs", "ds3_bench.yaml")


def _batch(vocab, step):
    import numpy as np

    rng = np.random.default_rng(step)
    ids = rng.integers(0, vocab, (BATCH, SEQ + 1))
    return ids[:, :-1].astype(np.int32), ids[:, 1:].astype(np.int32), np.ones((BATCH, SEQ), np.float32)


# ----------------------------------------------------------------------------- MindSpore side
def ms_worker(jit: bool, update: str = "one-pass") -> None:
    import mindspore as ms
    import numpy as np
    from mindspore import Tensor, ops

    ms.set_device("CPU")
    ms.runtime.launch_blocking()  # eager ops in the calling thread, as the trainer runs them on CPU
    ms.set_seed(0)
    import mindtrain.models as mm
    from mindtrain.config import ModelConfig

    cfg = ModelConfig(**SIZES, seq_length=SEQ, num_nextn_predict_layers=0, compute_dtype="float32")
    model = mm.build_model(cfg, jit=jit)
    params = model.trainable_params()
    try:
        from mindtrain.parallel import Group, grad_norm
        from mindtrain.trainer.optimizer import AdamW
    except ImportError:  # the trainer package is optional here
        update = "per-param"
    if update == "per-param":
        opt = _PerParamAdamW(params)
    else:  # the trainer's AdamW: flat buffers ("one-pass") or one kernel call per tensor (0.14)
        opt = AdamW([(p.name, p) for p in params], lr=LR, betas=(0.9, 0.95), weight_decay=0.01,
                    flat=update == "one-pass")
        one = Group("world", (0,), 0)

    def fn(ids, labels, mask):
        return model(ids, labels=labels, loss_mask=mask)

    grad_fn = ms.value_and_grad(fn, None, params, has_aux=True)

    names = ("model", "norm", "clip", "update")
    # wall seconds per phase, and the process's CPU seconds ("cpu:" keys: all its threads; on
    # a machine busy with other jobs a phase's CPU time moves far less than its wall time)
    phases = {k: 0.0 for k in names + tuple(f"cpu:{n}" for n in names)}

    def clocks():
        return time.perf_counter(), time.process_time()

    def step(i):
        ids, labels, mask = (Tensor(a) for a in _batch(cfg.vocab_size, i))
        marks = [clocks()]
        (loss, _), grads = grad_fn(ids, labels, mask)
        loss_value = float(loss.asnumpy())
        marks.append(clocks())
        if update != "per-param":  # the trainer's: layout.grad_norm, then the update scaled by the coefficient
            norm = grad_norm(grads, one)
            marks.append(clocks())
            coef = MAX_NORM / (norm + 1e-6)
            marks.append(clocks())
            opt.step(grads, grad_scale=min(coef, 1.0))
        else:
            norm = float(np.sqrt(sum(float(np.sum(np.square(g.asnumpy().astype(np.float64)))) for g in grads)))
            marks.append(clocks())
            coef = MAX_NORM / (norm + 1e-6)
            if coef < 1.0:
                grads = [g * coef for g in grads]
                grads[-1].asnumpy()
            marks.append(clocks())
            opt.step(grads)
        model.update_expert_bias(model.take_expert_load())
        params[0].asnumpy()
        marks.append(clocks())
        for k, a, b in zip(names, marks, marks[1:]):
            phases[k] += b[0] - a[0]
            phases[f"cpu:{k}"] += b[1] - a[1]
        return loss_value

    t0 = time.perf_counter()
    step(0)
    compile_s = time.perf_counter() - t0
    peak = _matmul_peak(ms, np, ops, Tensor)
    print(json.dumps({"ready": True, "compile_s": compile_s, "matmul_gflops": peak, "update": update,
                      "flops_per_token": mm.flops_per_token(cfg, SEQ)}), flush=True)
    for k in phases:
        phases[k] = 0.0
    _serve(step, phases)


class _PerParamAdamW:
    """The trainer's update before issue 33 (mindtrain-trainer 0.13): ``ops.AdamWeightDecay``
    per parameter on gradients already scaled by the clipping pass."""

    def __init__(self, params):
        import numpy as np
        from mindspore import Parameter, Tensor, ops

        self.params = params
        self.m = [Parameter(Tensor(np.zeros(p.shape, np.float32)), name="m." + p.name) for p in params]
        self.v = [Parameter(Tensor(np.zeros(p.shape, np.float32)), name="v." + p.name) for p in params]
        # the trainer's rule: no decay for norms, biases and vectors
        self.decay = [len(p.shape) >= 2 and not p.name.lower().endswith("bias") and "norm" not in p.name.lower()
                      for p in params]
        self.kernel = ops.AdamWeightDecay()
        self.t = 0

    def step(self, grads):
        import math

        self.t += 1
        bc1, bc2 = 1 - 0.9 ** self.t, 1 - 0.95 ** self.t
        lr_t, eps_t, wd_t = LR * math.sqrt(bc2) / bc1, 1e-8 * math.sqrt(bc2), 0.01 * bc1 / math.sqrt(bc2)
        for p, m, v, g, decay in zip(self.params, self.m, self.v, grads, self.decay):
            self.kernel(p, m, v, lr_t, 0.9, 0.95, eps_t, wd_t if decay else 0.0, g)


def _matmul_peak(ms, np, ops, Tensor):
    a = Tensor(np.random.rand(1024, 1024).astype(np.float32))
    mm = ops.MatMul()
    mm(a, a).asnumpy()
    best = 0.0
    for _ in range(5):
        t = time.perf_counter()
        mm(a, a).asnumpy()
        best = max(best, 2 * 1024 ** 3 / (time.perf_counter() - t) / 1e9)
    return best


# ----------------------------------------------------------------------------- PyTorch side
def torch_worker() -> None:
    import torch
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    torch.manual_seed(0)
    sizes = dict(SIZES)
    theta = sizes.pop("rope_theta")
    cfg = DeepseekV3Config(**sizes, rope_parameters={"rope_type": "default", "rope_theta": theta})
    model = DeepseekV3ForCausalLM(cfg).float().train()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.95), weight_decay=0.01)

    def step(i):
        ids, labels, mask = (torch.from_numpy(a) for a in _batch(cfg.vocab_size, i))
        logits = model(ids.long()).logits
        ce = torch.nn.functional.cross_entropy(logits.reshape(-1, cfg.vocab_size), labels.long().reshape(-1),
                                               reduction="none")
        loss = (ce * mask.reshape(-1)).sum() / mask.sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        opt.step()
        return loss.item()

    step(0)
    print(json.dumps({"ready": True, "threads": torch.get_num_threads(),
                      "attn": model.config._attn_implementation}), flush=True)
    _serve(step)


def _serve(step, phases=None) -> None:
    """Answer 'run N' lines with per-step seconds; 'quit' ends."""
    i = 1
    for line in sys.stdin:
        cmd = line.split()
        if not cmd or cmd[0] == "quit":
            break
        times, losses = [], []
        before = dict(phases or {})
        for _ in range(int(cmd[1])):
            t = time.perf_counter()
            losses.append(step(i))
            times.append(time.perf_counter() - t)
            i += 1
        rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        round_phases = {k: v - before[k] for k, v in phases.items()} if phases else None
        print(json.dumps({"times": times, "loss": losses[-1], "peak_rss_mb": rss_mb, "phases": phases,
                          "round_phases": round_phases}), flush=True)


# ----------------------------------------------------------------------------- driver
def _start(cmd):
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1)
    while True:
        line = proc.stdout.readline()
        if not line:
            raise RuntimeError(f"worker {cmd} exited early")
        if line.startswith("{"):
            return proc, json.loads(line)


def _run(proc, n):
    proc.stdin.write(f"run {n}\n")
    proc.stdin.flush()
    while True:
        line = proc.stdout.readline()
        if line.startswith("{"):
            return json.loads(line)


def _trainer_round(work: str, r: int, eager: bool, pin: list) -> dict:
    """One run of run_mindformer.py on ds3_bench.yaml: per_step_time of steps 3 on, peak RSS."""
    import glob

    out = os.path.join(work, f"round{r}")
    items = [f"monitor.metrics_dir={out}", f"train_dataset.dataloader.config.data_path=['1', '{_data(work)}']"]
    if eager:
        items.append("compile.enable=false")
    cmd = pin + [sys.executable, os.path.join(ROOT, "run_mindformer.py"), "--config", TRAINER_CONFIG, "--mode", "1"]
    for item in items:
        cmd += ["--override", item]
    proc = subprocess.run(cmd, cwd=work, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"bench_model: run_mindformer.py failed ({proc.returncode}):\n{proc.stderr[-2000:]}")
    rows = [json.loads(line) for f in glob.glob(os.path.join(out, "*", "metrics.jsonl")) for line in open(f)]
    times = [row["per_step_time_ms"] / 1e3 for row in rows if row["step"] >= 3]
    return {"times": times, "loss": rows[-1]["loss"], "peak_rss_mb": max(row["max_rss_mb"] for row in rows)}


def _data(work: str) -> str:
    from mindtrain.trainer.quickstart import prepare_data

    prefix = os.path.join(work, "data", "pydoc")
    if not os.path.exists(prefix + "_text_document.idx"):
        os.makedirs(os.path.dirname(prefix), exist_ok=True)
        prepare_data(prefix)
    return prefix + "_text_document"


UPDATES = ("per-param", "per-tensor", "one-pass")


def _update_ab(args) -> int:
    """One MindSpore worker per update (``--update``: the per-parameter one of 0.13, the
    per-tensor fused kernel of 0.14, the flat buffers of 0.15), the same model, batches and
    clipping; they take turns, round by round. Per round each one's ms/step (its phases) and
    share of it outside the model (norm + clip + update), then the medians over rounds.
    (Separate processes: a flat optimizer makes the parameters views of its buffer, which
    a per-parameter kernel would not write.)"""
    me = os.path.abspath(__file__)
    procs = {}
    for kind in UPDATES:
        procs[kind], info = _start([sys.executable, me, "--worker", "ms", "--update", kind]
                                   + (["--eager"] if args.eager else []))
        if args.warmup:
            _run(procs[kind], args.warmup)  # untimed: caches, allocator and the kernels' thread split settle
        print(f"{kind}: ready (first step incl. compile {info['compile_s']:.1f} s, then {args.warmup} untimed steps)",
              flush=True)
    shares = {c + k: [] for c in ("", "cpu:") for k in UPDATES}
    steps = {c + k: [] for c in ("", "cpu:") for k in UPDATES}
    for r in range(args.rounds):
        for kind in UPDATES:
            res = _run(procs[kind], args.steps)
            for clock in ("", "cpu:"):
                ph = {k[len(clock):]: v for k, v in res["round_phases"].items()
                      if k.startswith("cpu:") == bool(clock)}
                total = sum(ph.values())
                outside = 1.0 - ph["model"] / total
                ms_step = total / args.steps * 1e3
                shares[clock + kind].append(outside)
                steps[clock + kind].append(ms_step)
                print(f"round {r + 1} {kind:10s} {'cpu ' if clock else 'wall'}: {ms_step:6.0f} ms/step; "
                      + ", ".join(f"{k} {v / total:.1%} ({v / args.steps * 1e3:.0f} ms)" for k, v in ph.items())
                      + f"; optimizer + clip + norm {outside:.1%} ({outside * ms_step:.0f} ms)", flush=True)
    for proc in procs.values():
        proc.stdin.write("quit\n")
        proc.stdin.flush()
        proc.wait(timeout=60)
    for kind in shares:
        print(f"median of {args.rounds} rounds, {kind.replace('cpu:', 'CPU time, ')}: optimizer + clip + norm "
              f"{statistics.median(shares[kind]):.1%} of the step, {statistics.median(steps[kind]):.0f} ms/step "
              f"(rounds {', '.join(f'{x:.1%}' for x in shares[kind])})")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--steps", type=int, default=3, help="steps per side per round")
    ap.add_argument("--torch-python", default="/tmp/hfvenv/bin/python")
    ap.add_argument("--eager", action="store_true", help="MindSpore without ms.jit (for comparison)")
    ap.add_argument("--trainer", action="store_true",
                    help="time run_mindformer.py on benchmarks/configs/ds3_bench.yaml (what users run)")
    ap.add_argument("--one-core", action="store_true",
                    help="pin both sides to core 0 (torch with 1 thread; with --trainer the run_mindformer.py "
                         "runs too): a fairer ratio on a busy machine, where torch's spinning OpenMP threads "
                         "suffer far more than MindSpore's")
    ap.add_argument("--update-ab", action="store_true",
                    help="MindSpore only: the trainer's one-pass update against the per-parameter one it "
                         "replaced, alternate steps of one process; each one's optimizer + clip + norm share")
    ap.add_argument("--warmup", type=int, default=30, help="--update-ab: untimed steps first")
    ap.add_argument("--update", choices=list(UPDATES), default="one-pass", help=argparse.SUPPRESS)
    ap.add_argument("--worker", choices=["ms", "torch"], help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker == "ms":
        ms_worker(jit=not args.eager, update=args.update)
        return 0
    if args.update_ab:
        return _update_ab(args)
    if args.worker == "torch":
        if args.one_core:
            import torch
            torch.set_num_threads(1)
        torch_worker()
        return 0

    import tempfile

    me = os.path.abspath(__file__)
    pin = ["taskset", "-c", "0"] if args.one_core else []
    t0 = time.perf_counter()
    work = tempfile.mkdtemp(prefix="bench_model_")
    if args.trainer:
        ms_proc = None
        from mindtrain.config import load_config  # no MindSpore in this process: the torch worker
        from mindtrain.config.model_plan import flops_per_token  # inherits its environment

        ms_info = {"flops_per_token": flops_per_token(load_config(TRAINER_CONFIG, validate=False).model, SEQ)}
        print(f"mindspore side: run_mindformer.py --config {os.path.relpath(TRAINER_CONFIG, ROOT)}"
              f"{' (compile.enable=false)' if args.eager else ''}, one process per round")
    else:
        ms_proc, ms_info = _start(pin + [sys.executable, me, "--worker", "ms"] + (["--eager"] if args.eager else []))
        print(f"mindspore ready (first step incl. compile {ms_info['compile_s']:.1f} s, "
              f"matmul 1024^2 peak {ms_info['matmul_gflops']:.0f} GFLOP/s) after {time.perf_counter() - t0:.0f} s")
    th_proc, th_info = _start(pin + [args.torch_python, me, "--worker", "torch"]
                              + (["--one-core"] if args.one_core else []))
    if not args.one_core and th_info["threads"] < (os.cpu_count() or 1):
        print(f"bench_model: torch runs {th_info['threads']} threads on {os.cpu_count()} cores "
              "(OMP_NUM_THREADS in the environment?): the peer is not at its defaults", file=sys.stderr)
    print(f"torch ready ({th_info['threads']} threads, attention {th_info['attn']}, clip_grad_norm_({MAX_NORM}), AdamW)")
    tokens = BATCH * SEQ
    ms_all, th_all, ratios = [], [], []
    for r in range(args.rounds):
        a = _trainer_round(work, r, args.eager, pin) if args.trainer else _run(ms_proc, args.steps)
        b = _run(th_proc, args.steps)
        ms_all += a["times"]
        th_all += b["times"]
        ms_tps = tokens / statistics.median(a["times"])
        th_tps = tokens / statistics.median(b["times"])
        ratios.append(ms_tps / th_tps)
        print(f"round {r + 1}: mindspore {ms_tps:7.0f} tok/s ({statistics.median(a['times']) * 1e3:6.0f} ms/step, "
              f"loss {a['loss']:.4f}) | torch {th_tps:7.0f} tok/s "
              f"({statistics.median(b['times']) * 1e3:6.0f} ms/step, loss {b['loss']:.4f}) | ratio {ms_tps / th_tps:.2f}")
    procs = [p for p in (ms_proc, th_proc) if p is not None]
    for p in procs:
        p.stdin.write("quit\n")
        p.stdin.flush()
        p.wait(timeout=60)
    ms_tps = tokens / statistics.median(ms_all)
    th_tps = tokens / statistics.median(th_all)
    fpt = ms_info["flops_per_token"]
    print(f"median of rounds: ratio {statistics.median(ratios):.2f} (rounds {', '.join(f'{x:.2f}' for x in ratios)}); "
          f"all steps: mindspore {ms_tps:.0f} tok/s, torch {th_tps:.0f} tok/s")
    peak = f" = {fpt * ms_tps / 1e9 / ms_info['matmul_gflops']:.0%} of its matmul peak" if "matmul_gflops" in ms_info else ""
    print(f"achieved: mindspore {fpt * ms_tps / 1e9:.1f} GFLOP/s{peak}, torch {fpt * th_tps / 1e9:.1f} GFLOP/s "
          f"(model FLOPs {fpt / 1e6:.1f} MFLOP/token)")
    if a.get("phases"):
        for clock in ("", "cpu:"):
            ph = {k[len(clock):]: v for k, v in a["phases"].items() if k.startswith("cpu:") == bool(clock)}
            total = sum(ph.values())
            print(f"mindspore step ({'CPU time' if clock else 'wall'}): "
                  + ", ".join(f"{k} {v / total:.1%}" for k, v in ph.items())
                  + f" (optimizer + clip + norm: {(total - ph['model']) / total:.1%})")
    print(f"peak RSS: mindspore {a['peak_rss_mb']:.0f} MB, torch {b['peak_rss_mb']:.0f} MB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
