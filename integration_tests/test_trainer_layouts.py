"""The trainer under every parallel layout equals the single-process run.

``run_mindformer.py`` trains the tiny DeepSeek-V3 (two decoder layers, dense and MoE, and
its MoE MTP module) for 4 steps of the same global batch (4 sequences of 32 tokens, AdamW,
clipping, the aux-loss-free bias update) as one process (compiled layers, 4 accumulation
micro-batches) and under msrun as FSDP ZeRO-3 (2 workers, gathered per decoder layer,
each layer compiled whole, its graph taking the gathered weights as inputs), TP=2 with sequence parallelism, EP=2 over the two data-parallel ranks, and PP=2 x
CP=2 x EP=2 on 4 workers (EP over the context-parallel ranks); TP=2 and PP=2 x CP=2 x EP=2
run the model compiled by regions (the pieces between their collectives are graphs), EP=2
eager layers (compile.enable=false). Each run's per-step loss
figures and grad norm (from its metrics file), the validation loop's eval loss after the last step, and its final checkpoint (full weights with HF
names and full AdamW moments) must equal the single process within 1e-5 relative, every run
training with attention and hidden dropout 0.1 (issue 34: the masks are the same in every layout); ZeRO-3
must hold half the optimizer bytes and half the parameter bytes per rank. A single process then resumes
from the ZeRO-3 run's step-3 checkpoint (sharded state saved at full shape, in MindFormers'
layout: checkpoint.layout=mindformers) and must reproduce step 4, and so must a TP=2 job (2 workers, its routed experts whole
on both ranks: expert_tensor_parallel=1) and a PP=2 job resuming from the same folder (the resumes with eager layers); the one-process and TP=2 resumes run with selective and full activation
recompute, which must change no figure, and so does the 4-worker PP=2 x CP=2 x EP=2 run (one
layer whole, attention cores and experts of the others alone): its equality with the single
process (no recompute) proves the layout and recompute's numerics at once. HSDP (4 workers,
dense weights sharded over 2 ranks and replicated over 2, experts over all 4) equals the single
process as well, each rank holding that share of the parameters. The other combinations are proven against the model itself in
test_cp_pp_parity.py and test_tp_ep_parity.py.

Independent runs overlap (the jobs wait on each other's collectives much of the time): the
single process beside the ZeRO-3 job, then both resumes beside the TP=2 and EP=2 jobs, which run
together; PP=2 x CP=2 x EP=2 runs alone. Only the ZeRO-3 run saves the step-3 checkpoint
that the resume reads; every run saves its step-4 checkpoint.
"""

from __future__ import annotations

import glob
import json
import os
import signal
import subprocess
import sys

import numpy as np
import pytest

from mindtrain.trainer.quickstart import free_port, worker_env

pytestmark = pytest.mark.msrun

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
ENTRY = os.path.join(ROOT, "run_mindformer.py")
TINY = os.path.join(ROOT, "configs", "pynative_ds3_tiny.yaml")
STEPS = 4
FIGURES = ("loss", "load_balancing_loss", "mtp_loss", "grad_norm")
# (Qwen3's layouts, test_qwen3_layouts.py, run with it too, their AdamW moments held to 5e-5)
DROPOUT = ("model.attention_dropout=0.1", "model.hidden_dropout=0.1")
LAYOUTS = {  # name: (workers, overrides)
    # the only run whose step-3 checkpoint is read (by the resume)
    # the default sharded checkpoint: each rank writes its own dim-0 shards
    "zero3": (2, ["parallelism.data_parallel_shard_strategy=optim_grads_params",
                  f"checkpoint.save_interleaved_steps={STEPS - 1}"]),
    "tp2": (2, ["parallelism.tensor_parallel=2"]),
    # eager: EP under compiled regions is the 4-worker run's, and a compile costs more than 4 steps save;
    # its final checkpoint in MindFormers' layout (iteration_NNNNNNNN/, ds3-model/-opt files)
    "ep2": (2, ["parallelism.expert_parallel=2", "compile.enable=false",
                "checkpoint.layout=mindformers", "checkpoint.prefix=ds3"]),
    # PP=2 x CP=2 x EP=2 (EP over the two context-parallel ranks), compiled by regions; with
    # activation recompute, which must change no figure (issue 16): stage 1's MoE layer 1
    # whole (its CP attention and EP all-to-alls run again in backward), the attention core
    # of stage 0's dense layer 0 and the attention core and routed experts of the MTP module
    # (layer 2, stage 1) alone
    "pp2_cp2_ep2": (4, ["parallelism.pipeline_parallel=2", "parallelism.context_parallel=2",
                        "parallelism.expert_parallel=2", "recompute.mode=select",
                        "recompute.full_recompute_layer=[1]",
                        "recompute.select_module={self_attn.core_attention: [0, 2], mlp.experts: [2]}"]),
    # HSDP (issue 34): ZeRO-3 with the dense weights sharded within 2 groups of 2 ranks and
    # replicated across them (the routed experts over all 4); eager: 4 compiles on 2 cores
    # cost more than the run
    "hsdp": (4, ["parallelism.data_parallel_shard_strategy=optim_grads_params",
                 "parallelism.dense_fsdp_shard_size=2", "compile.enable=false"]),
}


