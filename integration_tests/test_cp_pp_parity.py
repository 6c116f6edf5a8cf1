"""Context and pipeline parallelism equal the single-process run (issue 7).

Three single-process reference runs (the model's own forward in the trainer's loop; 2 and 4
micro-batches per step, and 2 with attention and hidden dropout 0.1 for the Ulysses and hybrid
runs, whose masks must be one process's: issue 34) beside one 2-worker msrun job that trains 3 steps of 2 micro-batches
under CP=2 (colossal, and Ulysses: all-to-all between sequence chunks and head groups around
each attention core), PP=2 with 1F1B, PP=2 with GPipe and PP=2 with interleaved 1F1B over 2 chunks per
stage (packed documents with reset positions and EOD masks; PP=2 with 1F1B keeps the
model's compiled layers, the other runs build eager ones: compiling every layer of every run
on every rank cost more than their few eager steps), then lets a stage fail. A 4-worker job,
started at the same time, trains the combinations PP=2 x FSDP=2 with ZeRO-3 per stage (compiled
layers on the gathered weights; 4 micro-batches per step, so each
data-parallel pipeline runs 2), PP=2 x EP=2 x FSDP=2 with ZeRO-1 per stage (EP borrows the 2
data-parallel ranks), CP=2 x TP=2 (2 micro-batches per step), hybrid CP=4 and HSDP under PP (ZeRO-3)
and under CP (ZeRO-2).

Issue 34's combinations: a Ulysses run (2 workers) and the hybrid run (4 workers) track the max
attention logits (QK-clip, MaxLogitsMonitor) and recompute the attention (Ulysses: layer 0 whole
and the core alone in row blocks, recompute applied before the layout as the trainer does; hybrid:
every layer, applied after it); their step's max-logit table over all ranks equals the reference's
(every reference records it), and under Ulysses each rank's own record already does.

The parameter check uses plain SGD: AdamW's first steps move every weight by about
``lr * sign(g)``, so a gradient element that is zero up to fp32 round-off (a sum of partial
gradients that cancel, computed in another order under CP) can flip sign and move a weight
by ``2 * lr``; SGD propagates gradient differences linearly. The losses, balance loss, MTP
loss and gradient norm of every step are compared as well.
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.msrun

WORKER = Path(__file__).parent / "workers" / "cp_pp_parity.py"
CONFIGS = {"cp2": "1:2:1f1b", "pp2_1f1b": "2:1:1f1b", "pp2_gpipe": "2:1:gpipe",
           # Ulysses (issue 34): sequence chunks <-> head groups by all-to-all around each attention core;
           # with attention and hidden dropout 0.1, against the reference with dropout (the keep
           # masks go with the queries to the head groups)
           "cp2_ulysses_dropout": "1:2:1f1b",
           # Ulysses with the max attention logits tracked (QK-clip, MaxLogitsMonitor) and the
           # attention recomputed (layer 0 whole, the core alone in the others, in row blocks)
           "cp2_ulysses_recompute_logits": "1:2:1f1b",
           # 2 chunks per stage (4 virtual stages): rank 0 runs layers 0 and 2, rank 1 layer 1 and the head
           "pp2_interleaved": "2:1:interleaved_1f1b:1:1:-:2:2"}
# name -> pp:cp:schedule:tp:ep:dp_sharding:micro-batches per step on 4 workers. PP x FSDP
# (ZeRO-3) takes 4 micro-batches per step, so each of its 2 data-parallel pipelines runs 2;
# ZeRO-2 is ZeRO-3's gradient path without the weight gathering, ZeRO-1 runs under PP x EP.
CONFIGS_4 = {"pp2_fsdp2_zero3": "2:1:1f1b:1:1:optim_grads_params:4", "cp2_tp2": "1:2:1f1b:2:1:-:2",
             "pp2_ep2_fsdp2_zero1": "2:1:1f1b:1:2:optim:2",
             # hybrid CP (issue 34): Ulysses inside pairs of CP ranks, keys/values gathered across the pairs
             # with every layer recomputed (applied after the layout) and the max logits tracked
             "cp4_hybrid2_dropout_recompute_logits": "1:4:1f1b:1:1:-:2",
             # HSDP under PP (ZeRO-3) and CP (ZeRO-2): the dense weights sharded within groups
             # of 1 data-parallel rank, replicated over 2 (gradients averaged over the replicas)
             "pp2_fsdp2_zero3_hsdp1": "2:1:1f1b:1:1:optim_grads_params:4",
             "cp2_fsdp2_zero2_hsdp1": "1:2:1f1b:1:1:optim_grads:2"}
TOL = 1e-5
# the runs with compiled (ms.jit) layers: PP alone keeps them whole (no layer is patched);
# under PP x ZeRO-3 the stage's weights are gathered for the step by set_data, which the
# compiled layers take as graph inputs
COMPILED = ("pp2_1f1b", "pp2_fsdp2_zero3")


def _env():
    env = dict(os.environ)
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    env.setdefault("GLOG_v", "3")
    env["CP_PP_OPT"] = "sgd"
    env["CP_PP_MICRO"] = "2"
    env["CP_PP_COMPILED"] = ",".join(COMPILED)
    return env


def _reference(tmp: Path, micro: int, core: int, dropout: bool = False) -> subprocess.Popen:
    env = _env()
    env["CP_PP_MICRO"] = str(micro)
    env["CP_PP_REF_CORE"] = str(core)
    env["CP_PP_DROPOUT"] = "1" if dropout else "0"
    name = f"reference_dropout_{micro}.npz" if dropout else f"reference_{micro}.npz"
    return subprocess.Popen([sys.executable, str(WORKER), "reference", str(tmp / name), "--docs"],
                            env=env, cwd=tmp, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    """Both references, the 2-worker job and the 4-worker job, all started at once (the jobs
    wait on their pipeline neighbours much of the time; each process is pinned to one core,
    four per core). The parallel ranks wait for a reference's file only to compare."""
    tmp = tmp_path_factory.mktemp("cp_pp")
    ref = tmp / "reference_{micro}.npz"
    # 2 micro-batches per step, and 4 for the data-parallel pipelines of the 4-worker job;
    # the msrun ranks take cores 0, 1 (2 workers) and 0, 1, 0, 1 (4 workers)
    # and 2 with attention and hidden dropout ("..._dropout" runs: Ulysses and hybrid CP, issue 34)
    references = [_reference(tmp, 2, core=-1), _reference(tmp, 4, core=0), _reference(tmp, 2, core=1, dropout=True)]
    specs = [f"{k}:{v}" for k, v in CONFIGS.items()] + ["fail:2:1:1f1b"]
    start = time.monotonic()
    port = int(os.environ.get("MINDTRAIN_TEST_PORT", 8521))
    job = subprocess.Popen(["msrun", "--worker_num=2", "--local_worker_num=2", f"--master_port={port}", "--join=True",
                            f"--log_dir={tmp / 'msrun_log'}", str(WORKER), "parallel", str(tmp), str(ref), *specs,
                            "--docs"],
                           env=_env(), cwd=tmp, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                           start_new_session=True)
    (tmp / "4").mkdir()
    specs4 = [f"{k}:{v}" for k, v in CONFIGS_4.items()]
    with open(tmp / "msrun_4.out", "w") as out4:  # a file: nobody reads this job's output while the other runs
        job4 = subprocess.Popen(["msrun", "--worker_num=4", "--local_worker_num=4", f"--master_port={port + 1}", "--join=True",
                                 f"--log_dir={tmp / 'msrun_log_4'}", str(WORKER), "parallel", str(tmp / "4"), str(ref),
                                 *specs4, "--docs"],
                                env=_env(), cwd=tmp, stdout=out4, stderr=subprocess.STDOUT, start_new_session=True)
    yield tmp, references, job, job4, start
    # msrun's workers outlive a killed msrun; end the whole session
    for j in (job, job4):
        if j.poll() is None:
            os.killpg(j.pid, signal.SIGKILL)
    for r in references:
        if r.poll() is None:
            r.kill()


