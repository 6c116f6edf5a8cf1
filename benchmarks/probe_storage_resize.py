"""Probe: freeing a parameter in place (``untyped_storage().resize_(0)``, torch FSDP2's way)
keeps compiled layers correct on MindSpore 2.10 CPU but frees no memory.

    hatch run python benchmarks/probe_storage_resize.py

Why it matters: ZeRO-3 frees each unit's gathered weights after use. ``set_data`` frees them
but a compiled (ms.jit) layer keeps reading the storage it compiled with
(probe_jit_storage.py). Resizing the storage to 0 and back, then ``ops.assign``, keeps the
Parameter's identity, and the compiled layer does see the new values; but on CPU the bytes
stay allocated: three 400 MB parameters "freed" by resize and then three new 400 MB tensors
end at about the RSS of never freeing, while set_data gives the memory back. Measured here
(MiB): resize 1,969 -> 1,969 -> 3,143; set_data 1,969 -> 798 -> 2,362; no free 1,969 ->
1,969 -> 3,143. So resize cannot implement ZeRO-3 on CPU; ZeRO-3 runs compiled units in twins (one resident
copy per kind of unit, written in place) instead.
"""

from __future__ import annotations

import subprocess
import sys

import numpy as np


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2 ** 20


def correctness() -> None:
    import mindspore as ms
    from mindspore import Parameter, Tensor, nn, ops

    class Lin(nn.Cell):
        def __init__(self):
            super().__init__()
            self.w = Parameter(Tensor(np.ones((2, 2), np.float32)), name="w")

        def construct(self, x):
            return ops.matmul(x, self.w)

    lin = Lin()
    fn = ms.jit(lin.construct)
    x = Tensor(np.ones((1, 2), np.float32))
    first = fn(x).asnumpy()
    storage = lin.w.untyped_storage()
    nbytes = storage.nbytes()
    storage.resize_(0)
    storage.resize_(nbytes)
    ops.assign(lin.w, Tensor(np.full((2, 2), 3.0, np.float32)))
    print(f"compiled: w=1 gives {first.tolist()}; after resize_(0), resize_({nbytes}) and assign(w=3): "
          f"{fn(x).asnumpy().tolist()} (eager {lin.construct(x).asnumpy().tolist()}; current weight gives 6)")


def memory(mode: str) -> None:
    import mindspore as ms
    from mindspore import Parameter, ops

    n = 100_000  # 100k x 1024 fp32 = 400 MB each
    params = [Parameter(ops.ones((n, 1024), ms.float32), name=f"w{i}") for i in range(3)]
    for p in params:
        p.asnumpy()
    before = rss_mib()
    for p in params:
        if mode == "resize":
            p.untyped_storage().resize_(0)
        elif mode == "set_data":
            p.set_data(ops.zeros((0,), ms.float32))
    freed = rss_mib()
    fresh = [ops.ones((n, 1024), ms.float32) * 2 for _ in range(3)]
    for t in fresh:
        t.asnumpy()
    print(f"| {mode} | {before:,.0f} | {freed:,.0f} | {rss_mib():,.0f} |")


def main() -> None:
    import mindspore as ms

    ms.set_device("CPU")
    ms.runtime.launch_blocking()
    if len(sys.argv) > 1:
        memory(sys.argv[1])
        return
    correctness()
    print("| free by | RSS with 3 x 400 MB params (MiB) | after freeing | after 3 new 400 MB tensors |")
    print("|---|---|---|---|")
    for mode in ("resize", "set_data", "none"):
        out = subprocess.run([sys.executable, __file__, mode], capture_output=True, text=True)
        print(next((x for x in out.stdout.splitlines() if x.startswith("|")), out.stderr[-300:]), flush=True)


if __name__ == "__main__":
    main()
