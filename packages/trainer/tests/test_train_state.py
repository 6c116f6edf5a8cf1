"""monitor.train_state (per-parameter gradient norms and each rank's losses) and
monitor.moe_monitor (tokens per expert) in the log."""

import json
import math
import os
import re
import threading

import numpy as np
import pytest

from mindtrain.config import ConfigError
from mindtrain.trainer.monitor import TrainStateMonitor
from mindtrain.trainer.runtime import Runtime
from mindtrain.trainer.trainer import Trainer

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
TINY = os.path.join(ROOT, "configs", "pynative_ds3_tiny.yaml")
NORM = re.compile(r'^\{ "(local_norm|device_norm)": (\S+):\s+(\S+) \}$')


def _norms(lines, kind):
    return {m.group(2): float(m.group(3)) for m in map(NORM.match, lines) if m and m.group(1) == kind}


def test_train_state_lines_hold_the_step_gradient_norms_and_losses(tiny_config):
    lines = []
    cfg = tiny_config("training.steps=2", "monitor.train_state.local_norm=true", "monitor.train_state.local_loss=true",
                      "monitor.train_state.device_norm=['embed_tokens', 'model.norm']",
                      "monitor.train_state.device_loss=true", "monitor.moe_monitor.save_tokens_per_expert_interval=2",
                      "monitor.moe_monitor.target_layers=[0, 1]")
    trainer = Trainer(cfg, Runtime(device="CPU"), out=lines.append)
    history = trainer.train()
    last = lines[lines.index(next(x for x in lines if x.startswith("{ step:[    2/"))):]
    local, device = _norms(last, "local_norm"), _norms(last, "device_norm")
    # every trainable parameter, and together they make the step's global norm (one process)
    assert set(local) == {n for n, _ in trainer.params}
    total = math.sqrt(sum(v * v for v in local.values()))
    assert math.isclose(total, history[1]["grad_norm"], rel_tol=1e-5), (total, history[1]["grad_norm"])
    assert set(device) == {"model.embed_tokens.weight", "model.norm.weight"}
    for name, v in device.items():  # one process: the whole model's gradient is this rank's
        assert math.isclose(v, local[name], rel_tol=1e-5), name
    records = [json.loads(x) for x in last if x.startswith('{"step"')]
    micro = [r for r in records if "local_loss" in r]
    assert [r["micro_step"] for r in micro] == [1, 2]  # global batch 2 = 2 micro-batches of 1
    assert math.isclose(sum(r["local_loss"] for r in micro) / 2, history[1]["loss"], rel_tol=1e-6)
    dev = [r for r in records if "device_loss" in r]
    assert len(dev) == 1 and dev[0]["ranks"] == [dev[0]["device_loss"]]
    assert math.isclose(dev[0]["device_loss"], history[1]["loss"], rel_tol=1e-6)
    # moe_monitor: every 2nd step, target layer 1 (layer 0 is dense: said once at start-up)
    assert [x for x in lines if "target_layers" in x] == [
        "mindtrain: monitor.moe_monitor.target_layers: decoder layer 0 is not a MoE layer (no tokens per expert)"]
    tpe = [json.loads(x) for x in lines if '"tpe"' in x]
    assert [(r["step"], r["block"], r["layer"]) for r in tpe] == [(2, "decoder", 1)]
    m = cfg.model
    assert len(tpe[0]["tpe"][0]) == m.n_routed_experts
    assert sum(tpe[0]["tpe"][0]) == 2 * 32 * m.num_experts_per_tok  # every token of the global batch, top-k


def test_norm_settings():
    on = TrainStateMonitor(local_norm=True)
    assert on.active and on._selected(on.local_norm, "a.b") and on.device_norm is None
    pat = TrainStateMonitor(local_norm="", device_norm=["experts", ""])
    assert pat.local_norm is None and pat._selected(pat.device_norm, "layers.1.mlp.experts.0.w")
    assert not pat._selected(pat.device_norm, "layers.1.attn.w")
    assert not TrainStateMonitor().active
    with pytest.raises(ConfigError, match="monitor.train_state.local_norm"):
        TrainStateMonitor(local_norm=[1])


class _Collectives:
    """Ranks played by threads in this process: each call is every rank's all-gather."""

    def __init__(self, world: int):
        self.barrier = threading.Barrier(world)
        self.slots = [None] * world

    def gather(self, rank: int, value):
        self.slots[rank] = value
        self.barrier.wait()
        out = list(self.slots)
        self.barrier.wait()
        return out


def test_device_norms_sum_each_rank_s_pieces_once(tiny_data):
    """The 4 ranks of FSDP ZeRO-3 (2) x TP (2), laid out here without collectives, take their
    weight pieces as gradients: every rank's DeviceNorms (its exchange and its one all-reduce
    played by threads) gives each parameter's norm of the whole array, the pieces TP
    replicates counted once."""
    import mindspore as ms

    from mindtrain.config import load_config
    from mindtrain.config.derived import num_accumulation_steps, resolve_parallelism
    from mindtrain.trainer.checkpoint import Checkpointer
    from mindtrain.trainer.monitor import DeviceNorms
    from mindtrain.trainer.share import build_share

    ms.set_device("CPU")
    ms.runtime.launch_blocking()
    base = ["model.seq_length=32", "train_dataset.dataloader.config.seq_length=32", "model.num_hidden_layers=2",
            "compile.enable=false", f"train_dataset.dataloader.config.data_path=['1', '{tiny_data}']"]
    layout = ["parallelism.data_parallel_shard=2", "parallelism.tensor_parallel=2",
              "parallelism.data_parallel_shard_strategy=optim_grads_params"]
    ranks = []
    for world, rank, extra in [(1, 0, [])] + [(4, r, layout) for r in range(4)]:
        cfg = load_config(TINY, base + extra, world_size=world)
        dims = resolve_parallelism(cfg.parallelism, world)
        share = build_share(cfg, dims, rank, Checkpointer(cfg, rank, world, dims.dp), "float32",
                            num_accumulation_steps(cfg, dims), cfg.train_dataset.dataloader.column_names, connect=False)
        ranks.append(share.layout)
    whole = {n: float(np.linalg.norm(t.asnumpy().astype(np.float64))) for n, t in ranks[0].named_params}
    wire = _Collectives(4)
    norms = [None] * 4

    def run(rank: int) -> None:
        layout = ranks[1 + rank]
        dn = DeviceNorms(layout.shards(), lambda b: wire.gather(rank, b), lambda v: sum(wire.gather(rank, v)))
        norms[rank] = dn([t for _, t in layout.named_params], lambda n: True)

    threads = [threading.Thread(target=run, args=(r,)) for r in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert norms[0] == norms[3] and sorted(norms[0]) == sorted(whole)
    for name, v in whole.items():
        assert math.isclose(norms[0][name], v, rel_tol=1e-12), (name, norms[0][name], v)
