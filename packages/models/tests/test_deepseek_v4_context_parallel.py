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
from mindtrain.parallel.context_parallel import _HeadExchange, _KVExchange, _UlyssesCore, chunk_indices
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


class _SimulatedHeads(_HeadExchange):
    """Hybrid CP's collectives for CP rank ``rank`` of ``cp`` in Ulysses groups of ``u``: the
    all-to-all within its Ulysses group and the all-gathers within it and within its ring,
    from ``store`` as :class:`_Simulated` (keyed by the group and the call)."""

    def __init__(self, store: dict, cp: int, rank: int, u: int):
        a, j = divmod(rank, u)
        super().__init__(Group("cp_ulysses", tuple(range(a * u, (a + 1) * u)), j),
                         Group("cp_ring", tuple(range(j, cp, u)), a) if u < cp else None)
        self.store, self.calls = store, 0

    def _slot(self, group):
        slot = self.store.setdefault((group.dim, group.ranks, self.calls), {})
        self.calls += 1
        return slot

    def _read(self, group, local):
        slot = self._slot(group)
        slot[group.index] = local.asnumpy()
        zero = np.zeros_like(slot[group.index])
        return [slot.get(m, zero) for m in range(group.size)]

    def _all_to_all(self, t):
        rows = t.shape[0] // self.size
        got = self._read(self.group, t)
        return Tensor(np.concatenate([g[self.index * rows:(self.index + 1) * rows] for g in got]))

    def _gather_rows(self, t):
        return Tensor(np.concatenate(self._read(self.group, t)))

    def _ring_gather(self, t):
        return Tensor(np.concatenate(self._read(self.ring, t)))


def _install_ulysses(model, ex, heads, seq: int, cp: int) -> None:
    """What apply_context_parallel installs for Ulysses / hybrid CP, with simulated groups:
    the hybrid attention's ``head_exchange`` and whole-group ``kv_exchange``; the mla
    variant's core replaced by the Ulysses core and the model's ``context_chunks``."""
    model.context_chunks = (tuple(ex.chunks), ex.num_chunks)
    for layer in model.model.layers:
        attn = layer.self_attn
        if hasattr(attn, "head_exchange"):
            attn.kv_exchange, attn.head_exchange = ex, heads
        else:
            core = attn.core_attention
            core.__dict__.pop("construct", None)  # the class's, not the previous run's
            object.__setattr__(core, "construct", _UlyssesCore(core, heads, seq, cp))


@pytest.mark.parametrize("variant", ["dsv4_hybrid", "mla"])
def test_simulated_hybrid_cp_ranks_equal_one_process(variant):
    """Hybrid CP (Ulysses in pairs of CP ranks, 2 pairs; the msrun test runs Ulysses over
    2 ranks) with an MTP module, 32 tokens in 8 chunks of 4, each rank through the pipeline
    stage's forward on split_batch's part of the batch. Hybrid attention: the layer
    compressed sparse (ratio 4, one window per chunk, the indexer keeping 4 of up to 8
    entries) and the MTP module sliding-window (8 tokens), each rank's queries of its pair's
    4 chunks and 2 of the 4 heads against the whole sequence's shared keys (all-gathered over
    the 4 ranks) and entries; mla: DeepSeek-V3's Ulysses core, the latent keys by all-to-all
    in the pair and all-gathered over the ring. Each rank's language-model loss share equals
    the one-process per-token losses of its tokens (from the whole model's logits), and the
    shares of the loss and MTP loss add up to the whole model's."""
    from mindtrain.parallel.context_parallel import split_batch
    from mindtrain.parallel.pipeline_stage import ModelStage

    seq, cp, u = 32, 4, 2
    cfg = load_config(TINY, [f"model.seq_length={seq}", f"train_dataset.dataloader.config.seq_length={seq}",
                             "model.num_hidden_layers=1", "model.compress_ratios=[4]", "model.sliding_window=8",
                             "model.index_topk=4", "model.hc_sinkhorn_iters=4", "model.num_nextn_predict_layers=1"]
                      + (MLA if variant == "mla" else [])).model
    model = mm.build_model(cfg, jit=False, seed=3)
    tokens = np.random.default_rng(2).integers(0, cfg.vocab_size, (2, seq + 1)).astype(np.int32)
    batch = {"input_ids": tokens[:, :-1], "labels": tokens[:, 1:]}
    logits = model(Tensor(batch["input_ids"])).asnumpy().astype(np.float64)
    top = logits.max(-1, keepdims=True)
    per_token = (np.log(np.exp(logits - top).sum(-1)) + top[..., 0]
                 - np.take_along_axis(logits, batch["labels"][..., None], -1)[..., 0])
    loss, metrics = model(Tensor(batch["input_ids"]), labels=Tensor(batch["labels"]))
    whole = {"loss": loss, **metrics}
    plan = mm.parallel_plan(model)
    stage = ModelStage(model, plan, [u_["name"] for u_ in plan["units"]])
    store, got, rounds = {}, None, 0
    while rounds < 16:
        rounds += 1
        prev, got = got, {}
        for r in range(cp):
            ex, heads = _Simulated(store, cp, r, seq), _SimulatedHeads(store, cp, r, u)
            _install_ulysses(model, ex, heads, seq, cp)
            mb = split_batch(batch, cp, r, cfg.num_attention_heads, 1, inputs=model.whole_sequence_inputs)
            got[r] = stage.forward(None, mb)[2].asnumpy()
        if prev is not None and all(np.array_equal(prev[r], got[r]) for r in range(cp)):
            break
    # per layer (with dropout off, no keep mask): the queries, the mask rows and the output;
    # the mla core also its keys and values, to the pair and then over the ring
    assert heads.calls == 2 * (7 if variant == "mla" else 3) and rounds < 16, (heads.calls, rounds)
    for r in range(cp):
        idx = chunk_indices(seq, cp, r)
        np.testing.assert_allclose(got[r][STEP_FIGURES.index("lm_loss")], per_token[:, idx].sum() / per_token.size,
                                   rtol=2e-5, err_msg=f"rank {r}")
    shares = sum(got.values())
    for name in ("loss", "mtp_loss"):
        np.testing.assert_allclose(shares[STEP_FIGURES.index(name)], float(whole[name].asnumpy()), rtol=2e-6,
                                   err_msg=name)
    assert float(whole["mtp_loss"].asnumpy()) > 1.0


