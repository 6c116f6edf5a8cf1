"""TP / EP layout errors: one-line ConfigErrors naming the field, raised before any change.

The training-parity proof (msrun, tiny DeepSeek-V3) is integration_tests/test_tp_ep_parity.py.
"""

import numpy as np
import pytest

import mindspore as ms
from mindspore import Parameter, Tensor, nn

from mindtrain.config import ConfigError, ParallelDims, UserError
from mindtrain.parallel import DeviceMesh
from mindtrain.parallel.expert_parallel import apply_expert_parallel
from mindtrain.parallel.tensor_parallel import apply_tensor_parallel, param_bytes


class _Emb(nn.Cell):
    def __init__(self, v, h):
        super().__init__()
        self.weight = Parameter(Tensor(np.arange(v * h, dtype=np.float32).reshape(v, h)), name="weight")


class _Lin(nn.Cell):
    def __init__(self, o, i):
        super().__init__()
        self.out_features = o
        self.weight = Parameter(Tensor(np.ones((o, i), np.float32)), name="weight")


class _Attn(nn.Cell):
    def __init__(self, heads):
        super().__init__()
        self.num_heads = heads
        self.q_b_proj = _Lin(heads * 4, 8)
        self.o_proj = _Lin(8, heads * 4)


class _Inner(nn.Cell):
    def __init__(self, vocab, heads):
        super().__init__()
        self.embed_tokens = _Emb(vocab, 8)
        self.attn = _Attn(heads)


class _Model(nn.Cell):
    def __init__(self, vocab=6, heads=2):
        super().__init__()
        self.model = _Inner(vocab, heads)


def _plan(model, heads, experts=None):
    styles = {"model.embed_tokens.weight": ("vocab", 0), "model.attn.q_b_proj.weight": ("column", 0),
              "model.attn.o_proj.weight": ("row", 1)}
    params = {}
    for p in model.get_parameters():
        style, dim = styles[p.name]
        params[p.name] = {"shape": tuple(p.shape), "tp": style, "tp_dim": dim, "expert": False,
                          "expert_dim": None, "num_experts": None, "trainable": True, "unit": "x"}
    return {"params": params, "units": [], "shared": {}, "num_attention_heads": heads,
            "num_experts": experts}


def _mesh(tp=1, dp=1, ep=1):
    return DeviceMesh(ParallelDims(world_size=tp * dp, pp=1, dp_shard=dp, cp=1, tp=tp, ep=ep), 0)


@pytest.mark.parametrize("vocab,heads,field", [(6, 3, "model.num_attention_heads"),
                                               (5, 2, "model.vocab_size")])
def test_indivisible_sizes_raise_one_line_config_error_before_sharding(vocab, heads, field):
    model = _Model(vocab, heads)
    before = param_bytes(model)
    with pytest.raises(ConfigError) as err:
        apply_tensor_parallel(model, _plan(model, heads), _mesh(tp=2))
    msg = str(err.value)
    assert msg.startswith(field + ":") and "tensor_parallel=2" in msg and "\n" not in msg
    assert isinstance(err.value, UserError)
    assert param_bytes(model) == before  # nothing was sharded


def test_sharding_follows_the_plan_and_sequence_must_divide():
    ms.set_device("CPU")
    ms.runtime.launch_blocking()  # eager ops in the calling thread, as the trainer runs them on CPU
    model = _Model(6, 2)
    full = model.model.embed_tokens.weight.asnumpy().copy()
    tp = apply_tensor_parallel(model, _plan(model, 2), _mesh(tp=2))
    assert tp.size == 2 and tp.replicated == set()
    np.testing.assert_array_equal(model.model.embed_tokens.weight.asnumpy(), full[:3])
    assert model.model.attn.num_heads == 1
    assert model.model.attn.q_b_proj.out_features == 4
    assert tuple(model.model.attn.o_proj.weight.shape) == (8, 4)
    with pytest.raises(ConfigError, match=r"^model\.seq_length: 3 is not divisible by parallelism\.tensor_parallel=2"):
        model.model.embed_tokens(Tensor(np.zeros((1, 3), np.int32)))


def test_tensor_parallel_of_one_changes_nothing():
    model = _Model(5, 3)
    before = {p.name: p.asnumpy().copy() for p in model.get_parameters()}
    tp = apply_tensor_parallel(model, _plan(model, 3), _mesh(tp=1))
    assert tp.size == 1
    for p in model.get_parameters():
        np.testing.assert_array_equal(p.asnumpy(), before[p.name])


def test_expert_parallel_errors():
    model = _Model()
    with pytest.raises(ConfigError, match=r"^model\.n_routed_experts: 3 is not divisible by "
                                          r"parallelism\.expert_parallel=2"):
        apply_expert_parallel(model, _plan(model, 2, experts=3), _mesh(dp=2, ep=2))
