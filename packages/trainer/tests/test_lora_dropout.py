"""lora_config.lora_dropout (MindFormers' PyNative ``LinearWithLoRA``: dropout on the adapter's
input, ``y = x W^T + s * (dropout(x) A^T) B^T``; the frozen path has none). PEFT's LoRA cannot
draw our masks, so: the masks are recomputed here from their definition (splitmix64 over
(seed, step, site, layer, token, global input feature), in plain Python integers) and the
unmerged formula in numpy; outside a training step the adapter runs merged, exactly as
without dropout; the masks do not depend on the layout (sequence shards, row-split slices).
Layout parity under msrun (ZeRO-3, TP2) is in integration_tests/test_lora_msrun.py."""

import json
import os
import zlib
from types import SimpleNamespace

import mindspore as ms
import numpy as np
import pytest
from mindspore import Tensor

import mindtrain.models as mm
from mindtrain.config import LoraConfig
from mindtrain.models.dropout import LORA_INPUT, attach_lora_dropout, token_keys
from mindtrain.models.lora import add_adapter
from mindtrain.models.mlp import MLP
from mindtrain.trainer.lora import apply_lora

HERE = os.path.dirname(os.path.abspath(__file__))
MODELS = os.path.join(HERE, "..", "..", "models", "tests", "fixtures")
U64 = (1 << 64) - 1


def _mix(x: int) -> int:  # splitmix64's finaliser
    x ^= x >> 30
    x = (x * 0xBF58476D1CE4E5B9) & U64
    x ^= x >> 27
    x = (x * 0x94D049BB133111EB) & U64
    return x ^ (x >> 31)


def _keep(p: float, *keys: int) -> float:
    h = 0
    for k in keys:
        h = _mix(h ^ ((k + 0x9E3779B97F4A7C15) & U64))
    return 1.0 / (1.0 - p) if (h >> 40) / float(1 << 24) >= p else 0.0


def _mask(p, seed, step, name, tokens, n_in, offset=0):
    """[B, S, n_in] from the definition, element by element."""
    key = zlib.crc32(name.encode())
    b, s = tokens.shape
    return np.array([[[_keep(p, seed, step, LORA_INPUT, key, int(tokens[i, j]), offset + f) for f in range(n_in)]
                      for j in range(s)] for i in range(b)], np.float32)


def _silu(x):
    return x / (1.0 + np.exp(-x))


def _mlp(p=0.3):
    ms.set_seed(3)
    mlp = MLP(8, 12, init_std=0.3)
    mlp.update_parameters_name("mlp.")
    for cell in (mlp.gate_proj, mlp.up_proj, mlp.down_proj):
        add_adapter(cell, rank=2, alpha=4, a_std=0.3, b_std=0.3, empty=False)
    attach_lora_dropout(mlp, p)
    return mlp


def _np_unmerged(cell, x, m):
    w, a, b = (t.asnumpy().astype(np.float64) for t in (cell.weight, cell.lora_a, cell.lora_b))
    return x @ w.T + cell.lora_scaling * ((x * m) @ a.T) @ b.T


