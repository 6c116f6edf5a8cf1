"""Device mesh, portable collectives, FSDP, TP+SP, EP, CP and PP for MindSpore.

``mindtrain.parallel.mesh`` and ``group`` are pure Python; the other modules import MindSpore.
"""

from mindtrain.parallel.__about__ import __version__
from mindtrain.parallel.group import Group
from mindtrain.parallel.mesh import DIMS, DeviceMesh

__all__ = ["__version__", "DIMS", "DeviceMesh", "Group", "collectives", "functional", "fully_shard",
           "FSDP", "init_distributed", "install_failure_handler"]


def __getattr__(name):
    # MindSpore-backed parts load on first use so that the mesh stays importable without it.
    import importlib

    if name in ("collectives", "functional", "fsdp", "failure"):
        return importlib.import_module(f"mindtrain.parallel.{name}")
    if name == "init_distributed":
        from mindtrain.parallel.collectives import init_distributed
        return init_distributed
    if name == "install_failure_handler":
        from mindtrain.parallel.failure import install_failure_handler
        return install_failure_handler
    if name in ("fully_shard", "FSDP"):
        from mindtrain.parallel import fsdp
        return getattr(fsdp, name)
    raise AttributeError(f"module 'mindtrain.parallel' has no attribute {name!r}")
