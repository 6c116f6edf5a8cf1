"""DeepSeek-V4 under context parallelism, its CP ranks simulated in one process: each rank
runs its two load-balanced chunks through the model's pieces (the pipeline stage's calls),
with the parallel package's all-gather (``_KVExchange``) reading the other ranks' pieces from
their previous run instead of the group. A gathered piece depends only on pieces gathered
before it, so after as many rounds as a forward gathers, every rank has computed with the
other ranks' real pieces; its logits then equal the whole model's at its positions. The
sliding halo is checked both longer than a chunk (halo from several chunks) and shorter,
and the indexer with fewer (top-k) and with all entries kept. The gradients are the msrun
test's (integration_tests/test_v4_context_parallel.py)."""

import os

import numpy as np
import pytest
from mindspore import Tensor

import mindtrain.models as mm
from mindtrain.config import STEP_FIGURES, load_config
from mindtrain.parallel.context_parallel import _KVExchange, chunk_indices
from mindtrain.parallel.group import Group

TINY = os.path.join(os.path.dirname(__file__), "..", "..", "..", "configs", "pynative_ds4_tiny.yaml")


class _Simulated(_KVExchange):
    """CP rank ``rank`` of ``cp``: gathers this rank's piece with the others' from ``store``
    (what each rank gathered at the same call of its latest run; zeros before its first)."""

    def __init__(self, store: dict, cp: int, rank: int, seq_length: int):
        super().__init__(Group("cp", tuple(range(cp)), rank), seq_length)
        self.store = store
        self.calls = 0

    def _gather(self, local):
        slot = self.store.setdefault(self.calls, {})
        self.calls += 1
        slot[self.group.index] = local.asnumpy()
        zero = np.zeros_like(slot[self.group.index])
        return Tensor(np.concatenate([slot.get(r, zero) for r in range(self.group.size)]))


def _local_logits(model, ids, idx, exchange):
    for layer in model.model.layers:
        layer.self_attn.kv_exchange = exchange
    local = Tensor(np.ascontiguousarray(ids[:, idx]))
    model.begin_forward({"input_ids": local})
    tables, _ = model.rope(np.broadcast_to(idx, (ids.shape[0], len(idx))))
    h, _, _ = model.run_layers(model.embed(local), range(model.num_layers), tables, None, None)
    return model.logits(h).asnumpy()


@pytest.mark.parametrize("cp, window, topk, hca", [(2, 32, 16, 16), (4, 8, 8, 8)])
def test_simulated_cp_ranks_equal_one_process(cp, window, topk, hca):
    """64 tokens. CP=2, window 32: chunks of 16 tokens, a halo of 31 keys from up to two
    chunks before, 16 CSA entries all kept, HCA ratio 16; CP=4, window 8: chunks of 8 tokens
    on 4 ranks (0 and 7, 1 and 6, ...), a 7-key halo from the chunk before, the indexer
    keeping 8 of up to 16 entries, HCA ratio 8. HCA pools one window per chunk."""
    seq = 64
    cfg = load_config(TINY, [f"model.seq_length={seq}", f"train_dataset.dataloader.config.seq_length={seq}",
                             f"model.sliding_window={window}", f"model.index_topk={topk}",
                             f"model.compress_ratios=[0, 4, {hca}]"]).model
    model = mm.build_model(cfg, jit=False, seed=3)
    ids = np.random.default_rng(0).integers(0, cfg.vocab_size, (1, seq)).astype(np.int32)
    whole = model(Tensor(ids)).asnumpy()
    store, got, rounds = {}, None, 0
    while rounds < 10:  # a forward gathers 8 pieces: it settles in at most 9 rounds
        rounds += 1
        prev, got = got, {}
        for r in range(cp):
            ex = _Simulated(store, cp, r, seq)
            got[r] = _local_logits(model, ids, chunk_indices(seq, cp, r), ex)
        if prev is not None and all(np.array_equal(prev[r], got[r]) for r in range(cp)):
            break
    # sliding: the halo; compressed sparse: the halo, the boundary windows and the entries,
    # for the attention and for the indexer; heavily compressed: the halo and the entries
    assert ex.calls == 8 and 2 < rounds < 10
    for r in range(cp):
        np.testing.assert_allclose(got[r], whole[:, chunk_indices(seq, cp, r)], atol=2e-5, rtol=0)
    assert np.abs(whole).max() > 0.05


MLA = ["model.experimental_attention_variant=mla", "model.kv_lora_rank=32", "model.qk_nope_head_dim=16",
       "model.v_head_dim=16", "model.enable_hc_head=false"]


