"""Differentiable collectives: each forward collective paired with its adjoint backward.

Built as Cells with a custom ``bprop`` (MindSpore's framework grads for AllGather and
friends need kernels the CPU backend lacks). Use these inside a loss function that
``ms.value_and_grad`` differentiates; use :mod:`mindtrain.parallel.collectives` outside
autograd.

=====================  ==============================  =================================
function               forward                         backward
=====================  ==============================  =================================
all_gather             all_gather along dim            reduce_scatter (sum) along dim
reduce_scatter         reduce_scatter (sum) along dim  all_gather along dim
all_to_all             all_to_all(send, recv splits)   all_to_all(recv, send splits)
copy_to_group          identity                        all_reduce (sum)
reduce_from_group      all_reduce (sum)                identity
split_to_group         own chunk of dim                all_gather along dim
=====================  ==============================  =================================
"""

from __future__ import annotations

from typing import Optional, Sequence

from mindspore import Tensor, nn

from mindtrain.parallel import collectives as C
from mindtrain.parallel.mesh import Group


class _AllGather(nn.Cell):
    def __init__(self, group: Group, dim: int):
        super().__init__()
        self.comm_group, self.dim = group, dim

    def construct(self, x):
        return C.all_gather(x, self.comm_group, self.dim)

    def bprop(self, x, out, dout):
        return (C.reduce_scatter(dout, self.comm_group, self.dim),)


class _ReduceScatter(nn.Cell):
    def __init__(self, group: Group, dim: int):
        super().__init__()
        self.comm_group, self.dim = group, dim

    def construct(self, x):
        return C.reduce_scatter(x, self.comm_group, self.dim)

    def bprop(self, x, out, dout):
        return (C.all_gather(dout, self.comm_group, self.dim),)


class _AllToAll(nn.Cell):
    def __init__(self, group: Group, send_splits, recv_splits):
        super().__init__()
        self.comm_group, self.send_splits, self.recv_splits = group, send_splits, recv_splits

    def construct(self, x):
        return C.all_to_all(x, self.comm_group, self.send_splits, self.recv_splits)

    def bprop(self, x, out, dout):
        return (C.all_to_all(dout, self.comm_group, self.recv_splits, self.send_splits),)


class _CopyToGroup(nn.Cell):
    def __init__(self, group: Group):
        super().__init__()
        self.comm_group = group

    def construct(self, x):
        return C.fresh(x)

    def bprop(self, x, out, dout):
        return (C.all_reduce(dout, self.comm_group),)


class _ReduceFromGroup(nn.Cell):
    def __init__(self, group: Group):
        super().__init__()
        self.comm_group = group

    def construct(self, x):
        return C.all_reduce(x, self.comm_group)

    def bprop(self, x, out, dout):
        return (C.fresh(dout),)


class _SplitToGroup(nn.Cell):
    def __init__(self, group: Group, dim: int):
        super().__init__()
        self.comm_group, self.dim = group, dim

    def construct(self, x):
        n = x.shape[self.dim] // self.comm_group.size
        return C.fresh(x.narrow(self.dim, self.comm_group.index * n, n))

    def bprop(self, x, out, dout):
        return (C.all_gather(dout, self.comm_group, self.dim),)


# Cells are cheap to call but not to build; the ones without per-call data are cached.
_cache: dict = {}


def _cell(kind, *key):
    k = (kind, *key)
    cell = _cache.get(k)
    if cell is None:
        cell = _cache[k] = kind(*key)
    return cell


def _group(group: Optional[Group]) -> Group:
    return C.world_group() if group is None else group


def all_gather(x: Tensor, group: Optional[Group] = None, dim: int = 0) -> Tensor:
    """All-gather along ``dim``; the gradient is reduce-scattered (summed) back."""
    return _cell(_AllGather, _group(group), dim)(x)


def reduce_scatter(x: Tensor, group: Optional[Group] = None, dim: int = 0) -> Tensor:
    """Sum over the group and keep this rank's chunk; the gradient is all-gathered."""
    return _cell(_ReduceScatter, _group(group), dim)(x)


def all_to_all(x: Tensor, group: Optional[Group] = None, send_splits: Optional[Sequence[int]] = None,
               recv_splits: Optional[Sequence[int]] = None) -> Tensor:
    """All-to-all on rows; the gradient travels back by the reverse all-to-all.

    Pass both split lists when they are unequal (the backward needs ``recv_splits``).
    """
    g = _group(group)
    if send_splits is not None and recv_splits is None:
        raise ValueError("all_to_all with send_splits needs recv_splits too (for the backward)")
    s = None if send_splits is None else tuple(int(v) for v in send_splits)
    r = None if recv_splits is None else tuple(int(v) for v in recv_splits)
    if s is None:
        return _cell(_AllToAll, g, None, None)(x)
    return _AllToAll(g, s, r)(x)


def copy_to_group(x: Tensor, group: Optional[Group] = None) -> Tensor:
    """Identity forward; gradients from every member are summed (entering a TP region)."""
    return _cell(_CopyToGroup, _group(group))(x)


def reduce_from_group(x: Tensor, group: Optional[Group] = None) -> Tensor:
    """Sum over the group forward; gradient passes through (leaving a TP region)."""
    return _cell(_ReduceFromGroup, _group(group))(x)


def split_to_group(x: Tensor, group: Optional[Group] = None, dim: int = 0) -> Tensor:
    """This rank's chunk of ``dim`` forward; the gradient is all-gathered."""
    return _cell(_SplitToGroup, _group(group), dim)(x)
