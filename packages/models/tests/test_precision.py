"""Mixed precision: fp32 master weights and float32 islands around float16/bfloat16 matmuls."""

import mindspore as ms
import numpy as np
import pytest
from mindspore import Tensor, ops

import mindtrain.models as mm
from mindtrain.config import ConfigError, ModelConfig

CFG = dict(vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=2,
           num_attention_heads=2, num_key_value_heads=2, n_routed_experts=4, n_group=2, topk_group=1,
           num_experts_per_tok=2, first_k_dense_replace=1, kv_lora_rank=8, q_lora_rank=16, qk_rope_head_dim=4,
           qk_nope_head_dim=8, v_head_dim=8, seq_length=16, max_position_embeddings=64,
           num_nextn_predict_layers=1)
# float16 gradients of the smallest parameters (1e-6 here) underflow without loss scaling,
# exactly as in fp16 training; the comparison uses a static loss scale like a trainer would
LOSS_SCALE = 1024.0
# float16 has a unit roundoff of 2**-11 = 4.9e-4. Measured on this model: logits 1.8e-4
# (|logits| <= 0.41, about one float16 ulp), losses <= 1.9e-6, gradients <= 8.6e-3 relative
# (per tensor, several float16 roundings in the backward); the bounds leave 2-50x headroom
LOGITS_ATOL = 1e-3
LOSS_ATOL = 1e-4
GRAD_RTOL = 2e-2   # per tensor, relative L2 norm


def _batch():
    rng = np.random.RandomState(0)
    ids = Tensor(rng.randint(0, 64, (2, 16)).astype(np.int32))
    labels = Tensor(rng.randint(0, 64, (2, 16)).astype(np.int32))
    return ids, labels, Tensor(np.ones((2, 16), np.float32))


def _run(compute_dtype, jit):
    ms.set_seed(0)
    model = mm.build_model(ModelConfig(**CFG), jit=jit, compute_dtype=compute_dtype)
    ids, labels, mask = _batch()
    logits = model(ids)
    params = model.trainable_params()

    def fn(ids, labels, mask):
        loss, metrics = model(ids, labels=labels, loss_mask=mask)
        return loss * LOSS_SCALE, metrics

    (loss, metrics), grads = ms.value_and_grad(fn, None, params, has_aux=True)(ids, labels, mask)
    return model, logits, float(loss.asnumpy()) / LOSS_SCALE, metrics, grads


@pytest.fixture(scope="module")
def float32_run():
    # the float32 jit path is bit-identical to eager (test_hf_parity), so eager is the reference
    return _run("float32", False)


@pytest.mark.parametrize("jit", [True, False], ids=["jit", "eager"])
def test_float16_compute_close_to_float32(jit, float32_run):
    ref_model, ref_logits, ref_loss, ref_metrics, ref_grads = float32_run
    model, logits, loss, metrics, grads = _run("float16", jit)
    assert (ref_model.compute_dtype, model.compute_dtype) == ("float32", "float16")
    assert {p.dtype for p in model.get_parameters()} == {ms.float32}        # master weights
    assert {g.dtype for g in grads} == {ms.float32}
    assert logits.dtype == ms.float32

    diff = np.abs(logits.asnumpy() - ref_logits.asnumpy()).max()
    assert 0 < diff < LOGITS_ATOL   # > 0: the matmuls really ran in float16
    assert abs(loss - ref_loss) < LOSS_ATOL
    for key in ("lm_loss", "mtp_loss", "load_balancing_loss"):
        assert abs(float(metrics[key].asnumpy()) - float(ref_metrics[key].asnumpy())) < LOSS_ATOL, key
    for p, g, r in zip(model.trainable_params(), grads, ref_grads):
        g, r = g.asnumpy() / LOSS_SCALE, r.asnumpy() / LOSS_SCALE
        assert np.linalg.norm(g - r) <= GRAD_RTOL * np.linalg.norm(r), p.name


def test_effective_compute_dtype():
    used, note = mm.effective_compute_dtype("bfloat16", "CPU")
    assert used == "float32" and "MatMul" in note and "\n" not in note
    assert mm.effective_compute_dtype("float16", "CPU") == ("float16", None)
    assert mm.effective_compute_dtype("float32", "CPU") == ("float32", None)
    assert mm.effective_compute_dtype("bfloat16", "Ascend") == ("bfloat16", None)
    with pytest.raises(ConfigError, match="model.compute_dtype"):
        mm.effective_compute_dtype("float8", "CPU")


def test_bfloat16_on_cpu_falls_back_from_config_and_fails_when_forced():
    cfg = ModelConfig(**CFG)
    assert cfg.compute_dtype == "bfloat16"                 # the schema default
    assert mm.build_model(cfg, jit=False).compute_dtype == "float32"
    with pytest.raises(ConfigError, match="model.compute_dtype: bfloat16 compute cannot run on CPU.*MatMul"):
        mm.build_model(cfg, compute_dtype="bfloat16")
    # what the error guards against: MindSpore itself rejects a bf16 matmul on CPU
    a = Tensor(np.ones((4, 4), np.float32)).astype(ms.bfloat16)
    with pytest.raises(TypeError, match="MatMul"):
        ops.MatMul()(a, a).asnumpy()


def test_low_precision_weights_are_float32_on_cpu_and_refused_elsewhere():
    """MindFormers' params_dtype: bfloat16 (its DeepSeek-V3 configs): float32 weights on CPU,
    said once; on a device where it would mean bf16 weights with fp32 master weights (not
    built) a one-line ConfigError."""
    from mindtrain.models.precision import effective_param_dtype

    model = mm.build_model(ModelConfig(**dict(CFG, param_init_dtype="bfloat16")), jit=False)
    assert {p.dtype for p in model.trainable_params()} == {ms.float32}
    dtype, note = effective_param_dtype("bfloat16", "CPU")
    assert dtype == "float32" and note.startswith("model.param_init_dtype=bfloat16 (MindFormers' params_dtype) "
                                                  "runs as float32 weights on CPU")
    assert effective_param_dtype("float32", "CPU") == ("float32", None)
    with pytest.raises(ConfigError, match=r"^model\.param_init_dtype: float16 weights .* are not built for Ascend"):
        effective_param_dtype("float16", "Ascend")
