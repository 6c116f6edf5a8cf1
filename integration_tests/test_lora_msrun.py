"""lora_config under msrun: one 2-worker job trains the tiny DeepSeek-V3 with LoRA under FSDP
ZeRO-3, then under tensor (+ sequence) parallelism, then over two pipeline stages (each stage's
adapters, their gradient norm and clipping over both stages, the adapters saved alone from
both), then under context parallelism (MLA's kv_b_proj runs on the gathered keys of the whole
sequence: its LoRA dropout masks follow those tokens), then under ZeRO-3 with Muon on the
adapters (as MindFormers' optimizer holds only them: each adapter a whole matrix for
Newton-Schulz, gathered from its shards), then the tiny DeepSeek-V4 (hybrid attention with its
compressor and indexer, an MTP module) under ZeRO-3, while one plain process trains each alone
(DeepSeek-V3 with AdamW and with Muon, DeepSeek-V4; workers/lora_run.py). In every layout the frozen base stays bit-identical on every rank, only the
adapters have optimizer state and move, resume from a saved step is exact, and the figures
match the single process's step after step, with lora_dropout 0.1 (the adapters unmerged, their
input masks drawn per token and global feature, so ZeRO-3 and TP draw one process's masks). The adapters' gradients against PEFT and the
merged export are in packages/trainer/tests/test_lora.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from safetensors.numpy import load_file

from mindtrain.trainer.quickstart import free_port, prepare_data, worker_env

pytestmark = pytest.mark.msrun

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "workers", "lora_run.py")


def test_lora_zero3_tp2_pp2_and_cp2_match_one_process_with_a_frozen_base(tmp_path):
    prefix = prepare_data(str(tmp_path / "data" / "pydoc"))
    env = {**worker_env(), "PYTHONPATH": os.pathsep.join([os.path.join(HERE, "workers"),
                                                          os.environ.get("PYTHONPATH", "")])}
    log = open(tmp_path / "msrun.log", "w")
    two = subprocess.Popen(["msrun", "--worker_num=2", "--local_worker_num=2", f"--master_port={free_port(int(os.environ.get('MINDTRAIN_TEST_PORT', 9110)))}",
                            "--join=True", f"--log_dir={tmp_path / 'log'}", WORKER, str(tmp_path), prefix,
                            "zero3,tp2,pp2,cp2,zero3_muon,v4_zero3"], cwd=tmp_path, env=env, stdout=log,
                           stderr=subprocess.STDOUT)
    one = subprocess.run([sys.executable, WORKER, str(tmp_path), prefix, "ref,ref_muon,v4_ref"], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=900)
    assert one.returncode == 0, one.stderr[-4000:]
    rc = two.wait(timeout=900)
    logs = "".join(open(os.path.join(tmp_path, "log", f)).read()[-3000:] for f in sorted(os.listdir(tmp_path / "log")))
    assert rc == 0, logs

    def rows(case, rank=0):
        return json.loads((tmp_path / f"{case}.{rank}.json").read_text())

    keys = ("loss", "grad_norm", "mtp_loss", "load_balancing_loss")
    # DeepSeek-V3: 16 Linear layers of the decoder layers, 9 of the MTP module, the head (26: 52 PEFT
    # tensors); the fused linear_qkv and linear_fc1 of each of its 3 layers share one lora_a: 6 fewer
    # parameters. DeepSeek-V4: 20 of its 2 decoder layers (sliding, compressed sparse: compressor and
    # indexer), 8 of the MTP module, the head (29: 58); the shared experts' linear_fc1 of 3 layers: 3 fewer
    layers = {"ref": 26, "ref_muon": 26, "v4_ref": 29}
    shared = {"ref": 6, "ref_muon": 6, "v4_ref": 3}
    for case, one_process in (("zero3", "ref"), ("tp2", "ref"), ("pp2", "ref"), ("cp2", "ref"),
                              ("zero3_muon", "ref_muon"), ("v4_zero3", "v4_ref")):
        ref = rows(one_process)
        assert ref["adapters"] == 2 * layers[one_process] - shared[one_process]
        want = np.array([[r[k] for k in keys] for r in ref["rows"]])
        saved_ref = load_file(tmp_path / one_process / "ck" / "lora" / "iter_0000003" / "adapter_model.safetensors")
        assert len(saved_ref) == 2 * layers[one_process]  # PEFT's names: a lora_A per part
        # the adapters saved alone (rank 0 writes them; under PP it collects every stage's)
        saved = load_file(tmp_path / case / "ck" / "lora" / "iter_0000003" / "adapter_model.safetensors")
        assert sorted(saved) == sorted(saved_ref), case
        for n, want_a in saved_ref.items():  # AdamW's normalised steps: float noise of 3e-8 in the
            # figures moves an element of an adapter by up to 1.2e-4 of its largest value after 3
            # steps (TP2: layer 0's q_a_proj lora_B); per tensor, 1.7e-5 of its norm
            err = np.linalg.norm(saved[n] - want_a) / np.linalg.norm(want_a)
            assert err <= 1e-4, (case, n, err)
        for rank in (0, 1):
            got = rows(case, rank)
            a = np.array([[r[k] for k in keys] for r in got["rows"]])
            err = float((np.abs(a - want) / np.maximum(np.abs(want), 1e-30)).max())  # V4: no balance loss (0)
            print(f"LoRA {case} rank {rank} vs one process: max relative difference over {len(a)} steps {err:.2e}; "
                  f"{got['changed']} of this rank's adapter pieces moved; {got['seconds']:.1f} s")
            assert err < 1e-5, (case, rank, a, want)
    print(f"one process: {rows('ref')['seconds']:.1f} s")
    # Muon moved the adapters otherwise than AdamW did
    adamw = load_file(tmp_path / "ref" / "ck" / "lora" / "iter_0000003" / "adapter_model.safetensors")
    muon = load_file(tmp_path / "ref_muon" / "ck" / "lora" / "iter_0000003" / "adapter_model.safetensors")
    assert all(not np.allclose(adamw[n], muon[n]) for n in adamw if "lora_B" in n or "lora_b" in n)