@pytest.fixture(scope="module")
def run(jobs):
    tmp, references, job, _, start = jobs
    log_dir = tmp / "msrun_log"
    out, _ = job.communicate(timeout=3000)
    proc = subprocess.CompletedProcess(job.args, job.returncode, out)
    elapsed = time.monotonic() - start
    for r in references:
        ref_out, _ = r.communicate(timeout=1200)
        assert r.returncode == 0, ref_out[-3000:]
    logs = "\n".join(p.read_text(errors="replace") for p in sorted(log_dir.glob("worker_*.log")))
    results = [json.loads((tmp / f"cp_pp_{r}.json").read_text()) for r in range(2)]
    return proc, logs, results, elapsed, tmp


@pytest.fixture(scope="module")
def run4(jobs):
    """The 4-worker job (started beside the 2-worker one)."""
    tmp, _, _, job, _ = jobs
    log_dir = tmp / "msrun_log_4"
    job.wait(timeout=3000)
    logs = "\n".join(p.read_text(errors="replace") for p in sorted(log_dir.glob("worker_*.log")))
    out = (tmp / "msrun_4.out").read_text(errors="replace")
    assert job.returncode == 0, out[-2000:] + logs[-6000:]
    return logs, [json.loads((tmp / "4" / f"cp_pp_{r}.json").read_text()) for r in range(4)]