def test_unmerged_adapters_follow_the_masks_and_run_merged_outside_a_step():
    ms.set_device("CPU")
    p, seed, step = 0.3, 7, 3
    mlp = _mlp(p)
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 50, (2, 5))
    x = rng.standard_normal((2, 5, 8)).astype(np.float32)
    merged = mlp(Tensor(x)).asnumpy()

    state = mlp.dropout
    state.begin_step(step, seed)
    state.set_tokens(token_keys(ids))
    got = mlp(Tensor(x)).asnumpy()
    tok = token_keys(ids)
    xd = x.astype(np.float64)
    gate = _np_unmerged(mlp.gate_proj, xd, _mask(p, seed, step, "mlp.gate_proj", tok, 8))
    up = _np_unmerged(mlp.up_proj, xd, _mask(p, seed, step, "mlp.up_proj", tok, 8))
    act = _silu(gate) * up
    want = _np_unmerged(mlp.down_proj, act, _mask(p, seed, step, "mlp.down_proj", tok, 12))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert np.abs(got - merged).max() > 1e-3  # the masks matter

    # the adapters' gradients: those of the unmerged formula written out with plain ops
    def unmerged(x):
        def lin(cell, x, name, n_in):
            m = Tensor(_mask(p, seed, step, name, tok, n_in))
            return (ms.ops.matmul(x, cell.weight.T)
                    + ms.ops.matmul(ms.ops.matmul(x * m, cell.lora_a.T), cell.lora_b.T) * cell.lora_scaling)
        g, u = lin(mlp.gate_proj, x, "mlp.gate_proj", 8), lin(mlp.up_proj, x, "mlp.up_proj", 8)
        return lin(mlp.down_proj, ms.ops.silu(g) * u, "mlp.down_proj", 12).sum()

    adapters = [c.lora_a for c in (mlp.gate_proj, mlp.up_proj, mlp.down_proj)] + \
               [c.lora_b for c in (mlp.gate_proj, mlp.up_proj, mlp.down_proj)]
    g_got = ms.grad(lambda x: mlp(x).sum(), None, adapters)(Tensor(x))
    g_want = ms.grad(unmerged, None, adapters)(Tensor(x))
    for a, b, prm in zip(g_got, g_want, adapters):
        np.testing.assert_allclose(a.asnumpy(), b.asnumpy(), rtol=1e-4, atol=1e-5, err_msg=prm.name)

    state.end_step()  # evaluation: the merged adapter, exactly
    np.testing.assert_array_equal(mlp(Tensor(x)).asnumpy(), merged)


@pytest.mark.parametrize("p", [0.1, 0.5])
def test_lora_masks_drop_p_and_do_not_depend_on_the_layout(p):
    mlp = _mlp(p)
    state = mlp.dropout
    state.begin_step(2, 11)
    state.set_tokens(token_keys(np.arange(4 * 64).reshape(4, 64) % 97))
    key = zlib.crc32(b"mlp.down_proj")
    full = state.lora_mask(key, (4, 64, 256))
    dropped = float((full == 0).mean())
    assert abs(dropped - p) < 0.01, dropped
    np.testing.assert_allclose(full[full != 0], 1.0 / (1.0 - p), rtol=1e-6)
    # flattened rows, a sequence shard (sequence parallelism) and a row-split slice (TP)
    np.testing.assert_array_equal(state.lora_mask(key, (4 * 64, 256)), full.reshape(4 * 64, 256))
    state.sequence_shard = (1, 2)
    np.testing.assert_array_equal(state.lora_mask(key, (4, 32, 128), in_offset=128), full[:, 32:, 128:])
    assert not np.array_equal(state.lora_mask(zlib.crc32(b"mlp.up_proj"), (4, 64, 256)), full)


# fixture -> the layers adapted: every Linear layer of the model
SITES = {
    "qlora": "linear_(qkv|qb|kvb|proj|fc1|fc2)",
    # DeepSeek-V4's hybrid attention (q / kv / output projections, the compressors' kv / gate, the
    # indexer's; a hca layer of ratio 8 cuts the 12 tokens to one window; its mla variant's attention
    # is DeepSeek-V3's, above)
    "deepseek_v4": "linear_|output_layer",
}


def _model(p, name="qlora"):
    d = os.path.join(MODELS, f"hf_{name}")
    overrides = {}
    if os.path.exists(os.path.join(d, "overrides.json")):  # a variant's fields (V4's mla)
        with open(os.path.join(d, "overrides.json"), encoding="utf-8") as f:
            overrides = json.load(f)
    model = mm.from_pretrained(d, jit=False, num_nextn_predict_layers=0, **overrides)
    cfg = SimpleNamespace(model=model.config, lora_config=LoraConfig(
        target_modules=SITES[name], lora_rank=4, lora_alpha=8, lora_b_std=0.05, lora_dropout=p))
    apply_lora(model, cfg, empty=False)
    return model