def test_config_rules():
    """Every CP method is built (each chunk a whole number of windows of every compress ratio
    in the hybrid attention), with the MTP modules and for the mla variant (no compressed
    windows: any chunk length); Ulysses needs its degree to divide the query heads per TP
    rank (the one shared key/value head is all-gathered, not split). Errors name the field."""
    from mindtrain.config import ConfigError
    from mindtrain.config.schema import ParallelismConfig
    from mindtrain.config.validate import validate_parallelism

    m = load_config(TINY).model  # seq 256, ratios 4 and 16, 4 query heads, one key/value head
    validate_parallelism(ParallelismConfig(context_parallel=2), m)
    validate_parallelism(ParallelismConfig(context_parallel=8), m)  # chunks of 16 tokens
    with_mtp = load_config(TINY, ["model.num_nextn_predict_layers=1"]).model
    validate_parallelism(ParallelismConfig(context_parallel=2), with_mtp)
    mla = load_config(TINY, MLA + ["model.num_nextn_predict_layers=1"]).model
    validate_parallelism(ParallelismConfig(context_parallel=16), mla)  # chunks of 8 tokens
    for model in (with_mtp, mla):
        validate_parallelism(ParallelismConfig(context_parallel=4, context_parallel_method="ulysses"), model)
        validate_parallelism(ParallelismConfig(context_parallel=8, context_parallel_method="hybrid",
                                               ulysses_degree_in_cp=4), model)
        validate_parallelism(ParallelismConfig(context_parallel=2, tensor_parallel=2,
                                               context_parallel_method="ulysses"), model)
    with pytest.raises(ConfigError) as err:
        validate_parallelism(ParallelismConfig(context_parallel=16), m)
    assert str(err.value).startswith("parallelism.context_parallel: 16: DeepSeek-V4 needs each of the 2 x "
                                     "context_parallel chunks (seq_length / 32 = 8 tokens)")
    with pytest.raises(ConfigError) as err:  # the compressors still pool each rank's own chunks
        validate_parallelism(ParallelismConfig(context_parallel=16, context_parallel_method="ulysses"), m)
    assert str(err.value).startswith("parallelism.context_parallel: 16: DeepSeek-V4 needs each of the 2 x ")
    for model in (m, mla):  # 4 query heads per TP rank over 8 Ulysses ranks; 2 over 4
        for p in (ParallelismConfig(context_parallel=8, context_parallel_method="ulysses"),
                  ParallelismConfig(context_parallel=8, tensor_parallel=2, context_parallel_method="hybrid",
                                    ulysses_degree_in_cp=4)):
            with pytest.raises(ConfigError) as err:
                validate_parallelism(p, model)
            assert str(err.value).startswith(f"parallelism.context_parallel: {p.ulysses_degree_in_cp or 8} Ulysses "
                                             f"ranks must divide the num_attention_heads each tensor-parallel rank")
