"""optimizer.type: Muon under msrun: 2 workers with ZeRO-3 (and with TP2) (every weight a dim-0 shard, padded
where the rows do not split evenly) give the figures of one process, step after step: each
rank gathers the Newton-Schulz inputs whole (a bounded batch at a time), orthogonalises and keeps its own rows;
with QK-clip, the max attention logits are gathered over the ranks and each clips its own rows. Muon's
arithmetic against torch.optim.Muon and its resume are in packages/trainer/tests/test_muon*.py."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from one_vs_two import max_rel_diff, one_and_twos  # noqa: E402

pytestmark = pytest.mark.msrun

LAYOUTS = {"zero3": (8735, []), "tp2": (8736, ["parallelism.tensor_parallel=2"])}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One process and both 2-worker layouts (ZeRO-3 alone, and TP2 over it), started at once:
    the one-process run is the same for both (the layout goes to the workers only), so it
    runs once. Returns (the one process's rows, {layout: rank 0's rows})."""
    return one_and_twos(str(tmp_path_factory.mktemp("muon")), [
        "training.global_batch_size=4", "optimizer.type=Muon", "optimizer.weight_decay=0.1",
        "lr_scheduler.learning_rate=0.01", "optimizer.qk_clip_enabled=true", "optimizer.qk_clip_threshold=0.1",
        "optimizer.ns_coefficients=[[[3.4445, -4.7750, 2.0315], 4], [[2.0, -1.5, 0.5], 1]]"], LAYOUTS)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_two_workers_with_qk_clip_equal_one_process(runs, layout):
    """QK-clip on (threshold below the tiny model's max logits, so heads clip at every step):
    the ZeRO-3 row is also the plain Muon ZeRO-3 parity (the clip only rescales rows after Muon's
    update, which runs as without it);
    each rank records its max logits, the table is gathered (a max over ranks; under TP each
    rank's heads are its block), and each scales the rows of its own pieces of q_b_proj /
    kv_b_proj (ZeRO-3 dim-0 shards; TP: its heads' rows)."""
    one, two = runs[0], runs[1][layout]
    assert [r["step"] for r in one] == [r["step"] for r in two] == [1, 2, 3, 4]
    assert all(r["qk_clipped_heads"] > 0 for r in one)
    assert [r["qk_clipped_heads"] for r in two] == [r["qk_clipped_heads"] for r in one]
    err = max(max_rel_diff(two, one), max(abs(a["max_attention_logit"] - b["max_attention_logit"]) /
                                          b["max_attention_logit"] for a, b in zip(two, one)))
    print(f"Muon + QK-clip {layout} 2 workers vs 1 process: max relative difference over 4 steps: {err:.2e}; "
          f"heads clipped per step: {[r['qk_clipped_heads'] for r in one]}")
    assert err < 1e-5
    assert one[-1]["loss"] < one[0]["loss"]
