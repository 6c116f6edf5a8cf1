"""DeepSeek-V4 under the layouts equals one process (issue 32, "Layouts").

The tiny V4 of ``configs/pynative_ds4_tiny.yaml`` (a sliding-window, a compressed sparse
with its lightning indexer choosing 4 of 8 entries, and a heavily compressed layer; two
hyper-connection streams; hash routing by token id in layer 0, learned sqrtsoftplus routing
with the correction bias after; clamped SwiGLU experts; per-head attention sinks; the grouped
low-rank output projection), compiled, trains 2 steps of the same global batch (2 sequences
of 32 tokens, AdamW, the aux-loss-free bias update with the global expert load) with
attention and hidden dropout 0.1 (issue 34: each step's masks are a hash of the seed, the step
and each token's sample and position, so every layout draws one process's) as one process
(2 accumulation micro-batches) and, in one 2-worker msrun launch (which also runs
test_v4_context_parallel.py's cases: v4_runs.py), as

- TP=2 with sequence parallelism: query heads, sinks and output groups split, the shared
  key/value head, compressors and indexer whole on both ranks, the streams split along the
  sequence and each shard's hash router reading its own tokens' ids;
- EP=2 over the two data-parallel ranks with ZeRO-3 (one unit per decoder layer): the
  clamped SwiGLU experts run by expert parallelism's own local step;
- PP=2: the streams [B, S, hc, H] go between the stages, the token ids are on both;
- PP=2 of the model without hyper-connections and without the query-latent / key-value norms
  (``pp2_plain``, issue 34: ``enable_hyper_connections: false``, ``enable_hc_head: false``,
  ``qk_layernorm: false``): the one residual [B, S, H] goes between the stages; against its
  own one-process reference (``ref_plain``).

Per-step losses and grad norms, the final weights at full shape (with the correction
biases) equal the single process at the DeepSeek-V3 rows' tolerances (test_tp_ep_parity.py),
and every rank's parameter and AdamW bytes are mindtrain-estimate's. Context parallelism has
its own job of the same worker (test_v4_context_parallel.py: both attention variants with MTP).

A fast test without msrun: tensor parallelism's splits of V4's attention as its plan
declares them (no communication: the shards are local) and the one-line refusal of an
``o_groups`` the degree does not divide.
"""

import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from v4_runs import LAYOUT_CASES as CASES, assert_equals_one_process, layout_ref, max_differences  # noqa: E402


@pytest.fixture(scope="module")
def results(v4_results):
    """The launch shared with test_v4_context_parallel.py (conftest.py's ``v4_results``)."""
    return v4_results


@pytest.mark.msrun
@pytest.mark.parametrize("case", CASES)
def test_v4_layout_equals_one_process(results, case):
    ref = results[layout_ref(case)]
    print(case, max_differences(results[case], ref))
    assert_equals_one_process(results[case], ref, case)
    plain = case.endswith("_plain")  # no hyper-connection weights, no attention latent / key-value norms
    assert plain == (not any("_hc." in k for k in ref))
    assert plain == (not any(k.endswith(("self_attn.q_a_norm.weight", "self_attn.kv_norm.weight")) for k in ref))
    # ZeRO-3's units release their gathered weights in place, no forward replayed (the trainer's CPU path)
    assert bool(results[case]["zero3_in_place"]) == ("zero3" in case), case
    # the bias update moved the learned routers' correction biases (layers 1 and 2)
    assert any(np.abs(ref[k]).max() > 0 for k in ref if k.startswith("p:") and k.endswith("e_score_correction_bias"))


@pytest.mark.msrun
def test_v4_layouts_hold_their_share(results):
    """Per-rank bytes: TP halves the split attention weights, experts, vocabulary (each rank
    holds less than 0.7 of one process's), EP x ZeRO-3 holds half the experts and a shard
    of the rest, each stage of PP=2 a part of the layers; each is mindtrain-estimate's count
    (parameters resident between steps and AdamW state, the indexer and hyper-connections
    included)."""
    for case in ("ref", "ref_plain") + CASES:
        r = results[case]
        assert int(r["param_bytes_layout"]) == int(r["param_bytes_estimate"]), case
        assert int(r["optimizer_bytes"]) == int(r["optimizer_bytes_estimate"]), case
        if not case.startswith("ref"):
            full = int(results[layout_ref(case)]["param_bytes_layout"])
            assert int(r["param_bytes_layout"]) < 0.7 * full, (case, full)


# ---------------------------------------------------------------- one process, no msrun

def test_deepseek_v4_splits_by_its_plan_and_refuses_what_does_not_divide():
    """DeepSeek-V4's attention region (its plan: heads, sinks and the grouped output
    projection's groups split; the one key/value head and the indexer whole) under TP=2 (no
    communication: the shards are local); a model whose o_groups TP does not divide is
    refused in one line naming the field before any weight changes."""
    import mindspore as ms

    from mindtrain.config import ConfigError, ModelConfig, ParallelDims
    from mindtrain.models import build_model, parallel_plan
    from mindtrain.parallel import DeviceMesh
    from mindtrain.parallel.tensor_parallel import apply_tensor_parallel, param_bytes

    def v4(**kw):
        return ModelConfig(**dict(dict(
            model_type="deepseek_v4", architectures="DeepseekV4ForCausalLM", seq_length=32, vocab_size=64,
            hidden_size=32, moe_intermediate_size=16, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=1, head_dim=16, q_lora_rank=24, qk_rope_head_dim=8, n_routed_experts=4,
            num_experts_per_tok=2, compress_ratios=[0, 4], o_groups=2, o_lora_rank=8, index_n_heads=2,
            index_head_dim=16, index_topk=2, hc_mult=2, num_hash_layers=1, max_position_embeddings=64), **kw))

    ms.set_device("CPU")
    mesh = DeviceMesh(ParallelDims(world_size=2, pp=1, dp_shard=1, cp=1, tp=2, ep=1), 0)
    model = build_model(v4(), jit=False)
    apply_tensor_parallel(model, parallel_plan(model), mesh)
    attn = model.model.layers[1].self_attn
    assert (attn.num_heads, attn.o_groups, tuple(attn.sinks.shape)) == (2, 1, (2,))
    assert tuple(attn.q_b_proj.weight.shape) == (2 * 16, 24) and tuple(attn.kv_proj.weight.shape) == (16, 32)
    assert tuple(attn.o_a_proj.weight.shape) == (8, 32) and tuple(attn.o_b_proj.weight.shape) == (32, 8)
    assert tuple(attn.compressor.indexer.q_b_proj.weight.shape) == (2 * 16, 24)

    model = build_model(v4(o_groups=1, o_lora_rank=16), jit=False)
    before = param_bytes(model)
    with pytest.raises(ConfigError, match=r"^model\.o_groups: 1 is not divisible by parallelism\.tensor_parallel=2"):
        apply_tensor_parallel(model, parallel_plan(model), mesh)
    assert param_bytes(model) == before