@pytest.mark.parametrize("name", list(CONFIGS_4))
def test_combination_equal_to_single_process(run4, name):
    logs, results = run4
    for rank, res in enumerate(results):
        assert name in res, f"rank {rank} has no result for {name}:\n{logs[-4000:]}"
        r = res[name]
        assert r["figure_rel_err"] < TOL, (name, rank, r["figures"], r["ref_figures"])
        assert r["params_checked"] > 10
        assert r["param_rel_err"] < TOL, (name, rank, r["param_rel_err"])
        if "zero3" in name and "hsdp" not in name:
            # the stage's weights are shards between steps: half its dense bytes, plus padding
            assert r["resident_bytes"] <= 0.55 * r["stage_bytes"], (rank, r["resident_bytes"], r["stage_bytes"])
        if name in COMPILED:
            assert r["compiled"], (name, rank)
        if "hybrid" in name:  # every attention core ran Ulysses in a pair, keys/values gathered over 2 pairs
            assert r["ulysses_rings"] and set(r["ulysses_rings"]) == {2}, (rank, r["ulysses_rings"])
        if "zero1" in name:
            # full weights stay resident beside their shards
            assert r["resident_bytes"] >= r["stage_bytes"], (rank, r["resident_bytes"], r["stage_bytes"])
        if "hsdp" in name:
            assert r["hsdp_replicas"] == 2, (rank, r["hsdp_replicas"])
        _check_logits_and_recompute(name, r)


def _check_logits_and_recompute(name, r):
    if "logits" in name:  # the step's max logits over all ranks equal one process's, every step
        assert r["logit_rel_err"] < TOL, (name, r["logit_rel_err"])
        if "ulysses" in name:  # and each rank's own record already has every head's, whole sequence
            assert r["local_logit_rel_err"] < TOL, (name, r["local_logit_rel_err"])
    if "recompute" in name:  # recomputed forwards ran; every attention core ran its row blocks inside Ulysses
        assert r["recomputed"] > 0 and r["row_blocks"] == 4, (name, r["recomputed"], r["row_blocks"])


@pytest.mark.parametrize("name", list(CONFIGS))
def test_equal_to_single_process(run, name):
    _, logs, results, _, _ = run
    for rank, res in enumerate(results):
        assert name in res, f"rank {rank} has no result for {name}:\n{logs[-4000:]}"
        r = res[name]
        # per-step loss, balance loss, MTP loss, total loss and grad norm on every rank
        assert r["figure_rel_err"] < TOL, (name, rank, r["figures"], r["ref_figures"])
        # every parameter this rank trains (its stage), plus the expert biases
        assert r["params_checked"] > 10
        assert r["param_rel_err"] < TOL, (name, rank, r["param_rel_err"])
        _check_logits_and_recompute(name, r)
    if name.startswith("pp2"):
        assert results[0][name]["stage_units"][0] == "embedding"
        assert results[1][name]["stage_units"][-2:] == ["head", "mtp.0"]
    if name in COMPILED:  # the schedule kept the compiled layers
        assert all(res[name]["compiled"] for res in results)
    if "ulysses" in name:  # every attention core ran Ulysses over the whole CP group
        assert all(res[name]["ulysses_rings"] and set(res[name]["ulysses_rings"]) == {None} for res in results)
    if name == "pp2_interleaved":
        assert results[0][name]["stage_units"] == ["embedding", "layers.0", "layers.2"]


def test_failing_stage_ends_the_pipeline_with_its_error(run):
    proc, logs, _, _, _ = run
    assert proc.returncode != 0
    assert "rank 1 failed: RuntimeError: injected stage failure" in logs
