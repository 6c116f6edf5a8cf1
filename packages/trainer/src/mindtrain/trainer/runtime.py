"""Where the job runs: device choice, msrun detection, rank/world, and the few collectives
the trainer itself needs (barrier, sum over all ranks)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np

from mindtrain.config import ConfigError, UserError

_ASCEND_HINTS = ("ASCEND_HOME_PATH", "ASCEND_TOOLKIT_HOME", "ASCEND_OPP_PATH")


def launched_by_msrun() -> bool:
    """msrun exports MS_ROLE (MS_WORKER, or MS_SCHED for its scheduler process, which runs
    the same command line) and MS_WORKER_NUM."""
    return "MS_ROLE" in os.environ or "MS_WORKER_NUM" in os.environ


CPU_BIND_ENV = "MINDTRAIN_CPU_BIND"


def bind_cpu_worker() -> Optional[int]:
    """An msrun worker on CPU: bind every thread of this process (and so every thread it
    starts later) to one core, the worker's rank round-robin over the cores it may use (what
    ``msrun --bind_core`` does for devices; msrun's RANK_ID, else its DEVICE_ID, the local
    rank: two launchers on one host then still spread their workers). Unbound, the workers' runtime threads
    wander over every core and their collectives wait to be scheduled: the tiny config's
    2-worker step took 461 ms (ZeRO-2) and 654 ms (ZeRO-3) unbound, 284 and 346 ms bound
    (``benchmarks/bench_parallel.py``). ``MINDTRAIN_CPU_BIND=0`` leaves the threads free.
    Returns the core, or None when nothing was bound."""
    local = os.environ.get("RANK_ID") or os.environ.get("DEVICE_ID")
    if os.environ.get(CPU_BIND_ENV, "1") == "0" or local is None or not local.isdigit():
        return None
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        return None
    core = cpus[int(local) % len(cpus)]
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), {core})
        except OSError:  # a thread that has just ended
            pass
    return core


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


def scheduler_message(text: str, first_gone: Optional[int] = None) -> str:
    """One line for a failure reported by msrun's scheduler, naming the rank when it can.
    ``first_gone``: the rank whose worker process was seen to vanish first (see
    :class:`WorkerWatch`)."""
    first = text.splitlines()[0] if text else "failed"
    lost = re.search(r"worker (\d+) is the first one timed out", first)
    if lost:
        rank = lost.group(1)
        # The scheduler names the first node whose heartbeat lapsed, which is not always
        # the one that died (a survivor blocked on its dead peer can lapse first). On one
        # host the launcher's children tell: the rank whose worker process vanished first
        # (msrun kills the other workers about a second later), or else the one without a
        # live worker process.
        gone = [first_gone] if first_gone is not None else _missing_local_ranks()
        if len(gone) == 1:
            rank = str(gone[0])
        return (f"msrun scheduler: worker rank {rank} stopped responding (it died or hung), so the job is "
                f"ending; see its log worker_{rank}.log")
    if "not successfully spawned" in first:
        return (f"msrun scheduler: {first[:200]}; is --master_port {os.environ.get('MS_SCHED_PORT')} "
                "already in use?")
    return f"msrun scheduler: {first[:300]}"


def local_workers(launcher: Optional[int] = None) -> Optional[dict[int, int]]:
    """{RANK_ID: pid} of this msrun job's local workers that have a live process (single
    host: every worker is a child of the launcher, ``launcher`` or this process's parent);
    None when /proc cannot tell."""
    try:
        parent = os.getppid() if launcher is None else launcher
        alive = {}
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                with open(f"/proc/{pid}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                if int(fields[1]) != parent or fields[0] in ("Z", "X"):
                    continue
                with open(f"/proc/{pid}/comm") as f:
                    if f.read().strip() == "tail":
                        continue  # msrun's `tail -f` of each worker log carries the worker's env
                with open(f"/proc/{pid}/environ", "rb") as f:
                    env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
            except (OSError, ValueError, IndexError):
                continue
            if env.get(b"MS_ROLE") == b"MS_WORKER" and env.get(b"RANK_ID", b"").isdigit():
                alive[int(env[b"RANK_ID"])] = int(pid)
    except (OSError, ValueError):
        return None
    return alive


def worker_pid(launcher: int, rank: int, timeout: float = 10.0) -> int:
    """The pid of msrun ``launcher``'s local worker with RANK_ID ``rank`` (waits for it to appear)."""
    deadline = time.monotonic() + timeout
    while True:
        pid = (local_workers(launcher) or {}).get(rank)
        if pid is not None:
            return pid
        if time.monotonic() > deadline:
            raise RuntimeError(f"no worker with RANK_ID={rank} under msrun {launcher}")
        time.sleep(0.1)


