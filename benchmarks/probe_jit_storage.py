"""Probe: a compiled (ms.jit) layer keeps reading the parameter storage it saw when it compiled.

    hatch run python benchmarks/probe_jit_storage.py

Why ZeRO-3 (and any layout that swaps a parameter's storage with set_data) cannot run a
layer compiled with its own weights (it runs each unit in a compiled twin whose buffers it
writes in place, mindtrain.parallel.fsdp): after ``set_data`` the compiled graph still reads the old buffer, and even a later in-place
``ops.assign`` (which writes the new buffer) is not seen; freeing and re-gathering (set_data to
0 elements, then to the full weight) leaves the graph on the first buffer. Measured on
MindSpore 2.10 CPU (output of this script): 2, 2 / eager 4, 2, 2 where the current weight
would give 2, 4, 6, 8.

Under a gradient (``value_and_grad`` over the weight) the two halves part ways: the forward
keeps the first buffer while the backward reads the current one (the second part of the
output: the value stays 9 while dL/dx follows the weight, 6, 12, 18, 24), so a graph's
gradients would not even match its own forward. Hence twins, never a layer's own graph,
whenever the weights' storage is swapped.
"""
import numpy as np
import mindspore as ms
from mindspore import Parameter, Tensor, nn, ops
ms.set_device("CPU")

class Lin(nn.Cell):
    def __init__(self):
        super().__init__()
        self.w = Parameter(Tensor(np.ones((2, 2), np.float32)), name="w")
    @ms.jit
    def construct(self, x):
        return ops.matmul(x * x, self.w)

net = Lin()
x = Tensor(np.ones((1, 2), np.float32))
print("compiled, w=1:", net(x).asnumpy())
net.w.set_data(Tensor(np.full((2, 2), 2, np.float32)))
print("after set_data(w=2):", net(x).asnumpy(), "eager reads", ops.matmul(x, net.w).asnumpy())
ops.assign(net.w, Tensor(np.full((2, 2), 3, np.float32)))
print("after assign(w=3):", net(x).asnumpy())
net.w.set_data(Tensor(np.zeros((0,), np.float32)))
net.w.set_data(Tensor(np.full((2, 2), 4, np.float32)))
print("after free + regather (set_data 0-size then w=4):", net(x).asnumpy())


# under a gradient: the forward value and the input gradient of x * x @ w (x = 1.5)
sq = Lin()
x = Tensor(np.full((1, 2), 1.5, np.float32))
grad = ms.value_and_grad(lambda x: sq(x).sum(), 0, [sq.w])


def show(tag):
    value, (gx, _) = grad(x)
    print(f"{tag}: value {float(value.asnumpy())} (w gives {9 * float(sq.w.asnumpy()[0, 0])}), "
          f"dL/dx {gx.asnumpy()[0, 0]} (w gives {6 * float(sq.w.asnumpy()[0, 0])})")


show("grad, w=1")
sq.w.set_data(Tensor(np.full((2, 2), 2, np.float32)))
show("grad, after set_data(w=2)")
ops.assign(sq.w, Tensor(np.full((2, 2), 3, np.float32)))
show("grad, after assign(w=3)")
sq.w.set_data(Tensor(np.zeros((0,), np.float32)))
sq.w.set_data(Tensor(np.full((2, 2), 4, np.float32)))
show("grad, after free + regather (w=4)")
