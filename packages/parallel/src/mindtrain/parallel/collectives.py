"""Collectives that work on every MindSpore backend, as plain functions on fresh tensors.

One backend choice at start-up (:func:`init_distributed`):

- ``"native"`` (Ascend hccl, GPU nccl): the framework's reduce-scatter and all-to-all kernels.
- ``"composed"`` (CPU mccl): MindSpore 2.10 registers AllReduce, AllGather, Broadcast,
  Send/Recv and Barrier on CPU but no ReduceScatter, AllToAll, Reduce or batched
  send/recv kernel, so those are built from the ones that exist: reduce_scatter =
  all_reduce + own chunk; all_to_all = pairwise send/recv in a global pair order.

On CPU, when every rank runs on one host, all_reduce, all_gather, reduce_scatter,
all_to_all, broadcast and barrier go through shared memory instead
(:mod:`mindtrain.parallel.shm`): mccl's per-call cost on a loaded host (8-40 ms for a few
KB, 45-120 ms for 4-8 MB) dominated a data-parallel step. send/recv use a shared buffer per
direction too. ``MINDTRAIN_CPU_TRANSPORT=mccl`` keeps MindSpore's collectives. Ascend and
GPU are untouched.

Every function returns a new contiguous tensor and never writes into its argument: the
framework's in-place collectives silently do nothing on a view or slice, so each call
works on a fresh copy. ``group`` is a :class:`~mindtrain.parallel.group.Group` (``None``
means all ranks); ``src``/``dst`` are indices *within* the group. A group of size 1 (or a
single-process run) makes every collective the identity without touching the backend.

Gradient-carrying versions are in :mod:`mindtrain.parallel.functional`.
"""

from __future__ import annotations

import functools
import os
import time
from typing import Optional, Sequence

import numpy as np

import mindspore as ms
from mindspore import Tensor, mint, ops

from mindtrain.parallel.group import Group

_state = {"backend": None, "world_size": 1, "rank": 0, "world_name": None, "shm": None}
# dtypes the shared-memory path carries (bfloat16 has no plain numpy dtype: it uses mccl)
_SHM_NUMPY = {ms.float16: np.float16, ms.float32: np.float32, ms.float64: np.float64, ms.int8: np.int8,
              ms.uint8: np.uint8, ms.int32: np.int32, ms.int64: np.int64, ms.bool_: np.bool_}
_SHM_DTYPES = tuple(_SHM_NUMPY)


def init_distributed(backend: Optional[str] = None) -> tuple[int, int]:
    """Join the job started by msrun (or run alone) and pick the collective backend once.

    Returns ``(world_size, rank)``. ``backend`` forces ``"native"`` or ``"composed"``;
    by default CPU gets ``"composed"`` and other devices ``"native"``. Also installs the
    failure handler so that a rank that raises ends the whole job promptly.
    """
    from mindtrain.parallel.failure import install_failure_handler

    if _state["backend"] is not None:
        return _state["world_size"], _state["rank"]
    device = ms.get_context("device_target")
    if backend is None:
        backend = "composed" if device == "CPU" else "native"
    if backend not in ("native", "composed"):
        raise ValueError(f"backend must be 'native' or 'composed', got {backend!r}")
    if "MS_ROLE" in os.environ or "MS_WORKER_NUM" in os.environ:
        from mindspore.communication import GlobalComm, get_group_size, get_rank, init

        init()
        _fix_group_defaults(GlobalComm.WORLD_COMM_GROUP)
        _state.update(world_size=get_group_size(), rank=get_rank(), world_name=GlobalComm.WORLD_COMM_GROUP)
        if backend == "composed" and _state["world_size"] > 1:
            _start_shm()
    _state["backend"] = backend
    install_failure_handler(_state["rank"])
    return _state["world_size"], _state["rank"]