@pytest.mark.parametrize("name", list(SITES))
def test_every_site_of_the_model_runs_unmerged_in_a_step_and_merged_outside(name):
    """DeepSeek-V3 (MLA: q_a/q_b/kv_a/kv_b/o, dense MLP, MoE shared experts) and DeepSeek-V4's
    hybrid attention: outside a step the model with lora_dropout equals it without;
    in a step with a vanishing rate (every mask 1) the unmerged path equals the merged one,
    with p = 0.2 it differs."""
    ms.set_device("CPU")
    ids = Tensor(np.arange(24, dtype=np.int32).reshape(2, 12) * 5 % 60)
    plain, dropped, tiny = _model(0.0, name), _model(0.2, name), _model(1e-9, name)
    want = plain(ids).asnumpy()
    np.testing.assert_array_equal(dropped(ids).asnumpy(), want)
    keys = token_keys(ids.asnumpy())
    for m in (tiny, dropped):
        m.dropout.begin_step(1, 5)
        m.dropout.set_tokens(keys)
    np.testing.assert_allclose(tiny(ids).asnumpy(), want, rtol=0, atol=2e-5)
    got = dropped(ids).asnumpy()
    assert np.abs(got - want).max() > 1e-4


@pytest.mark.parametrize("target, mtp", [("output_layer", 0), ("eh_proj", 1)])
def test_head_and_mtp_projection_adapters_run_unmerged_in_a_step(target, mtp):
    """An adapter on the head (its loss through the head + loss cell) or on an MTP module's
    eh_proj: outside a step the model equals the one without dropout; in a step the loss with
    a vanishing rate equals the merged one, with p = 0.3 it differs; and the head + loss
    cell's training loss equals the masked cross-entropy of the logits the plain Linear path
    gives for the same masks (the same [x, dropout(x)] either way)."""
    ms.set_device("CPU")

    def model(p):
        m = mm.from_pretrained(os.path.join(MODELS, "hf_qlora"), jit=False, num_nextn_predict_layers=mtp)
        cfg = SimpleNamespace(model=m.config, lora_config=LoraConfig(
            target_modules=target, lora_rank=4, lora_alpha=8, lora_b_std=0.05, lora_dropout=p))
        assert len(apply_lora(m, cfg, empty=False)) == 1
        return m

    rng = np.random.default_rng(1)
    tokens = rng.integers(2, 100, (2, 13)).astype(np.int32)
    ids, labels = Tensor(tokens[:, :-1]), Tensor(tokens[:, 1:])
    plain, dropped, tiny = model(0.0), model(0.3), model(1e-9)
    want_loss = float(plain(ids, labels=labels)[0].asnumpy())
    assert float(dropped(ids, labels=labels)[0].asnumpy()) == want_loss  # outside a step: merged
    keys = token_keys(ids.asnumpy())
    for m in (tiny, dropped):
        m.dropout.begin_step(1, 5)
        m.dropout.set_tokens(keys)
    np.testing.assert_allclose(float(tiny(ids, labels=labels)[0].asnumpy()), want_loss, rtol=1e-5)
    got_loss, metrics = dropped(ids, labels=labels)
    got_loss = float(got_loss.asnumpy())
    assert abs(got_loss - want_loss) > 1e-4
    if not mtp:  # the head: its loss equals the cross-entropy of its logits, masks alike
        got_loss = float(metrics["lm_loss"].asnumpy())  # without the balance loss
        logits = dropped(ids).asnumpy().astype(np.float64)
        logp = logits - logits.max(-1, keepdims=True)
        logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
        ce = -np.take_along_axis(logp, tokens[:, 1:, None].astype(np.int64), -1).mean()
        np.testing.assert_allclose(got_loss, ce, rtol=1e-5)
