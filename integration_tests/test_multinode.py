"""Two msrun launchers, as on two hosts, form one job: node 0 and node 1 each start one of the
two workers (``--worker_num=2 --local_worker_num=1 --node_rank=N``) and train the tiny
DeepSeek-V3 for 2 steps of a 2-sequence global batch. Both workers' logs show the same step
lines, and their figures equal the single-process run of the same global batch (run here,
in-process, while the job trains). The launch line uses MindFormers' flags: ``--seed`` must
act (the reference sets training.seed to the same value), ``--options`` shrinks the model,
``--output_dir`` receives rank 0's metrics only, and ``--run_mode``/``--use_parallel`` are
named once, in worker 0's log only.

On one machine, msrun starts a scheduler in every launcher whose ``--master_addr`` is an
address of the machine; so node 1 is given 0.0.0.0 (Linux connects it to the loopback
scheduler of node 0, and msrun does not take it for a local address), as a second host
would be given node 0's address.
"""

from __future__ import annotations

import os
import re
import subprocess

import pytest

from mindtrain.trainer.quickstart import port_is_free, worker_env

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
ENTRY = os.path.join(ROOT, "run_mindformer.py")
TINY = os.path.join(ROOT, "configs", "pynative_ds3_tiny.yaml")
SEED = 7
STEP = re.compile(r"^\{ step:\[ *(\d+)/ *2\], loss: +(\S+), per_step_time: +\d+ms, load_balancing_loss: +(\S+), "
                  r"mtp_1_loss: +(\S+), lr: (\S+), grad_norm: +(\S+), throughput: +\d+\.\d+T \}$")


def _port() -> int:
    for port in range(8320, 8350):  # this test's msrun ports
        if port_is_free(port):
            return port
    raise AssertionError("no free port in 8320-8349")


def _options(prefix: str) -> list[str]:
    return ["training.steps=2", "training.global_batch_size=2", "model.seq_length=32", "compile.enable=false",
            "train_dataset.dataloader.config.seq_length=32", "model.num_hidden_layers=2",
            f"train_dataset.dataloader.config.data_path=['1','{prefix}']"]


def _lines(path: str) -> list[str]:
    with open(path, encoding="utf-8", errors="replace") as f:
        return [line.rstrip("\n") for line in f]


@pytest.mark.msrun
def test_two_launchers_train_as_one_job_equal_to_one_process(tmp_path):
    import numpy as np

    from mindtrain.config import load_config
    from mindtrain.trainer.quickstart import prepare_data

    tmp = str(tmp_path)
    prefix = prepare_data(os.path.join(tmp, "data", "pydoc"))
    port = _port()
    launchers = []
    for node, addr in ((0, "127.0.0.1"), (1, "0.0.0.0")):
        cmd = ["msrun", "--worker_num=2", "--local_worker_num=1", f"--node_rank={node}", f"--master_addr={addr}",
               f"--master_port={port}", "--join=True", f"--log_dir={os.path.join(tmp, f'node{node}')}",
               ENTRY, "--config", TINY, "--mode", "1", "--seed", str(SEED), "--run_mode", "train",
               "--use_parallel", "True", "--output_dir", os.path.join(tmp, "out"), "--options", *_options(prefix)]
        launchers.append(subprocess.Popen(cmd, cwd=tmp, env=worker_env(), stdout=subprocess.PIPE,
                                          stderr=subprocess.STDOUT, text=True))
    try:
        # the reference while the job trains: one process, the whole global batch
        import mindspore as ms

        from mindtrain.trainer.runtime import Runtime
        from mindtrain.trainer.trainer import Trainer

        ms.set_device("CPU")
        ms.runtime.launch_blocking()  # eager ops in the calling thread, as the trainer runs them on CPU
        cfg = load_config(TINY, _options(prefix) + [f"training.seed={SEED}", f"monitor.metrics_dir={tmp}/ref"])
        reference = Trainer(cfg, Runtime(device="CPU"), out=lambda _line: None).train()
        outputs = [p.communicate(timeout=900)[0] for p in launchers]
    finally:
        for p in launchers:
            if p.poll() is None:
                p.kill()
    for node, (p, out) in enumerate(zip(launchers, outputs)):
        assert p.returncode == 0, f"node {node}: " + out[-3000:]

    logs = {rank: _lines(os.path.join(tmp, f"node{rank}", f"worker_{rank}.log")) for rank in (0, 1)}
    steps = {rank: [m.groups() for m in map(STEP.match, lines) if m] for rank, lines in logs.items()}
    assert len(steps[0]) == 2 and steps[0] == steps[1], logs  # every worker prints the step line
    scale = cfg.model.mtp_loss_scaling_factor
    for (step, *printed), ref in zip(steps[0], reference):
        want = [ref["loss"], ref["load_balancing_loss"], scale * ref["mtp_loss"], ref["lr"], ref["grad_norm"]]
        np.testing.assert_allclose([float(v) for v in printed], want, rtol=1e-5, atol=1e-6, err_msg=f"step {step}")

    notes = [x for x in logs[0] if x.startswith("mindtrain: no effect")]
    assert notes == ["mindtrain: no effect in eager mode (--mode 1), ignored: --run_mode train, --use_parallel True"]
    assert not [x for x in logs[1] if x.startswith("mindtrain:")]  # start-up notes on rank 0 only
    assert "msrun worker 0 of 2" in "\n".join(logs[0])
    runs = os.listdir(os.path.join(tmp, "out", "metrics"))
    assert len(runs) == 1  # rank 0 alone writes metrics, under --output_dir