def _start_shm() -> None:
    """Use shared memory when every rank is on this host (one object all-gather decides)."""
    import socket
    import uuid

    import mindspore.mint.distributed as dist

    from mindtrain.parallel import shm

    wanted = os.environ.get("MINDTRAIN_CPU_TRANSPORT", "shm").lower()
    if wanted not in ("shm", "mccl"):
        raise ValueError(f"MINDTRAIN_CPU_TRANSPORT must be 'shm' or 'mccl', got {wanted!r}")
    mine = (socket.gethostname(), wanted == "shm" and shm.supported(), uuid.uuid4().hex[:16])
    every = [None] * _state["world_size"]
    dist.all_gather_object(every, mine, group=_state["world_name"])
    if all(host == mine[0] and ok for host, ok, _ in every):
        _state["shm"] = shm.start(every[0][2])


def transport() -> str:
    """``"shm"`` (same-host shared memory), ``"mccl"``/``"native"`` (the framework's), or
    ``"none"`` in a single process."""
    if _state["world_size"] <= 1:
        return "none"
    if _state["shm"] is not None:
        return "shm"
    return "native" if _state["backend"] == "native" else "mccl"


def _shm(x: Tensor):
    """The shared-memory transport if it carries ``x``, else ``None``."""
    t = _state["shm"]
    return t if t is not None and x.dtype in _SHM_DTYPES else None


def on_host(group: Optional[Group], dtype) -> bool:
    """Whether collectives over ``group`` for ``dtype`` run on the host (shared memory), so that
    a caller holding numpy arrays may use :func:`host_all_gather` / :func:`host_reduce_scatter`
    and skip the device tensors' per-slice ops."""
    g = _g(group)
    return not _trivial(g) and _state["shm"] is not None and dtype in _SHM_DTYPES


def _fix_group_defaults(world: str) -> None:
    # mint.distributed binds "hccl_world_group" as a default argument at import; send/recv
    # and broadcast_object_list look it up even when a group is given, and fail on CPU.
    import mindspore.mint.distributed.distributed as dd

    dd.get_cache_group_rank.__defaults__ = (world,)
    dd.get_cache_group_size.__defaults__ = (world,)


def backend() -> Optional[str]:
    """``"native"``, ``"composed"``, or ``None`` before :func:`init_distributed`."""
    return _state["backend"]


def world_size() -> int:
    return _state["world_size"]


def global_rank() -> int:
    return _state["rank"]


def world_group() -> Group:
    """All ranks, in rank order."""
    n = _state["world_size"]
    return Group("world", tuple(range(n)), _state["rank"], _state["world_name"] if n > 1 else None)


def new_group(ranks: Sequence[int]) -> Optional[str]:
    """Backend name for a group of global ``ranks``; call it on member ranks only.

    Size 1 needs no backend group (``None``); all ranks use the world group.
    """
    ranks = tuple(ranks)
    if len(ranks) <= 1:
        return None
    if ranks == tuple(range(_state["world_size"])):
        return _state["world_name"]
    if _state["rank"] not in ranks:
        raise RuntimeError(f"rank {_state['rank']} must not create group {ranks} it is not part of")
    from mindspore.communication import create_group

    name = "mt_" + "_".join(map(str, ranks))
    create_group(name, list(ranks))
    return name


# ---- helpers ---------------------------------------------------------------------------

def _g(group: Optional[Group]) -> Group:
    return world_group() if group is None else group


def _trivial(g: Group) -> bool:
    return g.size == 1


def _name(g: Group) -> str:
    if g.name is None:
        raise RuntimeError(f"group {g.dim} {g.ranks} has no backend group; call "
                           f"DeviceMesh.init_process_groups() first")
    return g.name


def fresh(x: Tensor) -> Tensor:
    """A contiguous copy that owns its memory (safe target for in-place collectives)."""
    return ops.deepcopy(x)


def _move(x: Tensor, dim: int) -> tuple[Tensor, int]:
    dim = dim % x.ndim
    return (x if dim == 0 else ops.movedim(x, dim, 0)), dim


def _back(x: Tensor, dim: int) -> Tensor:
    return x if dim == 0 else ops.movedim(x, 0, dim)


# ---- timing (for benchmarks) -------------------------------------------------------------

_timing = {"on": False, "seconds": 0.0, "depth": 0}


def reset_timing(enabled: bool) -> float:
    """Return the seconds spent in collectives since the last call and restart the count.

    While enabled, each collective waits for its result before returning (so the time is
    real, and includes waiting for slower ranks); keep it off outside benchmarks.
    """
    spent = _timing["seconds"]
    _timing.update(on=enabled, seconds=0.0)
    return spent


