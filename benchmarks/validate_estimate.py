"""``mindtrain-estimate`` against measurements.

    hatch run python benchmarks/validate_estimate.py bytes [--layouts zero3,ep2,...]
    hatch run python benchmarks/validate_estimate.py activations [--seq 1024] [--jit 0]

``bytes``: runs the trainer (``run_mindformer.py``, under msrun for 2+ workers) on
configs/pynative_ds3_tiny.yaml cut to seq 32, 2 decoder layers (+ its MTP module), 2 steps,
per layout, and compares rank 0's measured ``param_bytes`` / ``optimizer_bytes`` (the
metrics rows) with the estimate of its stage.

``activations``: bench_memory.py's method (each run in its own process, peak RSS above the
RSS before the first step, batch 1, bench_memory's model) with recompute off / select /
full, at ``--seq`` and at a short sequence; measured activations = the difference (the
fixed costs of a first step, gradients included, cancel). Estimate = the same difference
of :func:`mindtrain.trainer.estimate.activation_bytes`.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
ENTRY = os.path.join(ROOT, "run_mindformer.py")
TINY = os.path.join(ROOT, "configs", "pynative_ds3_tiny.yaml")
STEPS = 2
LAYOUTS = {  # name: (workers, overrides)
    "single": (1, []),
    "zero3": (2, ["parallelism.data_parallel_shard_strategy=optim_grads_params"]),
    "zero2": (2, ["parallelism.data_parallel_shard_strategy=optim_grads"]),
    "zero1_ep2": (2, ["parallelism.data_parallel_shard_strategy=optim", "parallelism.expert_parallel=2"]),
    "tp2": (2, ["parallelism.tensor_parallel=2"]),
    "pp2": (2, ["parallelism.pipeline_parallel=2"]),
}
SHORT_SEQ = 64


def tiny_overrides(data_prefix: str, work: str) -> list[str]:
    return [f"training.steps={STEPS}", "training.global_batch_size=2", "model.seq_length=32",
            "train_dataset.dataloader.config.seq_length=32", "model.num_hidden_layers=2",
            f"train_dataset.dataloader.config.data_path=['1', '{data_prefix}']",
            f"monitor.metrics_dir={os.path.join(work, 'metrics')}"]


def measure_bytes(name: str, work: str, data_prefix: str, port: int) -> dict:
    """Run layout ``name``; returns rank 0's last metrics row."""
    from mindtrain.trainer.quickstart import free_port, worker_env

    workers, extra = LAYOUTS[name]
    os.makedirs(work, exist_ok=True)
    args = ["--config", TINY, "--mode", "1"]
    for item in tiny_overrides(data_prefix, work) + extra:
        args += ["--override", item]
    if workers == 1:
        cmd = [sys.executable, ENTRY, *args]
    else:
        cmd = ["msrun", f"--worker_num={workers}", f"--local_worker_num={workers}",
               f"--master_port={free_port(port)}", "--join=True", f"--log_dir={os.path.join(work, 'log')}",
               ENTRY, *args]
    out = subprocess.run(cmd, cwd=work, env=worker_env(), capture_output=True, text=True, timeout=1200)
    if out.returncode != 0:
        logs = "".join(open(f, errors="replace").read()[-3000:] for f in glob.glob(os.path.join(work, "log", "*.log")))
        raise RuntimeError(f"layout {name} failed ({out.returncode}):\n{out.stdout[-3000:]}{out.stderr[-3000:]}{logs}")
    (metrics,) = glob.glob(os.path.join(work, "metrics", "run_*", "metrics.jsonl"))
    return [json.loads(line) for line in open(metrics)][-1]


def estimate_bytes(name: str, data_prefix: str, work: str):
    from mindtrain.config import load_config
    from mindtrain.trainer.estimate import estimate

    workers, extra = LAYOUTS[name]
    cfg = load_config(TINY, tiny_overrides(data_prefix, work) + extra, world_size=workers)
    return estimate(cfg, workers, device="CPU").stages[0]  # rank 0 is on stage 0


