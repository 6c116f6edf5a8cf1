"""Manifold-constrained hyper-connections (mHC; HF DeepseekV4HyperConnection /
DeepseekV4HyperHead): the residual is ``hc_mult`` streams [B, S, N, H]; before each block
they are collapsed (``pre`` weights), the block's output is spread back (``post``) and the
streams are mixed by a doubly stochastic matrix (``comb``, Sinkhorn-Knopp), all three
computed per token from the normed streams."""

from __future__ import annotations

from mindspore import nn, ops

from mindtrain.models.weights import Init, new_weight


def _norm(x, eps: float):
    return x * ops.rsqrt(ops.mean(ops.square(x), -1, keep_dims=True) + eps)


class HyperConnection(nn.Cell):
    """``fn [(2 + N) N, N H]``, ``base [(2 + N) N]``, ``scale [3]``. ``construct(streams
    [B,S,N,H])`` -> (post [B,S,N], comb [B,S,N,N], collapsed [B,S,H])."""

    def __init__(self, cfg):
        super().__init__()
        n, h = cfg.hc_mult, cfg.hidden_size
        self.n, self.iters = n, int(cfg.hc_sinkhorn_iters)
        self.eps, self.norm_eps = float(cfg.hc_eps), float(cfg.rms_norm_eps)
        self.fn = new_weight(((2 + n) * n, n * h), Init("normal", cfg.initializer_range), "fn")
        self.base = new_weight(((2 + n) * n,), Init("zeros"), "base")
        self.scale = new_weight((3,), Init("ones"), "scale")
        self.matmul_t = ops.MatMul(transpose_b=True)

    def construct(self, streams):
        b, s, n, h = streams.shape
        flat = _norm(streams.reshape(b * s, n * h), self.norm_eps)
        mix = self.matmul_t(flat, self.fn)                                   # [BS, (2+N)N]
        scale, base = self.scale, self.base
        pre = ops.sigmoid(mix[:, :n] * scale[0] + base[:n]) + self.eps
        post = 2 * ops.sigmoid(mix[:, n:2 * n] * scale[1] + base[n:2 * n])
        comb = mix[:, 2 * n:].reshape(b * s, n, n) * scale[2] + base[2 * n:].reshape(1, n, n)
        comb = ops.softmax(comb, -1) + self.eps
        comb = comb / (comb.sum(-2, keepdims=True) + self.eps)
        for _ in range(self.iters - 1):
            comb = comb / (comb.sum(-1, keepdims=True) + self.eps)
            comb = comb / (comb.sum(-2, keepdims=True) + self.eps)
        collapsed = (ops.expand_dims(pre, -1) * streams.reshape(b * s, n, h)).sum(1)
        return post, comb, collapsed.reshape(b, s, h)


def hyper_update(streams, post, comb, out):
    """``post * out + comb^T @ streams``: the block output ``out`` [B,S,H] spread over the
    streams plus the streams mixed (HF: comb consumed transposed)."""
    b, s, n, h = streams.shape
    mixed = ops.BatchMatMul(transpose_a=True)(comb, streams.reshape(b * s, n, h))
    spread = ops.expand_dims(post, -1) * out.reshape(b * s, 1, h)
    return (spread + mixed).reshape(b, s, n, h)


class HyperHead(nn.Cell):
    """The final collapse of the streams before the norm: ``hc_fn [N, N H]``, ``hc_base [N]``,
    ``hc_scale [1]``. ``construct(streams [B,S,N,H])`` -> [B,S,H]."""

    def __init__(self, cfg):
        super().__init__()
        n, h = cfg.hc_mult, cfg.hidden_size
        self.eps, self.norm_eps = float(cfg.hc_eps), float(cfg.rms_norm_eps)
        self.hc_fn = new_weight((n, n * h), Init("normal", cfg.initializer_range), "hc_fn")
        self.hc_base = new_weight((n,), Init("zeros"), "hc_base")
        self.hc_scale = new_weight((1,), Init("ones"), "hc_scale")
        self.matmul_t = ops.MatMul(transpose_b=True)

    def construct(self, streams):
        b, s, n, h = streams.shape
        flat = _norm(streams.reshape(b * s, n * h), self.norm_eps)
        pre = ops.sigmoid(self.matmul_t(flat, self.hc_fn) * self.hc_scale + self.hc_base) + self.eps
        return (ops.expand_dims(pre, -1) * streams.reshape(b * s, n, h)).sum(1).reshape(b, s, h)


def plain_residual(layer, streams, ids, attention, dropout):
    """A decoder layer without hyper-connection streams (``enable_hyper_connections: false``,
    MindFormers' ``TransformerLayer``): ``h + attention(input_layernorm(h))``, then ``h +
    mlp(post_attention_layernorm(h))``, ``streams`` being the one residual [B,S,H];
    ``attention(x)`` the layer's attention of the normed input, ``dropout(out, kind)`` its
    hidden dropout. Returns (h, tokens per expert, balance) as the layer does."""
    h = streams + dropout(attention(layer.input_layernorm(streams)), 0)
    y, counts, balance = layer.mlp(layer.post_attention_layernorm(h), ids)
    return h + dropout(y, 1), counts, balance


class StreamMean(nn.Cell):
    """The streams' collapse without a learned head (``enable_hc_head: false``): their mean,
    as MindFormers' ``collapse_hyper_connection_streams``. No parameters.
    ``construct(streams [B,S,N,H])`` -> [B,S,H]."""

    def construct(self, streams):
        return streams.mean(2)
