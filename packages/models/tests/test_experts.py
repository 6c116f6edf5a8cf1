"""Static-shape expert dispatch against a per-token numpy loop, incl. empty and crowded experts."""

import mindspore as ms
import numpy as np
import pytest
from mindspore import Tensor

from mindtrain.models.experts import RoutedExperts


def _silu(x):
    return x / (1 + np.exp(-x))


@pytest.mark.parametrize("pattern", ["random", "one_expert"])
def test_dispatch_matches_loop(pattern):
    ms.set_seed(0)
    e, h, i, t, k = 6, 8, 5, 40, 2
    ex = RoutedExperts(e, h, i, init_std=0.3, block=8)
    rng = np.random.default_rng(1)
    x = rng.standard_normal((t, h)).astype(np.float32)
    if pattern == "random":
        idx = np.stack([rng.choice(e, k, replace=False) for _ in range(t)]).astype(np.int32)
        idx[:, :] = np.where(idx == 4, 5, idx)  # expert 4 gets no tokens
        idx[idx[:, 0] == idx[:, 1], 1] = 0
    else:
        idx = np.tile(np.array([[2, 3]], np.int32), (t, 1))  # everything on two experts
    w = rng.random((t, k)).astype(np.float32)
    y, counts = ex(Tensor(x), Tensor(idx), Tensor(w))
    g, u, d = ex.gate_proj.asnumpy(), ex.up_proj.asnumpy(), ex.down_proj.asnumpy()
    want = np.zeros((t, h), np.float32)
    for tok in range(t):
        for j in range(k):
            ee = idx[tok, j]
            want[tok] += w[tok, j] * ((_silu(x[tok] @ g[ee].T) * (x[tok] @ u[ee].T)) @ d[ee].T)
    np.testing.assert_allclose(y.asnumpy(), want, atol=1e-5)
    np.testing.assert_array_equal(counts.asnumpy(), np.bincount(idx.ravel(), minlength=e))

    def fn(x):
        return ex(x, Tensor(idx), Tensor(w))[0].sum()

    grads = ms.value_and_grad(fn, None, ex.trainable_params())(Tensor(x))[1]
    for gr in grads:
        assert np.isfinite(gr.asnumpy()).all()
    unused = [ee for ee in range(e) if ee not in idx]
    for ee in unused:
        assert np.abs(grads[0].asnumpy()[ee]).max() == 0