def compare_bytes(names, port: int = 8950) -> list[dict]:
    from mindtrain.trainer.quickstart import prepare_data

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        prefix = prepare_data(os.path.join(tmp, "data", "pydoc"))
        for name in names:
            work = os.path.join(tmp, name)
            got = measure_bytes(name, work, prefix, port)
            est = estimate_bytes(name, prefix, work)
            rows.append({"layout": name, "param_bytes": got["param_bytes"], "param_est": est.params,
                         "optimizer_bytes": got["optimizer_bytes"], "optimizer_est": est.optimizer})
    return rows


# ------------------------------------------------------------------ activations
MODES = {"off": {"mode": "None"}, "select": {"mode": "select", "select_module": {
    "self_attn.core_attention": True, "mlp.experts": True}}, "full": {"mode": "full"}}


def measure_peak(mode: str, seq: int, jit: bool) -> float:
    """bench_memory.py's peak RSS above baseline (MB), in a fresh process."""
    code = ("import json, bench_memory as b; print('RESULT ' + json.dumps(b.run_one(%r, %d, 2, %r)))"
            % ("off" if mode == "off" else mode, seq, jit))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=os.path.dirname(os.path.abspath(__file__)), timeout=1800)
    line = next((x for x in out.stdout.splitlines() if x.startswith("RESULT ")), None)
    if line is None:
        raise RuntimeError(f"bench_memory {mode} seq {seq} failed:\n{out.stderr[-3000:]}")
    return json.loads(line[7:])["peak_above_baseline_mb"] * 2 ** 20


def estimate_activations(mode: str, seq: int) -> int:
    from mindtrain.config import MindTrainConfig, ModelConfig, resolve_parallelism
    from mindtrain.config.schema import RecomputeConfig
    from mindtrain.trainer.estimate import activation_bytes, rank_units, DTYPE_BYTES
    import bench_memory as b

    cfg = MindTrainConfig()
    cfg.model = ModelConfig(**b.SIZES, seq_length=seq, max_position_embeddings=max(seq, 4096))
    cfg.model.compute_dtype = "float32"
    cfg.training.local_batch_size = 1
    cfg.training.global_batch_size = 1
    dims = resolve_parallelism(cfg.parallelism, 1)
    (units,) = rank_units(cfg.model, dims, None, 1)
    return activation_bytes(cfg, dims, units, DTYPE_BYTES["float32"], RecomputeConfig(**MODES[mode]))


def compare_activations(seq: int, jit: bool, modes=("off", "select", "full")) -> list[dict]:
    rows = []
    for mode in modes:
        long_, short = measure_peak(mode, seq, jit), measure_peak(mode, SHORT_SEQ, jit)
        est = estimate_activations(mode, seq) - estimate_activations(mode, SHORT_SEQ)
        rows.append({"mode": mode, "seq": seq, "measured": long_ - short, "estimate": est,
                     "measured_long": long_, "measured_short": short})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("what", choices=("bytes", "activations"))
    ap.add_argument("--layouts", default=",".join(LAYOUTS))
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--jit", type=int, default=0)
    ap.add_argument("--modes", default="off,select,full")
    args = ap.parse_args()
    if args.what == "bytes":
        print("| layout | param_bytes measured | estimate | diff | optimizer_bytes measured | estimate | diff |")
        print("|---|---|---|---|---|---|---|")
        for r in compare_bytes(args.layouts.split(",")):
            print(f"| {r['layout']} | {r['param_bytes']:,} | {r['param_est']:,} | "
                  f"{r['param_est'] / r['param_bytes'] - 1:+.1%} | {r['optimizer_bytes']:,} | "
                  f"{r['optimizer_est']:,} | {r['optimizer_est'] / r['optimizer_bytes'] - 1:+.1%} |", flush=True)
    else:
        print(f"seq {args.seq} minus seq {SHORT_SEQ}, batch 1, jit {bool(args.jit)}")
        print("| recompute | measured (MB) | estimate (MB) | diff |")
        print("|---|---|---|---|")
        for r in compare_activations(args.seq, bool(args.jit), args.modes.split(",")):
            print(f"| {r['mode']} | {r['measured'] / 2**20:.0f} | {r['estimate'] / 2**20:.0f} | "
                  f"{r['estimate'] / r['measured'] - 1:+.1%} |", flush=True)


if __name__ == "__main__":
    main()
