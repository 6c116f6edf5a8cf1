"""TP=2 x EP=2 x FSDP=2, EP=2 x FSDP (4 ranks, experts sharded over edp=2) and TP=2 x EP=2 x
ZeRO-3 (compiled pieces between the collectives, per-layer units) train the tiny DeepSeek-V3 exactly
like one process: same per-step losses and final parameters; per-rank parameter and
activation bytes shrink as TP/SP/EP/FSDP say. The 4-worker job runs over MindSpore's own
collectives (``MINDTRAIN_CPU_TRANSPORT=mccl``), the path a multi-node job takes.

The single-process reference runs (as a plain process) while the 4-worker msrun job runs
the three layouts in one launch. Every layout: the tiny config with 2 decoder layers (dense +
MoE) and its MoE MTP module, 3 steps, 8 sequences of 16 tokens per step, 2 accumulation
micro-batches per rank, the trainer's AdamW, the aux-loss-free bias update with the global
expert load. TP=2 and EP=2 alone are proven through the trainer itself
(test_trainer_layouts.py: run_mindformer.py under msrun against one process, 4 steps).
"""

import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from parity import LOSS_RTOL, assert_same_training  # noqa: E402

pytestmark = pytest.mark.msrun

WORKER = Path(__file__).parent / "workers" / "tp_ep_parity.py"
ROOT = Path(__file__).resolve().parent.parent


def _env():
    env = dict(os.environ)
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    env.setdefault("GLOG_v", "3")
    return env


@pytest.fixture(scope="module")
def out_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tp_ep")
    log = open(d / "ref.log", "w")
    proc = subprocess.Popen([sys.executable, str(WORKER), str(d), "ref"], env=_env(), cwd=d,
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    yield d, proc
    if proc.poll() is None:
        proc.kill()


def _msrun(d: Path, workers: int, port: int, cases: str, transport: str = "shm"):
    log_dir = d / f"log_{workers}"
    cmd = ["msrun", f"--worker_num={workers}", f"--local_worker_num={workers}", f"--master_port={port}",
           f"--log_dir={log_dir}", "--join=True", str(WORKER), str(d), cases]
    # a generous hang guard, not a timing check; the whole process group goes on timeout
    # (killing msrun alone leaves its workers running)
    env = {**_env(), "MINDTRAIN_CPU_TRANSPORT": transport}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=d,
                            start_new_session=True)
    try:
        proc.communicate(timeout=2400)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
    logs = "\n".join(p.read_text(errors="replace")[-3000:] for p in sorted(log_dir.glob("worker_*.log")))
    assert proc.returncode == 0, logs


def _reference(d: Path, proc) -> dict:
    assert proc.wait(timeout=2400) == 0, (d / "ref.log").read_text()[-3000:]
    return dict(np.load(d / "ref.npz"))


@pytest.fixture(scope="module")
def results(out_dir):
    """The reference and every case of the one 4-worker launch, by name."""
    d, ref_proc = out_dir
    # over MindSpore's own collectives (mccl), the path a multi-node job takes, not the
    # same-host shared-memory transport every other multi-rank test runs
    _msrun(d, 4, 8402, "tp2_ep2_fsdp2,ep2_fsdp4,tp2_ep2_zero3_compiled,ep2_fsdp4_dedup,tp2_ep2_etp1", transport="mccl")
    out = {"ref": _reference(d, ref_proc)}
    for case in ("tp2_ep2_fsdp2", "ep2_fsdp4", "tp2_ep2_zero3_compiled", "ep2_fsdp4_dedup", "tp2_ep2_etp1"):
        out[case] = dict(np.load(d / f"{case}.npz"))
    return out


def test_tp2_ep2_fsdp2_and_ep2_fsdp4_match_single_process(results):
    ref, both, epf = results["ref"], results["tp2_ep2_fsdp2"], results["ep2_fsdp4"]
    assert_same_training(ref, both, "tp2_ep2_fsdp2")
    assert_same_training(ref, epf, "ep2_fsdp4")
    full = int(ref["param_bytes_local"])
    experts = sum(ref[k].nbytes for k in ref if k.startswith("p:") and ".mlp.experts." in k)
    dense = full - experts
    # TP + EP: the routed experts are split over ep=2 and their intermediate dim over tp=2;
    # TP halves every other matrix but the small low-rank projections, router and eh_proj
    assert int(both["param_bytes_local"]) - experts // 4 < 0.6 * dense
    assert int(both["param_bytes_local"]) - experts // 4 > 0.5 * dense
    # EP alone: the experts split over ep=2 and their rows over edp=2
    assert int(epf["param_bytes_local"]) == full - experts + experts // 4
    # sequence parallelism: activations outside the TP regions are 1/TP, inside mostly too
    assert int(both["activation_bytes"]) < 0.75 * int(ref["activation_bytes"])
    # resident shards: FSDP over 2 halves the TP-split dense weights again; EP halves the
    # experts and edp=2 halves them again while FSDP over 4 shards the rest
    assert int(both["fsdp_param_bytes"]) <= 0.3 * full
    assert int(epf["fsdp_param_bytes"]) <= 0.3 * full


