"""Can a ZeRO-3 unit skip the replay of its forward in backward?

    hatch run python benchmarks/probe_vjp_unit.py

A custom-backward cell (FSDP's unit) records its compiled twin's forward with
``mindspore.vjp`` in its forward and calls the returned function in its ``bprop``, so that
backward would not run the forward again. Two units share one compiled twin. Reference:
plain autograd through both blocks. MindSpore 2.10 on CPU: the deferred vjp call fails with
"Can not find top cell for backward" (a nested grad cannot outlive its forward's top cell),
so FSDP's units replay their forward under ``ms.grad`` in backward."""
import copy, numpy as np, mindspore as ms
from mindspore import nn, ops, Tensor, Parameter
ms.set_device("CPU"); ms.runtime.launch_blocking(); ms.set_seed(0)

class Block(nn.Cell):
    def __init__(self):
        super().__init__()
        self.w1 = Parameter(Tensor(np.random.RandomState(1).randn(8, 8).astype(np.float32)), name="w1")
        self.w2 = Parameter(Tensor(np.random.RandomState(2).randn(8, 8).astype(np.float32)), name="w2")
    def construct(self, x):
        return ops.tanh(ops.matmul(ops.tanh(ops.matmul(x, self.w1)), self.w2)) + x

blocks = [Block(), Block()]
blocks[1].w1.set_data(blocks[1].w1 * 0.5); blocks[1].w2.set_data(blocks[1].w2 * -0.7)
x = Tensor(np.random.RandomState(3).randn(4, 8).astype(np.float32))
# reference: plain autograd through both blocks
ws = [p for b in blocks for p in (b.w1, b.w2)]
def ref_fn(x):
    return (blocks[1](blocks[0](x)) ** 2).sum()
ref_loss, ref_g = ms.value_and_grad(ref_fn, 0, ws)(x)

twin = copy.deepcopy(blocks[0]); twin.construct = ms.jit(type(twin).construct.__get__(twin))
tw = [twin.w1, twin.w2]
calls = {"fwd": 0}

class Unit(nn.Cell):
    def __init__(self, block, sink):
        super().__init__()
        self.block = block; self.sink = sink; self.saved = None
    def construct(self, x):
        ops.assign(tw[0], self.block.w1); ops.assign(tw[1], self.block.w2)
        calls["fwd"] += 1
        out, fn = ms.vjp(twin, x, weights=tw)
        self.saved = fn
        return out
    def bprop(self, x, out, dout):
        ops.assign(tw[0], self.block.w1); ops.assign(tw[1], self.block.w2)
        gx, gw = self.saved(dout)
        self.saved = None
        self.sink[id(self)] = gw
        return (gx[0] if isinstance(gx, tuple) else gx),

sink = {}
units = [Unit(b, sink) for b in blocks]
def fn(x):
    return (units[1](units[0](x)) ** 2).sum()
try:
    loss, gx = ms.value_and_grad(fn, 0)(x)
except RuntimeError as e:
    line = next((l for l in str(e).splitlines() if "top cell" in l), str(e).splitlines()[0])
    print("deferred vjp in a custom bprop: FAILS:", line.strip())
    raise SystemExit(0)
print("loss", float(loss.asnumpy()), float(ref_loss.asnumpy()), "fwd calls", calls)
print("dx", np.abs(gx.asnumpy() - ref_g[0].asnumpy()).max())
for i, u in enumerate(units):
    gw = sink[id(u)]
    for j in range(2):
        print("unit", i, "w", j, np.abs(gw[j].asnumpy() - ref_g[1][2 * i + j].asnumpy()).max())
