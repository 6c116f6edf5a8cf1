"""parallelize() and the Layout protocol in one process: the sharded layout and the pipeline
schedule (pp = cp = 1) are both Layouts and give the same step as the model's own gradient."""

import os

import mindspore as ms
import numpy as np
import pytest

from mindtrain.config import ParallelDims, load_config
from mindtrain.parallel import DeviceMesh, Layout, PipelineSchedule, ShardedLayout, parallelize

# a model to lay out (the parallel package itself never imports one)
from mindtrain.models import build_model, parallel_plan

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
SEQ = 16
COLUMNS = ["input_ids", "labels", "loss_mask", "position_ids"]


@pytest.fixture(scope="module")
def cfg():
    ms.set_device("CPU")
    ms.runtime.launch_blocking()
    return load_config(os.path.join(ROOT, "configs", "pynative_ds3_tiny.yaml"),
                       [f"model.seq_length={SEQ}", f"train_dataset.dataloader.config.seq_length={SEQ}",
                        "model.num_hidden_layers=2", "training.global_batch_size=2"], validate=False)


def _model(cfg):
    ms.set_seed(3)
    np.random.seed(3)
    return build_model(cfg.model, jit=False)


def _batches(n):
    rng = np.random.default_rng(5)
    out = []
    for _ in range(n):
        tok = rng.integers(2, 500, size=(1, SEQ + 1)).astype(np.int32)
        out.append({"input_ids": tok[:, :-1].copy(), "labels": tok[:, 1:].copy(),
                    "loss_mask": np.ones((1, SEQ), np.float32),
                    "position_ids": np.tile(np.arange(SEQ, dtype=np.int32), (1, 1))})
    return out


def _reference(cfg, batches):
    """The model's own gradient of the mean micro-batch loss."""
    model = _model(cfg)
    params = model.trainable_params()

    def loss_fn(b):
        loss, _ = model(ms.Tensor(b["input_ids"]), labels=ms.Tensor(b["labels"]),
                              loss_mask=ms.Tensor(b["loss_mask"]), position_ids=ms.Tensor(b["position_ids"]))
        return loss

    grad_fn = ms.value_and_grad(lambda *t: loss_fn(dict(zip(COLUMNS, t))), None, params)
    acc = None
    for b in batches:
        _, grads = grad_fn(*[ms.Tensor(b[c]) for c in COLUMNS])
        acc = list(grads) if acc is None else [a + g for a, g in zip(acc, grads)]
    return {p.name: (g / len(batches)).asnumpy() for p, g in zip(params, acc)}


def _step(layout, batches):
    assert isinstance(layout, Layout)
    layout.run_step(batches)
    grads = layout.gradients()
    norm = layout.grad_norm(grads)
    full = layout.to_full(grads)
    weights = layout.to_full([p for _, p in layout.named_params])
    # to_local is to_full's inverse
    back = layout.to_local(weights)
    for (_, p), t in zip(layout.named_params, back):
        np.testing.assert_array_equal(p.asnumpy(), t.asnumpy())
    assert layout.memory_bytes() == sum(p.size * p.itemsize for _, p in layout.named_params)
    assert layout.ep_sent_bytes() == 0  # no expert parallelism: nothing dispatched to other ranks
    layout.expert_load()
    layout.finish_step()
    return full, norm


def test_every_layout_is_a_layout_with_the_models_own_gradient(cfg, monkeypatch):
    monkeypatch.delenv("MS_NODE_TIMEOUT", raising=False)
    batches = _batches(2)
    want = _reference(cfg, batches)
    want_norm = float(np.sqrt(sum(float(np.sum(g.astype(np.float64) ** 2)) for g in want.values())))
    mesh = DeviceMesh(ParallelDims(world_size=1, pp=1, dp_shard=1, cp=1, tp=1, ep=1), 0)
    model = _model(cfg)
    sharded = parallelize(model, parallel_plan(model), mesh, cfg, accumulation=2, columns=COLUMNS)
    assert isinstance(sharded, ShardedLayout)
    model = _model(cfg)
    pipeline = PipelineSchedule(model, parallel_plan(model), mesh, SEQ)
    # one process receives nothing: the pipeline's 900 s receive timeout must not reach the
    # environment, where every msrun started later from this process would inherit it
    assert "MS_NODE_TIMEOUT" not in os.environ
    for layout in (sharded, pipeline):
        got, norm = _step(layout, batches)
        assert sorted(got) == sorted(want)
        for name, g in want.items():
            np.testing.assert_allclose(got[name], g, rtol=1e-4, atol=1e-6, err_msg=name)
        assert norm == pytest.approx(want_norm, rel=1e-5)
