"""Where the job runs: device choice, msrun detection, rank/world, and the few collectives
the trainer itself needs (barrier, sum over all ranks)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

import numpy as np

from mindtrain.config import ConfigError, UserError

_ASCEND_HINTS = ("ASCEND_HOME_PATH", "ASCEND_TOOLKIT_HOME", "ASCEND_OPP_PATH")


def launched_by_msrun() -> bool:
    """msrun exports MS_ROLE (MS_WORKER, or MS_SCHED for its scheduler process, which runs
    the same command line) and MS_WORKER_NUM."""
    return "MS_ROLE" in os.environ or "MS_WORKER_NUM" in os.environ


def ascend_present() -> bool:
    """True when an Ascend toolkit is installed and MindSpore can use it."""
    # Asking MindSpore directly prints multi-line plugin warnings on machines without CANN,
    # so only ask when the toolkit is there at all.
    if not (any(os.environ.get(k) for k in _ASCEND_HINTS) or os.path.isdir("/usr/local/Ascend")):
        return False
    import mindspore.device_context.ascend as ascend

    return bool(ascend.is_available())


def choose_device(device_target: Optional[str]) -> tuple[str, str]:
    """(device, why): the configured target, else Ascend when present, else CPU."""
    if device_target:
        if device_target == "Ascend" and not ascend_present():
            raise ConfigError("context.device_target", "is Ascend, but no usable Ascend device/CANN was found; "
                              "remove it to run on CPU, or install CANN")
        return device_target, "context.device_target"
    if ascend_present():
        return "Ascend", "default: Ascend is present"
    return "CPU", "default: no Ascend device found"


@dataclass
class Runtime:
    """The process's place in the job."""

    device: str
    rank: int = 0
    world_size: int = 1
    distributed: bool = False

    def barrier(self) -> None:
        if self.distributed:
            from mindspore.mint import distributed as dist

            dist.barrier()

    def all_sum(self, values: np.ndarray) -> np.ndarray:
        """Element-wise sum of a float32 vector over all ranks (one collective)."""
        if not self.distributed:
            return values
        import mindspore as ms
        from mindspore.mint import distributed as dist

        buf = ms.Tensor(np.ascontiguousarray(values, np.float32))
        dist.all_reduce(buf)
        return buf.asnumpy()

    def all_gather_floats(self, values: np.ndarray) -> np.ndarray:
        """[world_size, n] float32: every rank's vector."""
        if not self.distributed:
            return np.asarray(values, np.float32)[None]
        n = len(values)
        buf = np.zeros((self.world_size, n), np.float32)
        buf[self.rank] = values
        return self.all_sum(buf.reshape(-1)).reshape(self.world_size, n)


def start(device_target: Optional[str]) -> tuple[Runtime, str]:
    """Set the device and, under msrun, join the job. Returns the runtime and a start-up note."""
    import mindspore as ms

    device, why = choose_device(device_target)
    ms.set_device(device)
    ms.set_context(mode=ms.PYNATIVE_MODE)
    if not launched_by_msrun():
        return Runtime(device=device), f"device: {device} ({why}); single process"
    from mindspore.communication import get_group_size, get_rank, init

    if os.environ.get("MS_ROLE") == "MS_SCHED":
        try:
            init()  # msrun's scheduler process serves the job here
        except RuntimeError as err:
            first = str(err).splitlines()[0][:300]
            hint = (f"; is --master_port {os.environ.get('MS_SCHED_PORT')} already in use?"
                    if "not successfully spawned" in first else "")
            raise UserError(f"msrun scheduler: {first}{hint}") from None
        raise SystemExit(0)
    init()
    rt = Runtime(device=device, rank=get_rank(), world_size=get_group_size(), distributed=True)
    return rt, f"device: {device} ({why}); msrun worker {rt.rank} of {rt.world_size}"