# resumes of the ZeRO-3 run's sharded step-3 checkpoint, each rank reading the parts of its
# files that it holds: name -> (workers, overrides). Recompute changes no figure (issue 16):
# the one-process resume recomputes the attention core and the experts, the TP=2 resume every
# layer whole; PP=2 reads each stage's layers only. Eager layers: each resume trains one step,
# and compiling every layer costs each of its processes about 13 s of CPU (3.5 times the
# rest of a one-step run); the compiled layouts are the runs above (ZeRO-3, TP=2 and
# PP=2 x CP=2 x EP=2 with recompute), and the eager resumes equal the compiled reference
EAGER = "compile.enable=false"
RESUMES = {
    "resume": (1, [EAGER, "recompute.mode=select",
                   "recompute.select_module={self_attn.core_attention: true, mlp.experts: true}"]),
    # with MindFormers' expert_tensor_parallel: 1 (routed experts whole on both TP ranks)
    "resume_tp2": (2, [EAGER, "parallelism.tensor_parallel=2", "recompute.mode=full",
                       "parallelism.expert_tensor_parallel=1"]),
    "resume_pp2": (2, [EAGER, "parallelism.pipeline_parallel=2"]),
}


def _args(tmp: str, name: str, extra=(), config: str = TINY, steps: int = STEPS) -> list[str]:
    prefix = os.path.join(tmp, "data", "pydoc_text_document")
    # two decoder layers (the dense one and a MoE one) and the MoE MTP module: every kind of block
    items = [f"training.steps={steps}", "training.global_batch_size=4", "model.seq_length=32",
             "train_dataset.dataloader.config.seq_length=32", "model.num_hidden_layers=2",
             f"train_dataset.dataloader.config.data_path=['1', '{prefix}']",
             "checkpoint.enable_save=true",
             # the validation loop at the last step (issue 34): 2 global batches of the corpus
             "validation.enable=true", f"validation.freq={steps}", "validation.steps=2",
             f"validation.data_path=['1', '{prefix}']",
             # dropout on in every DeepSeek-V3 run (issue 34): its masks are the same in every
             # layout (the validation loop runs without it)
             *(DROPOUT if config == TINY else ()),
             f"checkpoint.save_path={os.path.join(tmp, name, 'ckpt')}",
             f"monitor.metrics_dir={os.path.join(tmp, name, 'metrics')}", *extra]
    return ["--config", config, "--mode", "1"] + [a for item in items for a in ("--override", item)]


class _Job:
    """One run of run_mindformer.py (a plain process, or msrun with ``workers``) started in
    the background; :meth:`result` waits for it and reads its metrics file."""

    def __init__(self, tmp: str, name: str, workers: int, extra=(), port: int = 8380, config: str = TINY,
                 figures: tuple = FIGURES, steps: int = STEPS):
        self.tmp, self.name, self.figures, self.steps = tmp, name, figures, steps
        os.makedirs(os.path.join(tmp, name), exist_ok=True)
        if workers == 1:
            cmd = [sys.executable, ENTRY, *_args(tmp, name, extra, config, steps)]
        else:
            cmd = ["msrun", f"--worker_num={workers}", f"--local_worker_num={workers}",
                   f"--master_port={free_port(port)}", "--join=True", f"--log_dir={os.path.join(tmp, name, 'log')}",
                   ENTRY, *_args(tmp, name, extra, config, steps)]
        self.console = os.path.join(tmp, name, "console.log")
        with open(self.console, "w") as out:  # a file, not a pipe: nobody reads it while the job runs
            self.proc = subprocess.Popen(cmd, cwd=tmp, env=worker_env(), stdout=out, stderr=subprocess.STDOUT,
                                         start_new_session=True)
        self._result = None

    def result(self) -> dict:
        if self._result is None:
            try:
                self.proc.wait(timeout=1500)
            except subprocess.TimeoutExpired:
                self.kill()  # msrun's workers outlive msrun: end the whole session
                raise
            tmp, name = self.tmp, self.name
            logs = "".join(open(f, errors="replace").read()[-3000:]
                           for f in glob.glob(os.path.join(tmp, name, "log", "*.log")))
            assert self.proc.returncode == 0, open(self.console, errors="replace").read()[-6000:] + logs
            (metrics,) = glob.glob(os.path.join(tmp, name, "metrics", "run_*", "metrics.jsonl"))
            rows = [json.loads(line) for line in open(metrics)]
            self._result = {"steps": [r["step"] for r in rows],
                            "figures": np.array([[r[k] for k in self.figures] for r in rows]),
                            "ckpt": os.path.join(tmp, name, "ckpt"), "rows": rows}
        return self._result

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


