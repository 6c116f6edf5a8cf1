"""Device mesh, portable collectives, FSDP, TP+SP, EP, CP and PP for MindSpore.

``mindtrain.parallel.mesh`` and ``group`` are pure Python; the other modules import MindSpore.
The names below are the package's API (other packages import nothing else from it); the
MindSpore-backed ones load on first use.
"""

from mindtrain.parallel.__about__ import __version__
from mindtrain.parallel.group import Group
from mindtrain.parallel.mesh import DIMS, DeviceMesh

# name -> the module that defines it (imported on first use)
_LAZY = {
    "init_distributed": "collectives",
    "all_reduce": "collectives",
    "install_failure_handler": "failure",
    "fully_shard": "fsdp",
    "synchronous_dispatch": "fsdp",
    "FSDP": "fsdp",
    "apply_tensor_parallel": "tensor_parallel",
    "TensorParallel": "tensor_parallel",
    "param_bytes": "tensor_parallel",
    "apply_expert_parallel": "expert_parallel",
    "ExpertParallel": "expert_parallel",
    "global_expert_load": "expert_parallel",
    "PipelineSchedule": "pipeline_parallel",
    "relax_receive_timeout": "pipeline_parallel",
    "parallelize": "compose",
    "ShardedLayout": "compose",
    "Layout": "layout",
    "grad_norm": "layout",
    "grad_sq_sums": "layout",
    "ModelShare": "share",
    "split_piece": "layout",
}
_MODULES = ("collectives", "functional", "fsdp", "failure")

__all__ = ["__version__", "DIMS", "DeviceMesh", "Group", *_MODULES, *_LAZY]


def __getattr__(name):
    # MindSpore-backed parts load on first use so that the mesh stays importable without it.
    import importlib

    if name in _MODULES:
        return importlib.import_module(f"mindtrain.parallel.{name}")
    if name in _LAZY:
        return getattr(importlib.import_module(f"mindtrain.parallel.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'mindtrain.parallel' has no attribute {name!r}")
