"""msrun worker: the last rank raises before a collective the others are already in."""

import sys
import time

import mindspore as ms
from mindspore import Tensor

from mindtrain.parallel import collectives as C, init_distributed

ms.set_device("CPU")
world, rank = init_distributed()
C.barrier()
if rank == world - 1:
    time.sleep(2)  # let the other ranks block in the all_reduce first
    with open(f"{sys.argv[1]}/raised_at", "w") as f:
        f.write(repr(time.time()))
    raise RuntimeError("deliberate failure before all_reduce")
C.all_reduce(Tensor([1.0]))
time.sleep(600)  # never reached in a healthy run: the peer is gone