# MINDTRAIN_COMM_STATS=PATH: count every top-level collective call and its wall time, and
# write them with the peak RSS to PATH.rank<N>.json at exit (benchmarks/bench_parallel.py).
_stats = {"calls": 0, "seconds": 0.0}


def _write_stats(path: str) -> None:
    import json
    import resource

    with open(f"{path}.rank{_state['rank']}.json", "w") as f:
        json.dump(dict(_stats, transport=transport(),
                       peak_rss_mb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024), f)


if os.environ.get("MINDTRAIN_COMM_STATS"):
    import atexit

    atexit.register(_write_stats, os.environ["MINDTRAIN_COMM_STATS"])


def _timed(fn):
    counting = bool(os.environ.get("MINDTRAIN_COMM_STATS"))

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if counting and not _timing["depth"]:
            _timing["depth"] += 1
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                _timing["depth"] -= 1
                _stats["calls"] += 1
                _stats["seconds"] += time.perf_counter() - t0
        if not _timing["on"] or _timing["depth"]:
            return fn(*args, **kwargs)
        _timing["depth"] += 1
        t0 = time.perf_counter()
        try:
            out = fn(*args, **kwargs)
            if isinstance(out, Tensor):
                out.asnumpy()
            return out
        finally:
            _timing["depth"] -= 1
            _timing["seconds"] += time.perf_counter() - t0
    return wrapper


# ---- collectives -----------------------------------------------------------------------

@_timed
def host_all_gather(arr: np.ndarray, group: Optional[Group] = None, sink=None) -> Optional[np.ndarray]:
    """Every member's ``arr`` stacked on a new first axis (shape ``(N, *arr.shape)``); needs
    :func:`on_host`. With ``sink(start, stop, table)`` the pieces go to it as they arrive
    (``shm.Transport.all_gather``) and nothing is returned."""
    g = _g(group)
    return _state["shm"].all_gather(arr, g.ranks, g.index, sink=sink)


@_timed
def host_reduce_scatter(arr: np.ndarray, group: Optional[Group] = None, op: str = "sum") -> np.ndarray:
    """Chunk ``group.index`` (of N equal chunks of the flat data) of the sum (or mean) over
    members; needs :func:`on_host`."""
    g = _g(group)
    out = _state["shm"].reduce_scatter(arr, g.ranks, g.index)
    return out / out.dtype.type(g.size) if op == "avg" else out


@_timed
def all_reduce(x: Tensor, group: Optional[Group] = None, op: str = "sum") -> Tensor:
    """Sum (``op="sum"``) or mean (``op="avg"``, sum / group size) over the group."""
    if op not in ("sum", "avg"):
        raise ValueError(f"all_reduce supports op 'sum' and 'avg', got {op!r}")
    g = _g(group)
    if _trivial(g):
        return fresh(x)
    t = _shm(x)
    if t is not None:
        total = Tensor(t.all_reduce(x.asnumpy(), g.ranks, g.index))
        return total / g.size if op == "avg" else total
    if x.dtype == ms.float64 and _state["backend"] == "composed":
        total = _all_reduce_float64(x, g)
    else:
        import mindspore.mint.distributed as dist

        total = fresh(x)
        dist.all_reduce(total, group=_name(g))
    return total / g.size if op == "avg" else total


def _all_reduce_float64(x: Tensor, g: Group) -> Tensor:
    # The CPU AllReduce kernel rejects float64. Each value travels as two float32 words
    # (hi + lo keep ~48 bits) by all_gather and the sum is taken in float64 here.
    arr = x.asnumpy()
    hi = arr.astype(np.float32)
    lo = (arr - hi).astype(np.float32)
    table = all_gather(Tensor(np.stack([hi, lo])[None]), g).asnumpy().astype(np.float64)
    return Tensor(table.sum(axis=(0, 1)))