def test_alltoall_deredundancy_matches_and_sends_fewer_bytes(results):
    """parallelism.moe_token_dispatcher_type: alltoall_deredundancy (issue 34): the same
    training as one process, and rank 0's dispatch and combine sent fewer bytes than the
    alltoall dispatcher's in the same layout (ep2_fsdp4: the same tokens and routing)."""
    ref, plain, dedup = results["ref"], results["ep2_fsdp4"], results["ep2_fsdp4_dedup"]
    assert_same_training(ref, dedup, "ep2_fsdp4_dedup")
    sent, base = int(dedup["ep_sent_bytes"]), int(plain["ep_sent_bytes"])
    assert 0 < sent < 0.9 * base, (sent, base)


def test_expert_tensor_parallel_1_with_tp_and_ep_matches_single_process(results):
    """MindFormers' expert_tensor_parallel: 1 under TP=2 x EP=2 x ZeRO-3 (issue 34): the routed
    experts whole on both TP ranks, each dispatching its own sequence shard over its EP
    group, their gradients summed over TP. Same training as one process; a rank holds half
    the experts (EP), none of them TP-split."""
    ref, got, split = results["ref"], results["tp2_ep2_etp1"], results["tp2_ep2_zero3_compiled"]
    assert_same_training(ref, got, "tp2_ep2_etp1")
    np.testing.assert_allclose(got["grad_norms"], ref["grad_norms"], rtol=LOSS_RTOL)
    experts = sum(ref[k].nbytes for k in ref if k.startswith("p:") and ".mlp.experts." in k)
    assert int(got["expert_bytes"]) == experts // 2 == 2 * int(split["expert_bytes"])


def test_tp2_ep2_zero3_compiled_by_regions_matches_single_process(results):
    """TP=2 x EP=2 x ZeRO-3 over dp=2 (EP over the two dp ranks) as ShardedLayout lays it
    out from a compiled model: one FSDP unit per decoder layer and MTP module, whose
    compiled pieces run between TP's and EP's collectives with the weights the unit gathers
    (graph inputs). Same losses, grad norms and final weights as one process; between steps
    each rank holds only its dim-0 shards of the TP pieces and its experts."""
    ref, got = results["ref"], results["tp2_ep2_zero3_compiled"]
    assert str(got["transport"]) == "mccl"
    assert_same_training(ref, got, "tp2_ep2_zero3_compiled")
    np.testing.assert_allclose(got["grad_norms"], ref["grad_norms"], rtol=LOSS_RTOL)
    # it really ran compiled, by pieces (TP and EP wrap cells inside every layer), with one
    # unit per decoder layer and the MTP module
    assert bool(got["compiled"]) and int(got["whole_layers"]) == 0 and int(got["units"]) == 3
    # resident between steps: the shards and the experts, no full weight of any layer
    assert int(got["expert_bytes"]) > 0
    assert int(got["param_bytes_layout"]) == int(got["shard_bytes"]) + int(got["expert_bytes"])


@pytest.mark.parametrize("case", ["tp2_ep2_zero3_compiled", "tp2_ep2_etp1"])
def test_each_rank_holds_the_estimated_bytes(results, case):
    """mindtrain-estimate against a real run (with test_v4_layouts.py's V4 rows): rank 0's
    parameter bytes resident between steps (its ZeRO-3 shards of the TP pieces, its experts)
    and its AdamW state are the estimate's for the same config under TP=2 x EP=2 x ZeRO-3,
    with the experts TP-split and whole (expert_tensor_parallel 1)."""
    got = results[case]
    assert int(got["param_bytes_layout"]) == int(got["param_bytes_estimate"]), case
    assert int(got["optimizer_bytes"]) == int(got["optimizer_bytes_estimate"]), case
