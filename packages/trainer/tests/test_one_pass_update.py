"""The trainer's one-pass update (issue 33): the global norm from the layout's square sums,
clipping folded into AdamW's gradient scale, one fused kernel per parameter, against an
independent numpy reference of torch's ``clip_grad_norm_`` + ``torch.optim.AdamW``."""

import math

import mindspore as ms
import numpy as np
import pytest
from mindspore import Parameter, Tensor

from mindtrain.config import OptimizerConfig
from mindtrain.parallel import Group, grad_norm
from mindtrain.trainer.muon import Muon
from mindtrain.trainer.optimizer import AdamW

ms.set_device("CPU")
ms.runtime.launch_blocking()  # eager ops in the calling thread, as the trainer runs them on CPU

SHAPES = {"model.embed_tokens.weight": (10, 4), "model.layers.0.mlp.up_proj.weight": (6, 4),
          "model.layers.0.input_layernorm.weight": (4,), "lm_head.bias": (10,),
          "model.layers.1.mlp.up_proj.weight": (0, 4)}  # an FSDP shard past the last row
NO_DECAY = {"model.layers.0.input_layernorm.weight", "lm_head.bias"}
BETAS, EPS, WD, MAX_NORM = (0.9, 0.95), 1e-8, 0.1, 1.0
ONE = Group("world", (0,), 0)


def _grads(rng, step):
    # large on even steps (clipped), small on odd ones (left alone)
    scale = 1.0 if step % 2 == 0 else 0.01
    return {n: (rng.standard_normal(s) * scale).astype(np.float32) for n, s in SHAPES.items()}


class _TorchReference:
    """clip_grad_norm_(max_norm) then torch.optim.AdamW (decoupled decay, bias correction),
    in float64, parameter by parameter."""

    def __init__(self, init):
        self.p = {n: a.astype(np.float64) for n, a in init.items()}
        self.m = {n: np.zeros_like(a) for n, a in self.p.items()}
        self.v = {n: np.zeros_like(a) for n, a in self.p.items()}
        self.t = 0

    def step(self, grads, lr):
        self.t += 1
        norm = math.sqrt(sum(float(np.sum(g.astype(np.float64) ** 2)) for g in grads.values()))
        coef = min(MAX_NORM / (norm + 1e-6), 1.0)
        b1, b2 = BETAS
        for n, g in grads.items():
            g = g.astype(np.float64) * coef
            if n not in NO_DECAY:
                self.p[n] *= 1.0 - lr * WD
            self.m[n] = b1 * self.m[n] + (1 - b1) * g
            self.v[n] = b2 * self.v[n] + (1 - b2) * g * g
            m_hat = self.m[n] / (1 - b1 ** self.t)
            v_hat = self.v[n] / (1 - b2 ** self.t)
            self.p[n] -= lr * m_hat / (np.sqrt(v_hat) + EPS)
        return norm, coef


def test_one_pass_adamw_with_clipping_matches_torch_semantics_over_20_steps():
    rng = np.random.default_rng(0)
    init = {n: rng.standard_normal(s).astype(np.float32) for n, s in SHAPES.items()}
    named = [(n, Parameter(Tensor(a.copy()), name=n)) for n, a in init.items()]
    opt = AdamW(named, lr=1.0, betas=BETAS, eps=EPS, weight_decay=WD)
    assert {n for n, d in zip(opt.names, opt.decay) if not d} == NO_DECAY
    ref = _TorchReference(init)
    clipped = 0
    for step in range(20):
        lr = 1e-2 * (1.0 - step / 40)  # a changing learning rate
        grads = _grads(rng, step)
        want_norm, want_coef = ref.step(grads, lr)
        tensors = [Tensor(grads[n]) for n, _ in named]
        norm = grad_norm(tensors, ONE)  # what the layouts compute (one rank: no all-reduce)
        assert norm == pytest.approx(want_norm, rel=1e-12)
        coef = MAX_NORM / (norm + 1e-6)
        clipped += coef < 1.0
        opt.step(tensors, lr=lr, grad_scale=min(coef, 1.0))  # as the trainer calls it
        for (n, p), m, v in zip(named, opt.exp_avg, opt.exp_avg_sq):
            np.testing.assert_allclose(p.asnumpy(), ref.p[n], rtol=0, atol=1e-6, err_msg=f"step {step} {n}")
            # the moments are torch's exp_avg / exp_avg_sq of the clipped gradient (checkpoints)
            np.testing.assert_allclose(m.asnumpy(), ref.m[n], rtol=1e-5, atol=1e-7, err_msg=f"step {step} {n}")
            np.testing.assert_allclose(v.asnumpy(), ref.v[n], rtol=1e-5, atol=1e-9, err_msg=f"step {step} {n}")
    assert clipped == 10
    assert opt.state_dict()["step"] == 20


def test_grad_scale_equals_scaled_gradients_and_refuses_zero():
    rng = np.random.default_rng(1)
    init = {n: rng.standard_normal(s).astype(np.float32) for n, s in SHAPES.items()}
    runs = []
    for folded in (True, False):
        named = [(n, Parameter(Tensor(a.copy()), name=n)) for n, a in init.items()]
        opt = AdamW(named, lr=1e-2, betas=BETAS, eps=EPS, weight_decay=WD)
        for step in range(3):
            grads = _grads(np.random.default_rng(step), 0)
            if folded:
                opt.step([Tensor(grads[n]) for n, _ in named], grad_scale=0.25)
            else:
                opt.step([Tensor(grads[n] * np.float32(0.25)) for n, _ in named])
        runs.append([p.asnumpy() for _, p in named])
    for a, b in zip(*runs):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-7)
    with pytest.raises(ValueError, match="grad_scale"):
        opt.step([Tensor(np.zeros(s, np.float32)) for s in SHAPES.values()], grad_scale=0.0)