@_timed
def all_gather(x: Tensor, group: Optional[Group] = None, dim: int = 0) -> Tensor:
    """Concatenate every member's ``x`` (same shape everywhere) along ``dim`` in group order."""
    g = _g(group)
    if _trivial(g):
        return fresh(x)
    t = _shm(x)
    if t is not None:
        table = t.all_gather(x.asnumpy(), g.ranks, g.index)
        return Tensor(np.concatenate(list(table), axis=dim % max(x.ndim, 1)) if x.ndim else table)
    import mindspore.mint.distributed as dist

    parts = [mint.zeros(x.shape, dtype=x.dtype) for _ in range(g.size)]
    dist.all_gather(parts, fresh(x), group=_name(g))
    return mint.cat(parts, dim=dim)


@_timed
def reduce_scatter(x: Tensor, group: Optional[Group] = None, dim: int = 0, op: str = "sum") -> Tensor:
    """Reduce over the group, then keep chunk ``group.index`` of ``dim`` (size divisible by N)."""
    g = _g(group)
    if x.shape[dim] % g.size:
        raise ValueError(f"reduce_scatter: dim {dim} of shape {tuple(x.shape)} is not divisible "
                         f"by the group size {g.size}")
    if _trivial(g):
        return fresh(x)
    chunk = x.shape[dim] // g.size
    t = _shm(x)
    if t is not None:
        d = dim % x.ndim
        a = np.moveaxis(x.asnumpy(), d, 0)
        mine = t.reduce_scatter(a, g.ranks, g.index).reshape((chunk,) + a.shape[1:])
        out = Tensor(np.ascontiguousarray(np.moveaxis(mine, 0, d)))
        return out / g.size if op == "avg" else out
    if _state["backend"] == "native":
        import mindspore.mint.distributed as dist

        x0, d = _move(x, dim)
        out = mint.zeros((chunk,) + tuple(x0.shape[1:]), dtype=x.dtype)
        dist.reduce_scatter_tensor(out, fresh(x0), group=_name(g))
        out = out / g.size if op == "avg" else out
        return fresh(_back(out, d))
    total = all_reduce(x, g, op)
    return fresh(mint.narrow(total, dim, g.index * chunk, chunk))


