"""msrun worker: the last rank raises before a collective the others are already in."""

import os

# Before mindspore starts its threads (they inherit the mask): its runtime threads otherwise
# spread over every core and, with more ranks than cores, burn about a third more CPU time.
_cpus = sorted(os.sched_getaffinity(0))
os.sched_setaffinity(0, {_cpus[int(os.environ.get("RANK_ID", 0)) % len(_cpus)]})

import sys
import time

import mindspore as ms
from mindspore import Tensor

from mindtrain.parallel import collectives as C, init_distributed

ms.set_device("CPU")
ms.runtime.launch_blocking()  # eager ops in the calling thread, as the trainer runs them on CPU
world, rank = init_distributed()
C.barrier()
if rank == world - 1:
    time.sleep(2)  # let the other ranks block in the all_reduce first
    with open(f"{sys.argv[1]}/raised_at", "w") as f:
        f.write(repr(time.time()))
    raise RuntimeError("deliberate failure before all_reduce")
C.all_reduce(Tensor([1.0]))
time.sleep(600)  # never reached in a healthy run: the peer is gone