def test_muon_takes_the_clip_scale_on_both_parts():
    rng = np.random.default_rng(3)
    init = {"w": rng.standard_normal((4, 6)).astype(np.float32), "b": rng.standard_normal(6).astype(np.float32)}
    grads = [{k: rng.standard_normal(a.shape).astype(np.float32) for k, a in init.items()} for _ in range(3)]
    cfg = OptimizerConfig(type="Muon", weight_decay=0.1, momentum=0.95, ns_steps=5, eps=1e-7, matched_adamw_rms=0.2)
    runs = []
    for folded in (True, False):
        named = [(k, Parameter(Tensor(a.copy()), name=k)) for k, a in init.items()]
        opt = Muon(named, cfg, lr=0.01)
        assert opt.muon_idx == [0] and opt.adamw_idx == [1]
        for g in grads:
            if folded:
                opt.step([Tensor(g[k]) for k, _ in named], grad_scale=0.3)
            else:
                opt.step([Tensor(g[k] * np.float32(0.3)) for k, _ in named])
        runs.append([p.asnumpy() for _, p in named] + [opt.muon_m[0].asnumpy()])
    for a, b in zip(*runs):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("bucket", [1 << 24, 30])
def test_flat_buffers_equal_the_per_parameter_update_over_20_steps(bucket, monkeypatch):
    """The update over flat buffers (one kernel call per dtype and decay group, parameters and
    moments as views of the buffers) against one kernel call per parameter: 20 steps, half
    of them clipped, a weight written anew mid-way (``set_data``, as a checkpoint load does:
    taken back into the buffer) and one through ``write_param`` (ops.assign refuses views).
    Both routes over the buffers: the host one (synchronous CPU, the trainer's case here:
    the scaled gradient copied with numpy, the decay in place, ``ops.Adam``) and the fused
    kernel on ``ops.cat`` (asynchronous dispatch, other devices)."""
    from mindtrain.parallel.layout import write_param
    from mindtrain.trainer import optimizer

    monkeypatch.setattr(optimizer, "BUCKET_ELEMENTS", bucket)  # 30: several buffers per group
    rng = np.random.default_rng(5)
    init = {n: rng.standard_normal(s).astype(np.float32) for n, s in SHAPES.items()}
    runs = {}
    for mode in ("host", "cat", "per-param"):
        flat = mode != "per-param"
        monkeypatch.setattr(optimizer, "synchronous_dispatch", lambda m=mode: m == "host")
        named = [(n, Parameter(Tensor(a.copy()), name=n)) for n, a in init.items()]
        opt = AdamW(named, lr=1e-2, betas=BETAS, eps=EPS, weight_decay=WD, flat=flat)
        # decay and no-decay (40 + 24 values, 4 + 10: the bucket of 30 splits the first); the empty shard stays out
        assert len(opt._groups) == ((2 if bucket > 64 else 3) if flat else 0)
        data = np.random.default_rng(6)
        for step in range(20):
            grads = _grads(data, step)
            tensors = [Tensor(grads[n]) for n, _ in named]
            coef = MAX_NORM / (grad_norm(tensors, ONE) + 1e-6)
            opt.step(tensors, lr=1e-2 * (1.0 - step / 40), grad_scale=min(coef, 1.0))
            if step == 7:
                named[0][1].set_data(Tensor(np.full(SHAPES[named[0][0]], 0.5, np.float32)))
            if step == 11:
                write_param(named[2][1], np.full(SHAPES[named[2][0]], -0.25, np.float32))
        assert all((g._grad_host is not None) == (mode == "host") for g in opt._groups)
        runs[mode] = ([p.asnumpy().copy() for _, p in named], [m.asnumpy().copy() for m in opt.exp_avg],
                      [v.asnumpy().copy() for v in opt.exp_avg_sq], opt.state_dict())
    pb, mb, vb, sb = runs["per-param"]
    for pa, ma, va, sa in (runs["host"], runs["cat"]):
        for n, a, b in zip(SHAPES, pa, pb):
            np.testing.assert_allclose(a, b, rtol=0, atol=1e-6, err_msg=n)
        # the host route's Adam step (ops.Adam) rounds the moments in another order
        # (m + (g - m) * (1 - b1)): within float32 rounding of the gradient's scale
        for a, b in zip(ma + va, mb + vb):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-8)
        assert sa.keys() == sb.keys()
    # a state loaded into the flat buffers continues like the per-parameter one
    named = [(n, Parameter(Tensor(a.copy()), name=n)) for n, a in zip(SHAPES, pb)]
    opt = AdamW(named, lr=1e-2, betas=BETAS, eps=EPS, weight_decay=WD)
    opt.load_state_dict(sb)
    assert all(g.moments_aliased() for g in opt._groups)
    for a, b in zip(opt.exp_avg_sq, vb):
        np.testing.assert_array_equal(a.asnumpy(), b)
