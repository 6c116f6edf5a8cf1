"""The layout's shards against its full state, for the parity workers (any layout).

Each of ``layout.named_params`` holds, as :meth:`Layout.shards` says, the box of the full
tensor that ``to_full`` rebuilt (padding aside); writing those boxes back through
``load_params`` (what a sharded checkpoint's resume does) leaves every piece as it was."""

from __future__ import annotations

import numpy as np


def check_shards(layout, full: dict) -> int:
    """Assert the two properties; returns how many pieces were checked. A collective under
    FSDP ZeRO-1/2 (``load_params`` refreshes the gathered weights)."""
    shards = layout.shards()
    tensors = [t for _, t in layout.named_params]
    assert [s.name for s in shards] == [n for n, _ in layout.named_params]
    before = [t.asnumpy().copy() for t in tensors]
    pieces = []
    for sh, local in zip(shards, before):
        box = full[sh.name][tuple(slice(o, o + n) for o, n in zip(sh.offset, sh.shape))]
        np.testing.assert_array_equal(sh.take(local), box, err_msg=sh.name)
        pieces.append(sh.place(np.ascontiguousarray(box), local.shape))
    layout.load_params(pieces)
    for (name, t), b in zip(layout.named_params, before):
        np.testing.assert_array_equal(t.asnumpy(), b, err_msg=name)
    return len(shards)