@pytest.mark.parametrize("variant", ["dsv4_hybrid", "mla"])
def test_simulated_cp_ranks_with_mtp_add_up_to_one_process(variant):
    """Two MTP depths under CP=2 (64 tokens, chunks of 16), each rank through the pipeline
    stage's forward on :func:`split_batch`'s part of the batch (the MTP inputs and targets
    shifted left by 1 and 2 on the whole sequence, then cut: the shift crosses the chunk
    boundaries): the ranks' loss shares add up to the whole model's loss, its language-model
    loss and its MTP loss. Hybrid: the MTP modules' sliding-window attention takes its halo
    from the chunk before; mla: DeepSeek-V3's attention over the all-gathered latent keys,
    the rows of the one-process causal mask (its tables of this rank's chunks)."""
    from mindtrain.parallel.context_parallel import split_batch
    from mindtrain.parallel.pipeline_stage import ModelStage

    seq, cp = 64, 2
    cfg = load_config(TINY, [f"model.seq_length={seq}", f"train_dataset.dataloader.config.seq_length={seq}",
                             "model.num_nextn_predict_layers=2"] + (MLA if variant == "mla" else [])).model
    model = mm.build_model(cfg, jit=False, seed=3)
    tokens = np.random.default_rng(1).integers(0, cfg.vocab_size, (2, seq + 1)).astype(np.int32)
    batch = {"input_ids": tokens[:, :-1], "labels": tokens[:, 1:]}
    loss, metrics = model(Tensor(batch["input_ids"]), labels=Tensor(batch["labels"]))
    whole = {"loss": loss, **metrics}
    plan = mm.parallel_plan(model)
    stage = ModelStage(model, plan, [u["name"] for u in plan["units"]])
    store, got, rounds = {}, None, 0
    while rounds < 10:
        rounds += 1
        prev, got = got, {}
        for r in range(cp):
            ex = _Simulated(store, cp, r, seq)
            for layer in model.model.layers:
                layer.self_attn.kv_exchange = ex
            mb = split_batch(batch, cp, r, cfg.num_attention_heads, 2, inputs=model.whole_sequence_inputs)
            got[r] = stage.forward(None, mb)[2].asnumpy()  # this rank's share of each figure
        if prev is not None and all(np.array_equal(prev[r], got[r]) for r in range(cp)):
            break
    assert ex.calls == (5 if variant == "mla" else 10) and rounds < 10
    shares = sum(got.values())
    for i, name in enumerate(STEP_FIGURES):
        if name in whole:
            np.testing.assert_allclose(shares[i], float(whole[name].asnumpy()), rtol=2e-6, err_msg=name)
    assert float(whole["mtp_loss"].asnumpy()) > 1.0


def test_config_rules():
    """Colossal CP is built (each chunk a whole number of windows of every compress ratio),
    with the MTP modules and for the mla variant (no compressed windows: any chunk length);
    Ulysses and hybrid are a one-line error naming the field."""
    from mindtrain.config import ConfigError
    from mindtrain.config.schema import ParallelismConfig
    from mindtrain.config.validate import validate_parallelism

    m = load_config(TINY).model  # seq 256, ratios 4 and 16
    validate_parallelism(ParallelismConfig(context_parallel=2), m)
    validate_parallelism(ParallelismConfig(context_parallel=8), m)  # chunks of 16 tokens
    with_mtp = load_config(TINY, ["model.num_nextn_predict_layers=1"]).model
    validate_parallelism(ParallelismConfig(context_parallel=2), with_mtp)
    mla = load_config(TINY, MLA + ["model.num_nextn_predict_layers=1"]).model
    validate_parallelism(ParallelismConfig(context_parallel=16), mla)  # chunks of 8 tokens
    with pytest.raises(ConfigError, match=r"^parallelism\.context_parallel_method: 'ulysses' is not built for DeepSeek-V4"):
        validate_parallelism(ParallelismConfig(context_parallel=2, context_parallel_method="ulysses"), mla)
    with pytest.raises(ConfigError) as err:
        validate_parallelism(ParallelismConfig(context_parallel=16), m)
    assert str(err.value).startswith("parallelism.context_parallel: 16: DeepSeek-V4 needs each of the 2 x "
                                     "context_parallel chunks (seq_length / 32 = 8 tokens)")
    for method in ("ulysses", "hybrid"):
        with pytest.raises(ConfigError) as err:
            validate_parallelism(ParallelismConfig(context_parallel=4, context_parallel_method=method,
                                                   ulysses_degree_in_cp=2 if method == "hybrid" else None), m)
        assert str(err.value).startswith(f"parallelism.context_parallel_method: '{method}' is not built for DeepSeek-V4")
