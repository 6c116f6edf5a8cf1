"""What the layout-parity workers (tp_ep_parity.py, v4_layouts.py) share: weights seeded by
parameter name, a step's synthetic tokens, and meshes that reuse the backend groups earlier
cases of the job created. Import after :func:`pinning.pin_to_one_core`."""

from __future__ import annotations

import zlib

import numpy as np

from mindspore import Tensor

from mindtrain.parallel import DeviceMesh

_GROUPS: dict = {}  # member ranks -> backend group, across the job's cases


def seed_weights(params, std: float, keep: tuple) -> None:
    """Each parameter normal(0, ``std``) from a generator seeded by its name (the same
    values in every layout), but those whose name ends with one of ``keep``."""
    for p in params:
        if p.name.endswith(keep):
            continue
        rs = np.random.RandomState(zlib.crc32(p.name.encode()))
        p.set_data(Tensor(rs.normal(0.0, std, p.shape).astype(np.float32)))


def tokens(step: int, rows: int, seq: int):
    """Step ``step``'s ``rows`` sequences: input ids and labels [rows, seq] (shifted by one)."""
    rs = np.random.RandomState(100 + step)
    t = rs.randint(0, 512, (rows, seq + 1)).astype(np.int32)
    return t[:, :-1], t[:, 1:]


def mesh_with_groups(dims, rank: int) -> DeviceMesh:
    """``dims``' mesh of ``rank`` with its backend groups, created once per member set in
    this job."""
    return DeviceMesh(dims, rank).init_process_groups(_GROUPS)
