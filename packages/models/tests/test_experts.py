"""Static-shape expert dispatch against a per-token numpy loop, incl. empty and crowded experts."""

import mindspore as ms
import numpy as np
import pytest
from mindspore import Tensor

from mindtrain.models.experts import RoutedExperts


def _silu(x):
    return x / (1 + np.exp(-x))


@pytest.mark.parametrize("path", ["host", "piece"])
@pytest.mark.parametrize("pattern", ["random", "one_expert"])
def test_dispatch_matches_loop(pattern, path):
    """An eager cell's call (slots computed in numpy, :meth:`RoutedExperts.forward_host_dispatch`)
    and the piece a graph compiles (:meth:`RoutedExperts.forward`, run here eagerly)."""
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
    def call(x_, idx_, w_):
        if path == "host":
            return ex(x_, idx_, w_)
        return ex.forward(x_, idx_, w_, ex.gate_proj, ex.up_proj, ex.down_proj)

    y, counts = call(Tensor(x), Tensor(idx), Tensor(w))
    g, u, d = ex.gate_proj.asnumpy(), ex.up_proj.asnumpy(), ex.down_proj.asnumpy()
    want = np.zeros((t, h), np.float32)
    for tok in range(t):
        for j in range(k):
            ee = idx[tok, j]
            want[tok] += w[tok, j] * ((_silu(x[tok] @ g[ee].T) * (x[tok] @ u[ee].T)) @ d[ee].T)
    np.testing.assert_allclose(y.asnumpy(), want, atol=1e-5)
    np.testing.assert_array_equal(counts.asnumpy(), np.bincount(idx.ravel(), minlength=e))

    def fn(x):
        return call(x, Tensor(idx), Tensor(w))[0].sum()

    grads = ms.value_and_grad(fn, None, ex.trainable_params())(Tensor(x))[1]
    for gr in grads:
        assert np.isfinite(gr.asnumpy()).all()
    unused = [ee for ee in range(e) if ee not in idx]
    for ee in unused:
        assert np.abs(grads[0].asnumpy()[ee]).max() == 0


@pytest.mark.parametrize("groups", [(8, 4, 2, 2), (16, 4, 2, 4), (8, 1, 1, 3)], ids=["pairs", "fours", "ungrouped"])
def test_router_on_host_chooses_as_the_piece(groups):
    """An eager router's choice in numpy (:meth:`TopkRouter.route_on_host`) against the piece a
    graph compiles (:meth:`TopkRouter.forward`): the same experts in the same order, ties
    (scores made equal on purpose) to the lower index, the same weights and gradients."""
    from types import SimpleNamespace

    from mindtrain.models.router import TopkRouter

    e, n_group, topk_group, k = groups
    cfg = SimpleNamespace(n_routed_experts=e, num_experts_per_tok=k, n_group=n_group, topk_group=topk_group,
                          norm_topk_prob=True, routed_scaling_factor=2.5, hidden_size=6, initializer_range=0.5)
    ms.set_seed(0)
    router = TopkRouter(cfg)
    rng = np.random.default_rng(2)
    # coarse weights and inputs: many tokens score equal experts equally
    router.weight.set_data(Tensor(np.round(rng.standard_normal((e, 6)), 0).astype(np.float32)))
    router.e_score_correction_bias.set_data(Tensor(np.round(rng.standard_normal(e) * 0.1, 1).astype(np.float32)))
    x = Tensor(np.round(rng.standard_normal((64, 6)), 0).astype(np.float32))
    host = router.route_on_host(x, router.weight, router.e_score_correction_bias)
    piece = router.forward(x, router.weight, router.e_score_correction_bias)
    np.testing.assert_array_equal(host[0].asnumpy(), piece[0].asnumpy())
    choice = host[2].asnumpy() + router.e_score_correction_bias.asnumpy()
    assert (np.sort(choice, -1)[:, 1:] == np.sort(choice, -1)[:, :-1]).any()  # the ties are there
    for a, b in zip(host[1:], piece[1:]):
        np.testing.assert_array_equal(a.asnumpy(), b.asnumpy())
    grads = [ms.grad(lambda w, f=f: f(x, w, router.e_score_correction_bias)[1].sum() * 3.0)(router.weight)
             for f in (router.route_on_host, router.forward)]
    np.testing.assert_array_equal(grads[0].asnumpy(), grads[1].asnumpy())
    assert router.graph("forward") is None  # so the cell's own call takes the host route
