"""Soak: a killed worker, an automatic restart from the tracker, and the same result.

Two msrun jobs of 2 workers train the tiny DeepSeek-V3 (2 decoder layers, MTP, 4 sequences
of 32 tokens per step) side by side for ``--steps`` steps, saving every ``--save-every``:

- A runs uninterrupted;
- B gets SIGKILL on a random worker at a random step; a supervisor loop (what a cluster's
  restart policy does) relaunches B with ``checkpoint.load_path`` = its save_path, so the
  tracker picks the newest complete checkpoint, until B has trained every step.

At the end the step lines of B (from each launch, without the timing fields) must equal A's,
and B's final weights and AdamW moments must equal A's bit for bit. Not a CI test (minutes);
its report goes into the trainer README.

    hatch run python benchmarks/soak_restart.py [--steps 200] [--save-every 20] [--seed 0]
"""

from __future__ import annotations

import argparse
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time

import numpy as np

from mindtrain.trainer.log_line import read_step_lines, without_timing

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
ENTRY = os.path.join(ROOT, "run_mindformer.py")
TINY = os.path.join(ROOT, "configs", "pynative_ds3_tiny.yaml")


def overrides(tmp: str, name: str, steps: int, every: int, extra=()) -> list[str]:
    prefix = os.path.join(tmp, "data", "pydoc_text_document")
    items = [f"training.steps={steps}", "training.global_batch_size=4", "model.seq_length=32",
             "train_dataset.dataloader.config.seq_length=32", "model.num_hidden_layers=2",
             f"train_dataset.dataloader.config.data_path=['1', '{prefix}']", "checkpoint.enable_save=true",
             f"checkpoint.save_interleaved_steps={every}", f"checkpoint.save_path={os.path.join(tmp, name, 'ckpt')}",
             f"monitor.metrics_dir={os.path.join(tmp, name, 'metrics')}", *extra]
    return [a for item in items for a in ("--override", item)]


def launch(tmp: str, name: str, launch_no: int, port: int, args: list[str]) -> tuple[subprocess.Popen, str]:
    from mindtrain.trainer.quickstart import free_port, worker_env

    log_dir = os.path.join(tmp, name, f"log_{launch_no}")
    cmd = ["msrun", "--worker_num=2", "--local_worker_num=2", f"--master_port={free_port(port)}", "--join=True",
           f"--log_dir={log_dir}", ENTRY, "--config", TINY, "--mode", "1", *args]
    out = open(os.path.join(tmp, name, f"console_{launch_no}.log"), "w")
    return subprocess.Popen(cmd, cwd=tmp, env=worker_env(), stdout=out, stderr=subprocess.STDOUT,
                            start_new_session=True), log_dir


def step_lines(log_dir: str) -> list[str]:
    return read_step_lines(os.path.join(log_dir, "worker_0.log"))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--save-every", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0, help="picks the step and the worker to kill")
    ap.add_argument("--workdir", default=None)
    a = ap.parse_args()
    from mindtrain.trainer.quickstart import prepare_data
    from mindtrain.trainer.runtime import worker_pid
    from mindtrain.trainer.sharded import ShardedReader

    rnd = random.Random(a.seed)
    kill_step = rnd.randrange(a.save_every + 1, a.steps)
    victim = rnd.randrange(2)
    tmp = a.workdir or tempfile.mkdtemp(prefix="mindtrain_soak_")
    prepare_data(os.path.join(tmp, "data", "pydoc"))
    for name in ("a", "b"):
        os.makedirs(os.path.join(tmp, name), exist_ok=True)
    start = time.time()
    proc_a, log_a = launch(tmp, "a", 0, 8700, overrides(tmp, "a", a.steps, a.save_every))
    b_lines: list[str] = []
    launches, killed_at = 0, None
    base = overrides(tmp, "b", a.steps, a.save_every)
    while True:
        resume = os.path.exists(os.path.join(tmp, "b", "ckpt", "latest_checkpointed_iteration.txt"))
        extra = overrides(tmp, "b", a.steps, a.save_every,
                          [f"checkpoint.load_path={os.path.join(tmp, 'b', 'ckpt')}"]) if resume else base
        proc_b, log_b = launch(tmp, "b", launches, 8710, extra)
        launches += 1
        if killed_at is None:
            while proc_b.poll() is None and len(step_lines(log_b)) < kill_step:
                time.sleep(0.2)
            if proc_b.poll() is None:
                os.kill(worker_pid(proc_b.pid, rank=victim), signal.SIGKILL)
                killed_at = int(re.match(r"\{ step:\[ *(\d+)/", step_lines(log_b)[-1]).group(1))
        rc = proc_b.wait()
        lines = step_lines(log_b)
        b_lines += lines
        print(f"B launch {launches}: exit {rc}, steps {lines[0][8:14].strip() if lines else '-'}.."
              f"{lines[-1][8:14].strip() if lines else '-'}", flush=True)
        if rc == 0:
            break
        if launches > 5:
            print("B did not finish after 5 restarts", flush=True)
            return 1
    rc_a = proc_a.wait()
    took = time.time() - start
    lines_a = step_lines(log_a)
    # B's lines per step: a relaunch repeats the steps after its checkpoint; the last print wins
    by_step: dict[int, str] = {}
    for line in b_lines:
        by_step[int(re.match(r"\{ step:\[ *(\d+)/", line).group(1))] = line
    same_lines = rc_a == 0 and [without_timing(x) for x in lines_a] == [without_timing(by_step[s]) for s in sorted(by_step)]
    last = f"iter_{a.steps:07d}"
    worst = 0.0
    for ta, tb in [(ShardedReader(os.path.join(tmp, "a", "ckpt", last)).read_all(),
                    ShardedReader(os.path.join(tmp, "b", "ckpt", last)).read_all())]:  # weights and moments
        assert sorted(ta) == sorted(tb)
        worst = max([worst] + [float(np.max(np.abs(ta[k].astype(np.float64) - tb[k]))) if ta[k].size else 0.0
                               for k in ta])
    print(f"soak: {a.steps} steps, saves every {a.save_every}, SIGKILL to rank {victim} at step {killed_at}, "
          f"{launches} launches of B; step lines equal: {same_lines}; final weights and moments max |A-B| = {worst:g}; "
          f"{took:.0f} s wall", flush=True)
    return 0 if same_lines and worst == 0.0 else 1


if __name__ == "__main__":
    sys.exit(main())
