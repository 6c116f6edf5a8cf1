"""DeepSeek-V3 671B (the model section of configs/pynative_ds3.yaml, unchanged) built for one
rank of a 4,096-device layout that fits it: PP=16 x TP=8 x FSDP ZeRO-3 over 32 x EP=32.

One process plays rank 2000 (a stage-7 rank, which holds no tied weight) with no process
group and no collective (``parallelize(connect=False)``): the model is built without storage
and only that rank's pieces are made. Its parameter bytes are exactly what mindtrain-estimate
says of a stage-7 rank, every other stage's layer stays without storage, and the process
peaks at a few GB where the whole model would take 2.7 TB."""

import json
import os
import subprocess
import sys

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
WORLD, RANK = 4096, 2000
OVERRIDES = ["parallelism.pipeline_parallel=16", "parallelism.expert_parallel=32", "parallelism.tensor_parallel=8",
             "parallelism.data_parallel_shard_strategy=optim_grads_params", "training.global_batch_size=256",
             "compile.enable=false"]

BUILD = """
import json, math, resource, sys
import mindspore as ms
ms.set_device("CPU")
from mindtrain.config import load_config
from mindtrain.config.derived import num_accumulation_steps, resolve_parallelism
from mindtrain.trainer.checkpoint import Checkpointer
from mindtrain.trainer.share import build_share
world, rank, overrides = int(sys.argv[1]), int(sys.argv[2]), json.loads(sys.argv[3])
cfg = load_config("configs/pynative_ds3.yaml", overrides, world_size=world)
dims = resolve_parallelism(cfg.parallelism, world)
share = build_share(cfg, dims, rank, Checkpointer(cfg, rank, world, dims.dp), "float32",
                    num_accumulation_steps(cfg, dims), cfg.train_dataset.dataloader.column_names, connect=False)
layout = share.layout
stored = [p for p in share.model.get_parameters() if getattr(p, "device", "") != "meta" and p.size]
print(json.dumps({
    "stage": layout.stage_index,
    "held": sum(int(t.size) * t.itemsize for _, t in layout.named_params),
    "model_numel": sum(math.prod(info.shape) for info in share.plan.params.values()),
    "stored_names": sorted(p.name for p in stored),
    "units": layout.parts[layout.stage_index],
    "rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}))
"""


def test_a_rank_of_the_671b_model_builds_only_its_share():
    from mindtrain.config import load_config
    from mindtrain.trainer.estimate import estimate

    out = subprocess.run([sys.executable, "-c", BUILD, str(WORLD), str(RANK), json.dumps(OVERRIDES)], cwd=ROOT,
                         capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["model_numel"] > 670e9  # the real model: 671B parameters (MTP module included)
    est = estimate(load_config(os.path.join(ROOT, "configs", "pynative_ds3.yaml"), OVERRIDES, world_size=WORLD),
                   WORLD, device="CPU")
    stage = est.stages[got["stage"]]
    assert got["stage"] == 7 and got["units"] == stage.units
    # exactly the estimator's resident parameters of a stage-7 rank: its FSDP shards (dim 0
    # over 32, padded) of its TP pieces and its 8 experts per MoE layer (TP-split), nothing else
    assert got["held"] == stage.params, (got["held"], stage.params)
    assert 0.5e9 < got["held"] < 1e9
    # storage only for this stage's experts (the other weights live in the FSDP shards) and
    # the untrained router biases, which every rank keeps whole
    layers = {f"model.layers.{u.split('.')[-1]}." for u in got["units"] if u.startswith("layers.")}
    for name in got["stored_names"]:
        assert name.endswith("e_score_correction_bias") or (name.startswith(tuple(layers)) and ".experts." in name), name
    # a few GB, not the whole model's 2.7 TB: 1.26 GB alone; 3.16 GB was seen once inside the
    # full parallel suite (2026-12-03, not explained yet: the child's own peak RSS)
    assert got["rss"] < 4 * 2 ** 30, got["rss"]