def _live_local_ranks(launcher: Optional[int] = None) -> Optional[set[int]]:
    """RANK_IDs of the local workers with a live process (see :func:`local_workers`)."""
    workers = local_workers(launcher)
    return None if workers is None else set(workers)


def _pid_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return False


def _missing_local_ranks() -> list[int]:
    """RANK_IDs of this job's local workers without a live process; [] when that cannot be
    told (no /proc, or no worker alive at all, e.g. after msrun has killed them)."""
    expected = int(os.environ.get("MS_LOCAL_WORKER", os.environ.get("MS_WORKER_NUM", "0")) or 0)
    alive = _live_local_ranks()
    if not alive or expected <= 0:
        return []
    return sorted(set(range(expected)) - alive)


def _watch(launcher: int, watcher_parent: int, expected: int) -> None:
    """Body of :class:`WorkerWatch`'s process: print the local rank whose worker process
    vanishes first, then exit (nothing when two vanish between two looks, or when the
    process that started the watch ends). Finds the workers by scanning /proc, then checks
    only their pids, every 10 ms: msrun kills the others well under a second after one dies."""
    workers: dict[int, int] = {}
    while os.getppid() == watcher_parent:
        if len(workers) < expected:
            found = local_workers(launcher)
            if found is None:
                return
            workers.update(found)
            if len(workers) >= expected:
                print("watching", flush=True)
            else:
                time.sleep(0.2)
            continue
        gone = [r for r, pid in sorted(workers.items()) if not _pid_alive(pid)]
        if gone:
            if len(gone) == 1:
                print(gone[0], flush=True)
            return
        time.sleep(0.01)


class WorkerWatch:
    """Started by msrun's scheduler process: remembers the first local rank whose worker
    process vanished. msrun kills every other worker about a second after one exits, and
    the scheduler reports only later (a heartbeat timeout naming whichever node lapsed
    first), when no worker is alive any more. A child process watches, since the
    scheduler's ``init()`` does not let a Python thread run."""

    def __init__(self, expected: Optional[int] = None):
        if expected is None:
            expected = int(os.environ.get("MS_LOCAL_WORKER", os.environ.get("MS_WORKER_NUM", "0")) or 0)
        code = f"from mindtrain.trainer.runtime import _watch; _watch({os.getppid()}, {os.getpid()}, {expected})"
        self._proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                                      stderr=subprocess.DEVNULL, text=True)

    def wait_watching(self, timeout: float) -> bool:
        """Block until the watch has found every local worker (True), or ``timeout`` s."""
        import select

        ready, _, _ = select.select([self._proc.stdout], [], [], timeout)
        return bool(ready) and self._proc.stdout.readline().strip() == "watching"

    def first_gone(self, timeout: float = 2.0) -> Optional[int]:
        """The first rank seen gone (waiting up to ``timeout`` s), else None; ends the watch."""
        try:
            out, _ = self._proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.communicate()
            return None
        last = out.strip().splitlines()[-1] if out.strip() else ""
        return int(last) if last.isdigit() else None


