"""eager_reshape: a reshape that is not a view, with the gradient of ops.reshape."""

import gc

import mindspore as ms
import numpy as np
from mindspore import Tensor, mint, ops

from mindtrain.models import eager_reshape
from mindtrain.models.eager_reshape import MIN_ELEMENTS, plain, reshape

ms.set_device("CPU")


def _computed(shape, seed=0):
    """A tensor an op wrote (not numpy-backed), as activations are."""
    return mint.mul(Tensor(np.random.default_rng(seed).standard_normal(shape).astype(np.float32)), 1.0)


def test_a_large_tensor_is_reshaped_in_place_and_is_no_view():
    x = _computed((2, 512, 128))
    y = reshape(x, (1024, 128))
    assert tuple(y.shape) == (1024, 128)
    np.testing.assert_array_equal(y.asnumpy(), x.asnumpy().reshape(1024, 128))
    # a view's asnumpy copies it (MindSpore makes it contiguous first); this one reads x's memory
    assert np.shares_memory(y.asnumpy(), x.asnumpy())
    assert not np.shares_memory(x.reshape(1024, 128).asnumpy(), x.asnumpy())


def test_the_result_keeps_the_memory_alive():
    x = _computed((1024, 128), seed=1)
    expected = x.asnumpy().copy()
    y = reshape(x, (128, 1024))
    del x
    gc.collect()
    churn = [_computed((1024, 128), seed=2 + i) for i in range(8)]
    np.testing.assert_array_equal(y.asnumpy(), expected.reshape(128, 1024))
    assert len(churn) == 8


def test_gradient_equals_the_view_reshape():
    x = _computed((2, 512, 128), seed=3)
    w = _computed((1024, 128), seed=4)

    def loss(reshaper):
        return lambda t: (mint.mul(reshaper(t, (1024, 128)), w) * reshaper(t, (1024, 128))).sum()

    got = ms.grad(loss(reshape))(x).asnumpy()
    want = ms.grad(loss(ops.reshape))(x).asnumpy()
    np.testing.assert_array_equal(got, want)


def test_small_strided_and_plain_fall_back_to_ops_reshape():
    small = _computed((8, 8))
    assert small.size < MIN_ELEMENTS
    np.testing.assert_array_equal(reshape(small, (64,)).asnumpy(), small.asnumpy().reshape(64))
    t = ops.transpose(_computed((512, 256), seed=5), (1, 0))  # a strided view: no shared route
    assert not t.is_contiguous()
    np.testing.assert_array_equal(reshape(t, (256 * 512,)).asnumpy(), t.asnumpy().reshape(-1))
    x = _computed((1024, 128), seed=6)
    np.testing.assert_array_equal(plain(x, (2, 512, 128)).asnumpy(), x.asnumpy().reshape(2, 512, 128))
    assert eager_reshape._host_ready(x)  # pylint: disable=protected-access