def _weights(ckpt: str, step: int, name: str = "model.safetensors") -> dict:
    """Whole tensors of a checkpoint: the weights under HF names (as mindtrain-export-hf
    writes them), or the AdamW state (``optimizer.safetensors``: exp_avg.<n>, exp_avg_sq.<n>, step)."""
    from safetensors.numpy import load_file

    from mindtrain.trainer.export_hf import export_hf
    from mindtrain.trainer.sharded import ShardedReader

    folder = os.path.join(ckpt, f"iter_{step:07d}")
    if not os.path.isdir(folder):
        return _from_mindformers_layout(os.path.join(ckpt, f"iteration_{step:08d}"), name)
    if name == "optimizer.safetensors":
        reader = ShardedReader(folder)
        return reader.read_all(n for n in reader.names() if n == "step" or n.startswith("exp_avg"))
    out = folder + "_hf"
    if not os.path.isdir(out):
        export_hf(folder, out)
    return load_file(os.path.join(out, "model.safetensors"))


def _from_mindformers_layout(folder: str, name: str) -> dict:
    """A checkpoint.layout=mindformers folder, tensors named as mindtrain's files name them."""
    from mindtrain.models import config_from_hf, hf_state_dict
    from mindtrain.trainer import mindformers_checkpoint as mf

    model, opt, _ = mf.read_checkpoint(folder)
    # MindFormers' PyNative parameter names (mindformers_names.py) back to the network's own
    model, opt = mf.network_tensors(model, opt, config_from_hf(json.load(open(os.path.join(folder, "config.json")))))
    if name == "optimizer.safetensors":  # adam_m./adam_v./global_step -> exp_avg./exp_avg_sq./step
        out = {"step": opt.pop("global_step").reshape(())}
        out.update({f"{mf.MOMENTS[k.split('.', 1)[0]]}.{k.split('.', 1)[1]}": v for k, v in opt.items()})
        return out

    class Param:
        def __init__(self, n, a):
            self.name, self._a = n, a

        def asnumpy(self):
            return self._a

    class View:  # what hf_state_dict reads of a model: its config and named parameters
        config = config_from_hf(json.load(open(os.path.join(folder, "config.json"))))

        def get_parameters(self):
            return iter(Param(n, a) for n, a in model.items())

    return hf_state_dict(View())


def _rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(float(np.linalg.norm(b)), 1e-30))


def _assert_same(run: dict, ref: dict, first_step: int = 1, steps: int = STEPS, moments_tol: float = 1e-5) -> None:
    assert run["steps"] == list(range(first_step, steps + 1))
    want = ref["figures"][first_step - 1:]
    err = np.abs(run["figures"] - want) / np.maximum(np.abs(want), 1e-30)
    assert err.max() < 1e-5, (run["figures"], want)
    # the evaluation after the last step: the same weights give the one-process eval loss
    got, exp = run["rows"][-1]["validation_loss"], ref["rows"][-1]["validation_loss"]
    assert abs(got - exp) <= 1e-5 * abs(exp), (got, exp)
    for name in ("model.safetensors", "optimizer.safetensors"):  # weights and AdamW moments, full shape
        got, exp = _weights(run["ckpt"], steps, name), _weights(ref["ckpt"], steps, name)
        assert sorted(got) == sorted(exp)
        worst = max((_rel(got[n], exp[n]), n) for n in exp)
        assert worst[0] < (moments_tol if name == "optimizer.safetensors" else 1e-5), (name, worst)


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    from mindtrain.trainer.quickstart import prepare_data

    tmp = str(tmp_path_factory.mktemp("layouts"))
    prepare_data(os.path.join(tmp, "data", "pydoc"))
    return tmp


def _port(preferred: int, offset: int) -> int:
    """A job's preferred msrun port, or ``MINDTRAIN_TEST_PORT`` + ``offset`` when that is set."""
    base = os.environ.get("MINDTRAIN_TEST_PORT")
    return int(base) + offset if base else preferred


