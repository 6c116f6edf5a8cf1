"""DeepSeek-V4 under context parallelism equals one process (issue 32), with its MTP module,
in both attention variants.

``workers/v4_layouts.py`` trains the tiny V4 of configs/pynative_ds4_tiny.yaml (one decoder
layer, hash-routed, and one MTP module, learned routing) at 32 tokens for 2 steps, compiled,
as one process and as 2 msrun workers with context_parallel=2 (load-balanced chunks of 8
tokens), the same global batch (2 sequences in one micro-batch); the four cases run in one
msrun launch (with test_v4_layouts.py's cases: v4_runs.py), their references in one process
beside it:

- ``cp2``: the hybrid attention, the layer compressed sparse (ratio 4; its lightning indexer
  keeping 4 of 8 entries) and the MTP module sliding-window, each with a 16-token window: the
  sliding halo (15 keys, from the two chunks before), the ratio-4 boundary windows and the
  compressed entries all-gathered (MindFormers' scheme);
- ``cp2_mla``: MindFormers' published variant (DeepSeek-V3's MLA in the layer and in the MTP
  module, no hc_head): DeepSeek-V3's colossal context parallelism, the latent keys all-gathered;
- ``cp2_ulysses``, ``cp2_mla_ulysses`` (issue 34): the same under
  ``context_parallel_method: ulysses``, against the same references. Hybrid attention: each
  rank's queries of its chunks and all 4 heads go by all-to-all to 2 heads of the whole
  sequence, the one shared key/value head and the compressed entries are all-gathered, the
  output comes back by all-to-all; mla: DeepSeek-V3's Ulysses core (queries, keys and values
  by all-to-all). Hybrid CP (Ulysses in groups of CP ranks) needs 4 ranks: the
  simulated-ranks test runs it in one process.

The MTP module's inputs and targets are shifted left on the whole sequence before it is cut
(the shift crosses chunk boundaries), as DeepSeek-V3's. Each step's loss and gradient norm
and every final weight equal the single process at the layout tolerances (v4_runs.py), and
each CP rank holds mindtrain-estimate's bytes. The simulated-ranks test
(packages/models/tests/test_deepseek_v4_context_parallel.py) checks the forward of the
schemes in one process (the heavily compressed layers, longer halos, CP=4, two MTP depths).
"""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from v4_runs import CP_CASES as CASES, assert_equals_one_process, max_differences  # noqa: E402


@pytest.fixture(scope="module")
def results(v4_results):
    """The launch shared with test_v4_layouts.py (conftest.py's ``v4_results``)."""
    return v4_results


@pytest.mark.msrun
@pytest.mark.parametrize("case", CASES)
def test_cp2_equals_one_process(results, case):
    got, ref = results[case], results["ref_" + case.removesuffix("_ulysses")]
    print(case, max_differences(got, ref))
    assert_equals_one_process(got, ref, case)
    assert any(".eh_proj." in k for k in ref)  # the MTP module trained
    # Ulysses ran in the decoder layer and the MTP module (colossal: in neither)
    assert int(got["ulysses_cells"]) == (2 if case.endswith("_ulysses") else 0)
    # each CP rank holds the whole model and its AdamW state, as mindtrain-estimate counts
    assert int(got["param_bytes_layout"]) == int(got["param_bytes_estimate"]) == int(ref["param_bytes_layout"])
    assert int(got["optimizer_bytes"]) == int(got["optimizer_bytes_estimate"])
