"""ZeRO-3 with compiled layers, in one process (a 1-rank shard group): each decoder layer's
graph takes its weights as inputs, so it computes with the weights FSDP gathers into the
unit's Parameters (new storage each time, by set_data) and frees after.

Against the plain (eager) model over three steps with a weight update between them (a
graph that kept its compile-time weights would compute step 2 with step 1's): the same
losses and gradients. The units' own weights stay freed between their runs. The units and
shared weights are the layouts' own (:func:`mindtrain.parallel.share.zero3_units`), for
DeepSeek-V3 and for DeepSeek-V4's mla variant with its MTP module, whose shared-head norm
runs both inside the module (the next depth's input) and in the head: a unit's replayed
backward must list it (it once did not, and every layer norm of its width got a zero
gradient).
"""

import os

import mindspore as ms
import numpy as np
import pytest
from mindspore import Tensor, ops

from mindtrain.config import load_config
from mindtrain.parallel import Group, fully_shard
from mindtrain.parallel.share import zero3_units

# a model to shard (the parallel package itself never imports one)
from mindtrain.models import build_model, is_compiled, parallel_plan

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
SEQ = 16
LR = 0.05


V4_MLA = ["model.experimental_attention_variant=mla", "model.kv_lora_rank=32", "model.qk_nope_head_dim=16",
          "model.v_head_dim=16", "model.num_nextn_predict_layers=1", "model.enable_hc_head=false",
          "model.num_hidden_layers=2", "model.compress_ratios=[0, 0]", "model.hidden_size=64"]
CONFIGS = {"ds3": ("pynative_ds3_tiny.yaml", []), "ds4_mla_mtp": ("pynative_ds4_tiny.yaml", V4_MLA)}


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def cfg(request):
    ms.set_device("CPU")
    ms.runtime.launch_blocking()
    name, extra = CONFIGS[request.param]
    return load_config(os.path.join(ROOT, "configs", name),
                       [f"model.seq_length={SEQ}", f"train_dataset.dataloader.config.seq_length={SEQ}", *extra],
                       validate=False)


def _model(cfg, jit):
    ms.set_seed(3)
    np.random.seed(3)
    return build_model(cfg.model, jit=jit)


def _batch(i):
    rng = np.random.default_rng(11 + i)
    tok = rng.integers(2, 500, size=(2, SEQ + 1)).astype(np.int32)
    return Tensor(tok[:, :-1].copy()), Tensor(tok[:, 1:].copy())


def _loss(model):
    def fn(ids, labels):
        loss, _ = model(ids, labels=labels)
        return loss
    return fn


def test_compiled_layers_see_the_gathered_weights_and_every_update(cfg):
    ref = _model(cfg, jit=False)  # eager: one compile less
    ref_params = ref.trainable_params()
    ref_grad = ms.value_and_grad(_loss(ref), None, ref_params)

    model = _model(cfg, jit=True)
    plan = parallel_plan(model)
    units, shared = zero3_units(model, plan)
    assert len(units) == cfg.model.num_hidden_layers + cfg.model.num_nextn_predict_layers and shared
    fsdp = fully_shard(model, Group("dp", (0,), 0), units=units, strategy="optim_grads_params", shared=shared)
    assert is_compiled(model)
    assert fsdp.in_place  # synchronous dispatch: the units release and refill in place, no forward replayed
    if cfg.model.model_type == "deepseek_v3":  # whole compiled layers (V4's run compiled pieces)
        assert all(layer.can_run_whole() for layer in model.model.layers)
    step = fsdp.value_and_grad(_loss(model))
    names = [p.name for p in ref_params]

    for i in range(3):
        ids, labels = _batch(i)
        want_loss, want = ref_grad(ids, labels)
        got_loss = step(ids, labels)
        np.testing.assert_allclose(got_loss.asnumpy(), want_loss.asnumpy(), rtol=1e-5)
        got = dict(zip(fsdp.slots, fsdp.grads))
        for name, g in zip(names, want):
            np.testing.assert_allclose(got[name].asnumpy(), g.asnumpy(), rtol=1e-4, atol=1e-7, err_msg=name)
        # the units' own weights stay freed: only the shards hold them
        for s in fsdp.units[1].slots:
            assert s.param.size == 0, s.name
        # SGD on both sides: the next step must compute with the new weights
        for p, g in zip(ref_params, want):
            ops.assign(p, p - LR * g)
        for s, g in zip(fsdp.slots.values(), fsdp.grads):
            ops.assign(s.shard, s.shard - LR * g)
        fsdp.finish_step()