@_timed
def all_to_all(x: Tensor, group: Optional[Group] = None,
               send_splits: Optional[Sequence[int]] = None,
               recv_splits: Optional[Sequence[int]] = None) -> Tensor:
    """Exchange rows (dim 0): rows ``send_splits[j]`` go to member j; returns the rows
    received from members 0..N-1 concatenated, ``recv_splits[j]`` from member j.

    Both ``None`` means equal splits (dim 0 divisible by N). With only ``send_splits``
    given, the receive sizes are exchanged first (one extra all_gather of N integers).
    """
    g = _g(group)
    n = x.shape[0]
    if send_splits is None:
        if n % g.size:
            raise ValueError(f"all_to_all: {n} rows do not split equally over {g.size} ranks")
        send_splits = [n // g.size] * g.size
    send_splits = [int(s) for s in send_splits]
    if len(send_splits) != g.size or sum(send_splits) != n:
        raise ValueError(f"all_to_all: send_splits {send_splits} must have {g.size} entries summing to {n}")
    t = None if _trivial(g) else _shm(x)
    if t is not None:  # the receive sizes travel with the rows
        return Tensor(t.all_to_all(x.asnumpy(), send_splits, g.ranks, g.index))
    if recv_splits is None:
        if _trivial(g):
            recv_splits = send_splits
        else:
            table = all_gather(Tensor([send_splits], ms.int64), g).asnumpy()
            recv_splits = [int(v) for v in table[:, g.index]]
    recv_splits = [int(s) for s in recv_splits]
    if _trivial(g):
        return fresh(x)
    rest = tuple(x.shape[1:])
    if _state["backend"] == "native":
        import mindspore.mint.distributed as dist

        out = mint.zeros((sum(recv_splits),) + rest, dtype=x.dtype)
        dist.all_to_all_single(out, fresh(x), recv_splits, send_splits, group=_name(g))
        return out
    import mindspore.mint.distributed as dist

    offsets = [0]
    for s in send_splits:
        offsets.append(offsets[-1] + s)
    pieces: list[Optional[Tensor]] = [None] * g.size
    me = g.index
    pieces[me] = fresh(x[offsets[me]:offsets[me + 1]])
    name = _name(g)
    # Every rank walks its peers in ascending order and the lower rank of each pair sends
    # first: all ranks meet the pairs in one global order, so blocking send/recv cannot
    # deadlock.
    for peer in range(g.size):
        if peer == me:
            continue
        out_rows = send_splits[peer]
        in_rows = recv_splits[peer]
        buf = mint.zeros((in_rows,) + rest, dtype=x.dtype) if in_rows else None
        src = fresh(x[offsets[peer]:offsets[peer + 1]]) if out_rows else None
        peer_global = g.global_rank(peer)
        if me < peer:
            if src is not None:
                dist.send(src, dst=peer_global, group=name)
            if buf is not None:
                dist.recv(buf, src=peer_global, group=name)
        else:
            if buf is not None:
                dist.recv(buf, src=peer_global, group=name)
            if src is not None:
                dist.send(src, dst=peer_global, group=name)
        pieces[peer] = buf if buf is not None else mint.zeros((0,) + rest, dtype=x.dtype)
    return mint.cat([p for p in pieces if p.shape[0]] or [pieces[me]], dim=0)


@_timed
def broadcast(x: Tensor, src: int = 0, group: Optional[Group] = None) -> Tensor:
    """Member ``src``'s ``x`` on every member (``x`` gives shape and dtype elsewhere)."""
    g = _g(group)
    if _trivial(g):
        return fresh(x)
    t = _shm(x)
    if t is not None:
        return Tensor(t.broadcast(x.asnumpy(), src, g.ranks, g.index))
    import mindspore.mint.distributed as dist

    buf = fresh(x)
    dist.broadcast(buf, src=g.global_rank(src), group=_name(g))
    return buf


class _Sent:
    """A finished send (shared memory: the bytes are already in the channel)."""

    def wait(self) -> None:
        return None


class _Pending:
    """An mccl isend in flight; keeps its buffer alive until :meth:`wait`."""

    def __init__(self, work, buf):
        self.work, self.buf = work, buf

    def wait(self) -> None:
        self.work.wait()
        self.buf = None


@_timed
def isend(x: Tensor, dst: int, group: Optional[Group] = None):
    """Start sending ``x`` to member ``dst``; returns a handle whose ``wait()`` ends the send
    (call it before the step ends). Pair with :func:`recv` on that member."""
    g = _g(group)
    if dst == g.index:
        raise ValueError("isend: dst is this rank")
    t = _shm(x)
    if t is not None:
        t.send(x.asnumpy(), g.global_rank(g.index), g.global_rank(dst))
        return _Sent()
    import mindspore.mint.distributed as dist

    buf = fresh(x)
    return _Pending(dist.isend(buf, dst=g.global_rank(dst), group=_name(g)), buf)


@_timed
def send(x: Tensor, dst: int, group: Optional[Group] = None) -> None:
    """Send ``x`` to member ``dst``; pair with :func:`recv` on that member. Blocking on mccl;
    on the shared-memory transport it returns once ``x`` is buffered (up to 16 messages per
    direction in flight)."""
    isend(x, dst, group).wait()


@_timed
def recv(shape: Sequence[int], dtype, src: int, group: Optional[Group] = None) -> Tensor:
    """Blocking receive of a ``shape``/``dtype`` tensor from member ``src``."""
    g = _g(group)
    if src == g.index:
        raise ValueError("recv: src is this rank")
    if _state["shm"] is not None and dtype in _SHM_DTYPES:
        arr = _state["shm"].recv(shape, _SHM_NUMPY[dtype], g.global_rank(g.index), g.global_rank(src))
        return Tensor(arr)
    import mindspore.mint.distributed as dist

    buf = mint.zeros(tuple(shape), dtype=dtype)
    dist.recv(buf, src=g.global_rank(src), group=_name(g))
    return buf


@_timed
def barrier(group: Optional[Group] = None) -> None:
    """Wait until every member arrives."""
    g = _g(group)
    if _trivial(g):
        return
    if _state["shm"] is not None:
        _state["shm"].barrier(g.ranks, g.index)
        return
    import mindspore.mint.distributed as dist

    dist.barrier(group=_name(g))
