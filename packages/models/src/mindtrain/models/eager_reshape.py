"""Reshapes for eager CPU code that hand the next op a plain tensor, not a view.

Measured on MindSpore 2.10's CPU backend (2 threads): ``Tensor.reshape`` (and ``ops.reshape``,
``view``, ``flatten``, ``expand_dims``) returns a view, and an eager op given a view first copies
it into a new buffer (the Contiguous kernel, one single-threaded ``memcpy``) even when the view
is contiguous: a multiply of a reshaped 16 MB tensor took 4.8 ms against 1.1 ms for the same
tensor unreshaped, and a 2 MB one 1.0 ms against 0.09 ms. The autodiff keeps the view as the
op's saved input, so a BatchMatMul's backward copies it again, and the reshape's backward hands
the next gradient op a view as well. In the attention core at bench size (scores
[2, 8, 512, 512]) the softmax backward's reshapes cost more than its arithmetic: forward and
backward took 38-47 ms with views and 24-25 ms with :func:`reshape`, the same numbers.

:func:`reshape` on a CPU tensor of at least :data:`MIN_ELEMENTS` elements reshapes the tensor's
numpy array (``asnumpy`` on CPU shares the tensor's memory, and the array holds the memory's
owner) and wraps it with ``Tensor.from_numpy``: no copy and no view. Its gradient is reshaped the
same way (a cell with its own ``bprop``). A contiguous view as input is copied once by
``asnumpy``, as the next op would have copied it; smaller tensors, strided views and other
devices take ``ops.reshape``. Eager code only: a compiled graph cannot
call ``asnumpy``.
"""

from __future__ import annotations

import functools

from mindspore import Tensor, nn, ops

from mindtrain.models.precision import current_device

# below this many elements the copy a view costs (~0.1 ms per MB) is less than the custom
# bprop cell's own overhead (~0.06 ms measured in a backward)
MIN_ELEMENTS = 1 << 16


@functools.lru_cache(maxsize=None)
def _on_cpu() -> bool:
    """The process runs on CPU (read once: ``get_context`` costs ~11 us a call)."""
    return current_device().upper() == "CPU"


def _host_ready(x) -> bool:
    return x.size >= MIN_ELEMENTS and x.is_contiguous() and _on_cpu()


def _shared(x, shape):
    return Tensor.from_numpy(x.asnumpy().reshape(shape))


def plain(x, shape):
    """:func:`reshape` for code no gradient flows through (a ``bprop``): ``x`` reshaped to
    ``shape`` as a tensor sharing ``x``'s memory that is not a view, where that pays."""
    return _shared(x, shape) if _host_ready(x) else ops.reshape(x, shape)


class _HostReshape(nn.Cell):
    """Forward and backward both reshape through numpy; the target shape is set just before
    the call (eager calls do not interleave)."""

    def __init__(self):
        super().__init__()
        self.shape = None

    def construct(self, x):
        return _shared(x, self.shape)

    def bprop(self, x, out, dout):
        return plain(dout, x.shape),


_CELL = _HostReshape()


def reshape(x, shape):
    """``ops.reshape(x, shape)``, as a tensor that is not a view where that pays (module doc)."""
    if not _host_ready(x):
        return ops.reshape(x, shape)
    _CELL.shape = tuple(shape)
    return _CELL(x)