@pytest.fixture(scope="module")
def jobs(work):
    """Every run of the module by name, started on first use; the single process and the
    ZeRO-3 job start together."""
    started: dict[str, _Job] = {}

    def start(name: str) -> _Job:
        if name not in started:
            if name == "ref":
                started[name] = _Job(work, "ref", 1)
            elif name in RESUMES:
                folder = os.path.join(work, "zero3", "ckpt", f"iter_{STEPS - 1:07d}")
                extra = [f"checkpoint.load_path={folder}"] + RESUMES[name][1]
                started[name] = _Job(work, name, RESUMES[name][0], extra,
                                     port=_port(8560, 1) if name == "resume_tp2" else _port(8620, 2))
            else:
                workers, extra = LAYOUTS[name]
                # EP=2 runs beside TP=2: its own preferred port
                started[name] = _Job(work, name, workers, extra, port=_port(8500, 3) if name == "ep2" else _port(8380, 0))
        return started[name]

    start("ref")
    start("zero3")
    yield start
    for job in started.values():
        job.kill()


@pytest.fixture(scope="module")
def reference(jobs):
    return jobs("ref").result()


@pytest.fixture(scope="module")
def zero3(jobs):
    result = jobs("zero3").result()
    for name in RESUMES:  # its step-3 checkpoint is written: the resumes run beside the next jobs
        jobs(name)
    return result


def test_fsdp_zero3_equals_one_process(zero3, reference):
    """ZeRO-3 with compiled layers: each unit's graph runs on the weights the unit gathers."""
    _assert_same(zero3, reference)
    # rank 0 holds half the AdamW moments (dim-0 shards, padded) ...
    ratio = zero3["rows"][-1]["optimizer_bytes"] / reference["rows"][-1]["optimizer_bytes"]
    assert 0.45 < ratio < 0.55, ratio
    # ... and half the parameters: no full weight of any layer stays between steps
    want = reference["rows"][-1]["param_bytes"] / 2
    assert abs(zero3["rows"][-1]["param_bytes"] / want - 1) < 1e-3, (zero3["rows"][-1]["param_bytes"], want)


@pytest.mark.parametrize("layout", ["tp2", "ep2", "pp2_cp2_ep2", "hsdp"])
def test_layout_equals_one_process(jobs, reference, layout):
    if layout in ("tp2", "ep2"):  # the two 2-worker jobs run together
        jobs("tp2")
        jobs("ep2")
    run = jobs(layout).result()
    _assert_same(run, reference)
    if layout == "hsdp":  # a rank holds half of every dense weight and a quarter of the experts
        experts = sum(a.nbytes for n, a in _weights(reference["ckpt"], STEPS).items() if ".mlp.experts." in n)
        dense = reference["rows"][-1]["param_bytes"] - experts  # one process holds every weight
        got = run["rows"][-1]["param_bytes"]
        assert abs(got / (dense / 2 + experts / 4) - 1) < 0.01, (got, dense, experts)
    if layout == "ep2":  # checkpoint.layout=mindformers: each rank wrote its own pieces, once
        _each_rank_wrote_its_pieces(os.path.join(run["ckpt"], f"iteration_{STEPS:08d}"))


def _each_rank_wrote_its_pieces(folder: str) -> None:
    """Both ranks wrote files (MindFormers' names), and the files' tensors add up to exactly
    one copy of every tensor of the checkpoint (nothing written twice)."""
    from mindtrain.trainer import mindformers_checkpoint as mf
    from mindtrain.trainer.sharded import read_header

    files = sorted(f for f in os.listdir(folder) if f.endswith(".safetensors"))
    n = len(files) // 2  # per kind: one per rank, or two where a rank writes two boxes of linear_qkv
    assert files == sorted(f"ds3-{k}-{i:07d}-{n:07d}.safetensors" for k in ("model", "opt") for i in range(n))
    meta = json.load(open(os.path.join(folder, mf.METADATA_FILE)))
    assert {s["storage_rank"] for stores in meta["storage_data"].values() for s in stores} == {0, 1}
    stored = sum(end - start for f in files for start, end in
                 (t["data_offsets"] for t in read_header(os.path.join(folder, f))[0].values()))
    model, opt, _ = mf.read_checkpoint(folder)
    assert stored == sum(a.nbytes for a in list(model.values()) + list(opt.values())), stored


@pytest.mark.parametrize("name", list(RESUMES))
def test_resume_from_a_sharded_checkpoint(jobs, reference, zero3, name):
    """The 2-worker ZeRO-3 run's sharded checkpoint (each rank's dim-0 shards) resumes in one
    process (with selective recompute), under TP=2 (with full recompute) and under PP=2: step
    4's figures and the final weights and moments equal the uninterrupted run."""
    resumed = jobs(name).result()
    _assert_same(resumed, reference, first_step=STEPS)
