"""Same-host collectives through shared memory, for CPU workers (numpy only, no MindSpore).

MindSpore's CPU collectives (mccl) go over TCP through the framework's comm threads; on a
loaded host each call costs 8-40 ms even for a few KB and 45-120 ms for 4-8 MB (measured,
see the parallel README). When every rank of a job runs on one host, a collective can
instead be a copy into a shared segment, one arrival flag per rank and a read: this module.

One :class:`Segment` per group (its global ranks). Layout of the mapped file::

    header: one int64 arrival counter per member, each on its own 64-byte line
    data:   2 buffers x members x capacity bytes

Every operation is collective over the group and goes: write this rank's bytes into its
slot of buffer ``seq % 2``, publish ``seq`` in its counter, wait until every member has
published ``seq``, read. A member reaches operation ``seq + 2`` (the next use of the same
buffer) only after every member published ``seq + 1``, which each does only after it has
finished reading operation ``seq``: two buffers need no second barrier. Reductions add
the members' contributions in member order, so every rank gets the same bits.

The segment's file is unlinked as soon as every member has mapped it, so a killed job
leaves nothing in ``/dev/shm``. A collective larger than :data:`CHUNK` per member runs as
several exchanges of at most that size, so a segment stays bounded (its pages count in
every member's RSS: a ZeRO-3 unit's 200 MB reduce-scatter through one exchange kept about
0.5 GB resident per rank). A payload larger than the segment's capacity (up to CHUNK)
makes every member move to a new, larger segment at the same operation (all members of a
collective pass equally sized payloads, or exchange sizes first).

Ordering relies on x86-64's store order (data stores become visible before the counter
store that follows them); :func:`supported` says whether this host qualifies.
"""

from __future__ import annotations

import mmap
import os
import platform
import time
from typing import Callable, Optional, Sequence

import numpy as np

_LINE = 64
CHUNK = 8 << 20
"""Largest payload per member of one exchange: a group's segment holds 2 x members x this
at most (64 MiB for 4 members), whatever the size of the collectives it carries."""
_DIR = "/dev/shm"


def supported() -> bool:
    """x86-64 Linux with a writable /dev/shm."""
    return (platform.system() == "Linux" and platform.machine() in ("x86_64", "AMD64")
            and os.path.isdir(_DIR) and os.access(_DIR, os.W_OK))


class Segment:
    """A group's shared buffers, as seen by member ``index`` of ``size``."""

    def __init__(self, token: str, ranks: Sequence[int], index: int, capacity: int = 1 << 16,
                 generation: int = 0):
        self.token = token
        self.ranks = tuple(ranks)
        self.index = index
        self.size = len(self.ranks)
        self.capacity = _round_up(max(capacity, 1))
        self.generation = generation
        self.seq = 0
        header = _LINE * self.size
        total = header + 2 * self.size * self.capacity
        path = os.path.join(_DIR, f"mindtrain-{token}-{'_'.join(map(str, self.ranks))}-g{generation}")
        self._map = _map_file(path, total)
        self._counters = np.ndarray((self.size,), np.int64, self._map, 0, (_LINE,))
        self._data = np.ndarray((2, self.size, self.capacity), np.uint8, self._map, header)
        self._arrive()  # every member has mapped the file: it may go
        if index == 0:
            _unlink(path)

    def close(self) -> None:
        self._counters = self._data = None
        self._map.close()

    # ---- the one primitive -----------------------------------------------------------------
    def _arrive(self) -> int:
        """Publish this member's next sequence number and wait for every member's."""
        self.seq += 1
        seq = self.seq
        self._counters[self.index] = seq
        counters = self._counters
        _poll(lambda: int(counters.min()) >= seq)
        return seq

    def _grow(self, nbytes: int) -> "Segment":
        nxt = Segment(self.token, self.ranks, self.index, nbytes, self.generation + 1)
        self.close()
        return nxt

    def exchange(self, payload: np.ndarray) -> np.ndarray:
        """Every member's bytes of ``payload`` (all the same size): uint8 array (size, nbytes),
        a view valid until the operation after next; copy out what you keep."""
        raw = np.ascontiguousarray(payload).reshape(-1).view(np.uint8)
        n = raw.size
        buf = self._data[(self.seq + 1) % 2]
        buf[self.index, :n] = raw
        self._arrive()
        return buf[:, :n]


