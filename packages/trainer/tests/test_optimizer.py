"""AdamW against torch.optim.AdamW numbers (fixture from tools/make_optim_fixtures.py)."""

import os

import mindspore as ms
import numpy as np
from mindspore import Parameter, Tensor
from safetensors.numpy import load_file

from mindtrain.trainer.optimizer import AdamW, wants_decay

FIXTURE = os.path.join(os.path.dirname(__file__), "fixtures", "adamw_torch.safetensors")


def _setup():
    ms.set_device("CPU")
    ms.runtime.launch_blocking()  # eager ops in the calling thread, as the trainer runs them on CPU
    ref = load_file(FIXTURE)
    names = sorted(k[len("init."):] for k in ref if k.startswith("init."))
    params = [(n, Parameter(Tensor(ref[f"init.{n}"].copy()), name=n)) for n in names]
    return ref, names, params


def test_matches_torch_adamw_over_six_steps_with_changing_lr():
    ref, names, params = _setup()
    opt = AdamW(params, lr=1.0, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    for i, lr in enumerate(ref["lrs"]):
        opt.step([Tensor(ref[f"grad.{i}.{n}"]) for n in names], lr=float(lr))
        for n, p in params:
            want = ref[f"param.{i}.{n}"]
            np.testing.assert_allclose(p.asnumpy(), want, rtol=0, atol=2e-6 * max(1.0, float(np.abs(want).max())),
                                       err_msg=f"step {i} {n}")


def test_no_decay_for_norms_biases_and_vectors():
    p2 = Parameter(Tensor(np.ones((2, 2), np.float32)), name="a")
    p1 = Parameter(Tensor(np.ones(2, np.float32)), name="b")
    assert wants_decay("model.layers.0.mlp.up_proj.weight", p2)
    assert not wants_decay("model.norm.weight", p1)
    assert not wants_decay("x.bias", p2)
    assert not wants_decay("model.layers.0.input_layernorm.weight", p2)
    assert not wants_decay("some.vector", p1)


def test_zero_gradient_step_only_decays():
    ms.set_device("CPU")
    ms.runtime.launch_blocking()  # eager ops in the calling thread, as the trainer runs them on CPU
    w = Parameter(Tensor(np.full((2, 2), 2.0, np.float32)), name="w")
    opt = AdamW([("w", w)], lr=0.1, weight_decay=0.5)
    opt.step([Tensor(np.zeros((2, 2), np.float32))])
    np.testing.assert_allclose(w.asnumpy(), 2.0 * (1 - 0.1 * 0.5), rtol=1e-6)


def test_state_round_trip_continues_identically():
    ref, names, params = _setup()
    opt = AdamW(params, lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
    grads = lambda i: [Tensor(ref[f"grad.{i}.{n}"]) for n in names]  # noqa: E731
    for i in range(3):
        opt.step(grads(i))
    state = opt.state_dict()
    saved = {n: p.asnumpy().copy() for n, p in params}
    opt.step(grads(3))
    after = {n: p.asnumpy().copy() for n, p in params}

    params2 = [(n, Parameter(Tensor(saved[n]), name=n)) for n in names]
    opt2 = AdamW(params2, lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
    opt2.load_state_dict(state)
    assert opt2.step_count == 3
    opt2.step(grads(3))
    for n, p in params2:
        np.testing.assert_array_equal(p.asnumpy(), after[n])
