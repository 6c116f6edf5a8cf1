"""The shared-memory transport on its own (numpy only): collectives larger than the chunk
run as several exchanges, give numpy's results, and keep every segment within the chunk."""

from __future__ import annotations

import multiprocessing as mp
import os
import uuid

import numpy as np
import pytest

from mindtrain.parallel import shm

CHUNK = 1 << 16  # bytes (the smallest segment): the payloads below span several exchanges


def _data(r: int, shape, dtype=np.float32) -> np.ndarray:
    return np.random.RandomState(r).randn(*shape).astype(dtype)


def _member(token: str, size: int, me: int, out: "mp.Queue") -> None:
    t = shm.Transport(token, chunk=CHUNK)
    ranks = list(range(size))
    res = {}
    try:
        xs = [_data(r, (40_000 * size + 3 * size,)) for r in ranks]  # several pieces, odd tail
        res["all_reduce"] = np.abs(t.all_reduce(xs[me], ranks, me) - sum(xs)).max()
        ds = [_data(r, (257, 3), np.float64) for r in ranks]
        res["all_reduce_f64"] = np.abs(t.all_reduce(ds[me], ranks, me) - sum(ds)).max()
        res["all_gather"] = np.abs(t.all_gather(xs[me], ranks, me) - np.stack(xs)).max()
        res["broadcast"] = np.abs(t.broadcast(xs[me], 1, ranks, me) - xs[1]).max()
        want = np.split(sum(xs), size)[me]
        res["reduce_scatter"] = np.abs(t.reduce_scatter(xs[me], ranks, me) - want).max()
        res["empty"] = float(t.all_gather(np.zeros((0,), np.float32), ranks, me).shape != (size, 0))
        # member i sends 3000 * ((i + j) % 3) rows of 5 to member j
        splits = [[3000 * ((i + j) % 3) for j in range(size)] for i in ranks]
        zs = [_data(100 + i, (sum(splits[i]), 5)) for i in ranks]

        def part(i, j):
            off = sum(splits[i][:j])
            return zs[i][off:off + splits[i][j]]

        got = t.all_to_all(zs[me], splits[me], ranks, me)
        res["all_to_all"] = np.abs(got - np.concatenate([part(j, me) for j in ranks])).max()
        res["capacity"] = max(seg.capacity for seg in t._segments.values())
        out.put((me, res))
    finally:
        t.close()


@pytest.mark.skipif(not shm.supported(), reason="needs x86-64 Linux with /dev/shm")
@pytest.mark.parametrize("size", [2, 3])
def test_large_collectives_go_in_bounded_pieces(size):
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    token = f"test{os.getpid()}{uuid.uuid4().hex[:6]}"
    procs = [ctx.Process(target=_member, args=(token, size, r, q)) for r in range(size)]
    for p in procs:
        p.start()
    results = dict(q.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    for me, res in results.items():
        cap = res.pop("capacity")
        assert cap <= CHUNK, f"member {me}: segment of {cap} bytes per member"
        for name, err in res.items():
            assert err < 1e-5, f"member {me} {name}: {err}"