class Transport:
    """Shared-memory collectives for the groups of one job on one host."""

    def __init__(self, token: str, chunk: int = CHUNK):
        self.token = token
        self.chunk = int(chunk)
        self._segments: dict[tuple[int, ...], Segment] = {}
        self._channels: dict[tuple[int, int], Channel] = {}

    def _segment(self, ranks: Sequence[int], index: int, nbytes: int) -> Segment:
        ranks = tuple(ranks)
        seg = self._segments.get(ranks)
        nbytes = min(nbytes, self.chunk)
        if seg is None:
            seg = Segment(self.token, ranks, index, max(nbytes, 1 << 16))
        elif nbytes > seg.capacity:
            seg = seg._grow(nbytes)
        self._segments[ranks] = seg
        return seg

    def close(self) -> None:
        for seg in self._segments.values():
            seg.close()
        for ch in self._channels.values():
            ch.close()
        self._segments.clear()
        self._channels.clear()

    def _pieces(self, nbytes: int, align: int):
        """(start, stop) byte ranges of at most ``self.chunk`` bytes (multiples of ``align``)
        covering ``nbytes``: a large collective runs as several exchanges through the
        bounded segment."""
        step = max(align, self.chunk // align * align)
        for start in range(0, nbytes, step):
            yield start, min(start + step, nbytes)
        if nbytes == 0:
            yield 0, 0

    # ---- collectives on numpy arrays ---------------------------------------------------------
    def all_gather(self, x: np.ndarray, ranks: Sequence[int], index: int,
                   sink: Optional[Callable[[int, int, np.ndarray], None]] = None) -> Optional[np.ndarray]:
        """Every member's ``x`` (same shape and dtype everywhere), stacked: shape (size, *x.shape).

        With ``sink``, nothing is stacked: ``sink(start, stop, table)`` receives each piece
        as it arrives (elements ``start:stop`` of every member's flat ``x``, ``table`` of
        shape (size, stop - start), valid during the call), for a caller that puts the
        pieces where they belong without a stacked copy."""
        x = np.ascontiguousarray(x)
        flat = x.reshape(-1)
        out = None if sink is not None else np.empty((len(ranks), flat.size), x.dtype)
        for a, b in self._pieces(flat.size * x.itemsize, x.itemsize):
            i, j = a // x.itemsize, b // x.itemsize
            table = self._segment(ranks, index, b - a).exchange(flat[i:j]).view(x.dtype)
            if sink is not None:
                sink(i, j, table)
            else:
                out[:, i:j] = table
        return None if out is None else out.reshape((len(ranks),) + x.shape)

    def all_reduce(self, x: np.ndarray, ranks: Sequence[int], index: int) -> np.ndarray:
        """Sum over members, added in member order (the same bits on every member)."""
        x = np.ascontiguousarray(x)
        flat = x.reshape(-1)
        out = np.empty_like(flat)
        for a, b in self._pieces(flat.size * x.itemsize, x.itemsize):
            i, j = a // x.itemsize, b // x.itemsize
            table = self._segment(ranks, index, b - a).exchange(flat[i:j]).view(x.dtype)
            part = out[i:j]
            part[:] = table[0]
            for row in table[1:]:
                part += row
        return out.reshape(x.shape)

    def reduce_scatter(self, x: np.ndarray, ranks: Sequence[int], index: int) -> np.ndarray:
        """Sum over members of chunk ``index`` of ``x``'s flat data (size divisible by members)."""
        x = np.ascontiguousarray(x)
        size = len(ranks)
        chunks = x.reshape(size, -1)            # chunk j goes to member j
        n = chunks.shape[1]
        out = np.empty(n, x.dtype)
        # each exchange carries the same window of every member's chunk: size x window
        per = max(1, self.chunk // (size * x.itemsize))
        for i in range(0, max(n, 1), per):
            j = min(i + per, n)
            window = np.ascontiguousarray(chunks[:, i:j])
            table = self._segment(ranks, index, window.nbytes).exchange(window)
            mine = table.view(x.dtype).reshape(size, size, j - i)[:, index]
            part = out[i:j]
            part[:] = mine[0]
            for row in mine[1:]:
                part += row
        return out

    def broadcast(self, x: np.ndarray, src: int, ranks: Sequence[int], index: int) -> np.ndarray:
        """Member ``src``'s ``x`` (every member passes an array of the same shape and dtype)."""
        x = np.ascontiguousarray(x)
        raw = x.reshape(-1).view(np.uint8)
        out = np.empty(raw.size, np.uint8)
        for a, b in self._pieces(raw.size, 1):
            out[a:b] = self._segment(ranks, index, b - a).exchange(raw[a:b])[src]
        return out.view(x.dtype).reshape(x.shape)

    def all_to_all(self, x: np.ndarray, send_rows: Sequence[int], ranks: Sequence[int],
                   index: int) -> np.ndarray:
        """Rows ``send_rows[j]`` of ``x`` (dim 0, in order) go to member j; returns the rows
        received from members 0..size-1 concatenated (the splits first, then the rows)."""
        x = np.ascontiguousarray(x)
        row_bytes = int(np.prod(x.shape[1:], dtype=np.int64)) * x.itemsize
        splits = self.all_gather(np.asarray(send_rows, np.int64), ranks, index)  # [sender, receiver]
        most = int(splits.sum(axis=1).max()) * row_bytes
        flat = x.reshape(-1).view(np.uint8)
        starts = np.concatenate([np.zeros((len(ranks), 1), np.int64), np.cumsum(splits, axis=1)], axis=1)
        lo, hi = starts[:, index] * row_bytes, starts[:, index + 1] * row_bytes  # what j sends me
        outs = np.concatenate([[0], np.cumsum(hi - lo)])
        out = np.empty(int(outs[-1]), np.uint8)
        for a, b in self._pieces(most, 1):
            piece = flat[a:min(b, flat.size)]
            if piece.size < b - a:
                piece = np.concatenate([piece, np.zeros(b - a - piece.size, np.uint8)])
            table = self._segment(ranks, index, b - a).exchange(piece)
            for j in range(len(ranks)):
                s, e = max(a, lo[j]), min(b, hi[j])
                if s < e:
                    out[outs[j] + s - lo[j]:outs[j] + e - lo[j]] = table[j, s - a:e - a]
        rows = int(splits[:, index].sum())
        return out.view(x.dtype).reshape((rows,) + x.shape[1:])

    def barrier(self, ranks: Sequence[int], index: int) -> None:
        self._segment(ranks, index, 0)._arrive()

    # ---- point to point ------------------------------------------------------------------------
    def _channel(self, src: int, dst: int, sending: bool, nbytes: int) -> Channel:
        ch = self._channels.get((src, dst))
        if ch is None:
            ch = Channel(self.token, src, dst, sending, max(nbytes, 1 << 16))
        elif nbytes > ch.capacity:
            nxt = Channel(self.token, src, dst, sending, nbytes, ch.generation + 1)
            ch.close()
            ch = nxt
        self._channels[(src, dst)] = ch
        return ch

    def send(self, x: np.ndarray, me: int, dst: int) -> None:
        """Global rank ``me`` sends ``x`` to global rank ``dst`` (returns once it is buffered)."""
        raw = np.ascontiguousarray(x).reshape(-1).view(np.uint8)
        self._channel(me, dst, True, raw.size).send(raw)

    def recv(self, shape: Sequence[int], dtype, me: int, src: int) -> np.ndarray:
        """The next array global rank ``src`` sent to global rank ``me``."""
        out = np.empty(tuple(shape), dtype)
        self._channel(src, me, False, out.nbytes).recv(out.reshape(-1).view(np.uint8))
        return out


class Channel:
    """One direction of point-to-point traffic, ``src`` -> ``dst`` (global ranks).

    Counters: messages sent (written by src), messages taken (written by dst), and one
    attach flag each. Message k uses slot ``k % slots``; the sender waits until message
    ``k - slots`` was taken before writing, so a send returns as soon as its bytes are in
    place: up to ``slots`` (16, fewer for messages over 16 MB) messages may be in flight,
    which is what a pipeline schedule's non-blocking sends need. Sender and receiver both
    know each message's size (the receiver passes its shape), so both move to a larger
    segment at the same message.
    """

    def __init__(self, token: str, src: int, dst: int, sending: bool, capacity: int = 1 << 16,
                 generation: int = 0):
        self.sending = sending
        self.capacity = _round_up(max(capacity, 1))
        self.generation = generation
        self.count = 0
        self.slots = max(2, min(16, (256 << 20) // self.capacity))
        total = 4 * _LINE + self.slots * self.capacity
        path = os.path.join(_DIR, f"mindtrain-{token}-p2p-{src}-{dst}-g{generation}")
        self._map = _map_file(path, total)
        # [sent, taken, src attached, dst attached]
        self._flags = np.ndarray((4,), np.int64, self._map, 0, (_LINE,))
        self._data = np.ndarray((self.slots, self.capacity), np.uint8, self._map, 4 * _LINE)
        self._flags[2 if sending else 3] = 1
        _wait(self._flags, 3 if sending else 2, 1)
        if sending:
            _unlink(path)

    def close(self) -> None:
        self._flags = self._data = None
        self._map.close()

    def send(self, raw: np.ndarray) -> None:
        k = self.count + 1
        _wait(self._flags, 1, k - self.slots)
        self._data[k % self.slots, :raw.size] = raw
        self._flags[0] = k
        self.count = k

    def recv(self, out: np.ndarray) -> None:
        k = self.count + 1
        _wait(self._flags, 0, k)
        out[:] = self._data[k % self.slots, :out.size]
        self._flags[1] = k
        self.count = k


def _map_file(path: str, total: int) -> mmap.mmap:
    """Map ``path`` (created, or opened if a peer was first) at ``total`` bytes."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        if os.fstat(fd).st_size < total:
            os.ftruncate(fd, total)
        return mmap.mmap(fd, total)
    finally:
        os.close(fd)


def _unlink(path: str) -> None:
    """Remove a mapped file's name (the mapping stays); a peer may have removed it already."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _poll(ready: Callable[[], bool]) -> None:
    """Return once ``ready()`` holds, sleeping 20 us at first and backing off to 1 ms."""
    pause = 2e-5
    while not ready():
        time.sleep(pause)
        pause = min(pause * 1.5, 1e-3)


def _wait(flags: np.ndarray, i: int, value: int) -> None:
    _poll(lambda: int(flags[i]) >= value)


def _round_up(n: int) -> int:
    """Next power of two (at least 64 bytes), so a growing payload rarely moves segments."""
    n = max(int(n), _LINE)
    return 1 << (n - 1).bit_length()


_transport: Optional[Transport] = None


def transport() -> Optional[Transport]:
    return _transport


def start(token: str) -> Transport:
    global _transport
    if _transport is None:
        _transport = Transport(token)
    return _transport


def stop() -> None:
    global _transport
    if _transport is not None:
        _transport.close()
        _transport = None