@dataclass
class Runtime:
    """The process's place in the job."""

    device: str
    rank: int = 0
    world_size: int = 1
    distributed: bool = False

    def barrier(self) -> None:
        """Return only when every rank has arrived."""
        # An all-reduce read back on the host: the framework's barrier is queued like any
        # other kernel and may return before the peers arrive (seen with checkpoint writes).
        if self.distributed:
            self.all_sum(np.ones(1, np.float32))

    def all_sum(self, values: np.ndarray, dtype=np.float32) -> np.ndarray:
        """Element-wise sum of a vector over all ranks, in ``dtype`` (one collective)."""
        if not self.distributed:
            return values
        import mindspore as ms
        from mindtrain.parallel import all_reduce

        return all_reduce(ms.Tensor(np.ascontiguousarray(values, dtype))).asnumpy()

    def all_gather_bytes(self, data: bytes) -> list[bytes]:
        """Every rank's ``data``, in rank order (one small collective pair)."""
        return all_gather_bytes(self.all_sum, self.rank, self.world_size, data)


def all_gather_bytes(all_sum: Callable[[np.ndarray], np.ndarray], rank: int, world_size: int,
                     data: bytes) -> list[bytes]:
    """Every rank's ``data``, in rank order, through two float32 sums (lengths, then the
    bytes each rank puts in its own span): small messages such as a save's piece lists."""
    if world_size == 1:
        return [data]
    lengths = np.zeros(world_size, np.float32)
    lengths[rank] = len(data)
    lengths = all_sum(lengths).astype(np.int64)
    starts = np.concatenate([[0], np.cumsum(lengths)])
    buf = np.zeros(int(starts[-1]), np.float32)
    buf[starts[rank]:starts[rank + 1]] = np.frombuffer(data, np.uint8)
    total = np.rint(all_sum(buf)).astype(np.uint8).tobytes()
    return [total[starts[r]:starts[r + 1]] for r in range(world_size)]


def start(device_target: Optional[str]) -> tuple[Runtime, str]:
    """Set the device and, under msrun, join the job. Returns the runtime and a start-up note."""
    import mindspore as ms

    device, why = choose_device(device_target)
    ms.set_device(device)
    ms.set_context(mode=ms.PYNATIVE_MODE)
    from mindtrain.models import synchronous_cpu_dispatch

    synchronous_cpu_dispatch()  # CPU: eager ops run in the calling thread (~8x faster eager steps)
    if not launched_by_msrun():
        return Runtime(device=device), f"device: {device} ({why}); single process"
    if os.environ.get("MS_ROLE") == "MS_SCHED":
        from mindspore.communication import init

        from mindtrain.trainer.hang_watch import job_folder, scheduler_report

        watch = WorkerWatch()
        try:
            init()  # msrun's scheduler process serves the job here
        except RuntimeError as err:
            # a worker's hang watch ended the job: its line names the rank that fell behind
            report = scheduler_report()
            raise UserError(report or scheduler_message(str(err), watch.first_gone())) from None
        finally:
            shutil.rmtree(job_folder(), ignore_errors=True)
        watch.first_gone(timeout=0)
        raise SystemExit(0)
    from mindtrain.parallel import init_distributed

    core = bind_cpu_worker() if device == "CPU" else None
    # joins the job, picks the collective backend, and makes an uncaught exception in any
    # thread end this rank at once (so msrun stops the others)
    world, rank = init_distributed()
    rt = Runtime(device=device, rank=rank, world_size=world, distributed=True)
    bound = f"; each CPU worker bound to one core ({CPU_BIND_ENV}=0 leaves them free)" if core is not None else ""
    return rt, f"device: {device} ({why}); msrun worker {rt.rank} of {rt.world_size}{bound}"


def apply_context(cfg, device: str) -> list[str]:
    """``training.deterministic`` and ``context.max_device_memory`` for this process;
    returns start-up notes for what has no effect on this device."""
    import mindspore as ms

    if cfg.training.deterministic and ms.get_context("deterministic") != "ON":
        # MindFormers' PyNative trainer calls the same switch; MindSpore refuses a second
        # call in one process (a second Trainer in the same process finds it on)
        ms.set_deterministic(True)
    notes = []
    limit = cfg.context.max_device_memory
    if limit:
        if not re.fullmatch(r"\d+(\.\d+)?GB", str(limit)):
            raise ConfigError("context.max_device_memory", f"is {limit!r}; give a size like \"58GB\"")
        if device == "Ascend":
            ms.runtime.set_memory(max_size=str(limit))
        else:
            notes.append(f"context.max_device_memory={limit} has no effect on {device} (applied on Ascend only)")
    return notes
