"""A small transformer-like language model for the FSDP tests, plus a numpy AdamW.

Blocks take (x, mask) and return (x, aux) like an MoE layer with an auxiliary loss; each
block also uses the root parameter ``gate_scale`` (a weight shared across units).
"""

import numpy as np

import mindspore as ms
from mindspore import Parameter, Tensor, mint, nn, ops

V, D, H, S, FF = 64, 32, 4, 8, 64


def _rms(x, g):
    return x * mint.rsqrt((x * x).mean(-1, keep_dims=True) + 1e-6) * g


def _lin(x, w):
    return mint.matmul(x, w.T)


class Block(nn.Cell):
    def __init__(self, rng, shared):
        super().__init__()
        init = lambda *shape: Parameter(Tensor((rng.randn(*shape) * 0.2).astype(np.float32)))
        self.attn_norm = Parameter(Tensor(np.ones(D, np.float32)))
        self.wq, self.wk, self.wv, self.wo = init(D, D), init(D, D), init(D, D), init(D, D)
        self.mlp_norm = Parameter(Tensor(np.ones(D, np.float32)))
        self.w1, self.w2 = init(FF, D), init(D, FF)
        self.b1 = Parameter(Tensor(np.zeros(FF, np.float32)))
        self._shared = shared  # [gate_scale]; a list keeps it out of this Cell's parameters

    def construct(self, x, mask):
        b = x.shape[0]
        h = _rms(x, self.attn_norm)
        q = _lin(h, self.wq).reshape(b, S, H, D // H).transpose(0, 2, 1, 3)
        k = _lin(h, self.wk).reshape(b, S, H, D // H).transpose(0, 2, 1, 3)
        v = _lin(h, self.wv).reshape(b, S, H, D // H).transpose(0, 2, 1, 3)
        att = ops.softmax(mint.matmul(q, k.transpose(0, 1, 3, 2)) * (D // H) ** -0.5 + mask, -1)
        o = mint.matmul(att, v).transpose(0, 2, 1, 3).reshape(b, S, D)
        x = x + _lin(o, self.wo) * self._shared[0]
        h = _rms(x, self.mlp_norm)
        x = x + _lin(ops.silu(_lin(h, self.w1) + self.b1), self.w2)
        return x, (x * x).mean() * 0.01


class TinyLM(nn.Cell):
    def __init__(self, seed=0, layers=2):
        super().__init__()
        rng = np.random.RandomState(seed)
        self.embed = Parameter(Tensor((rng.randn(V, D) * 0.5).astype(np.float32)))
        self.gate_scale = Parameter(Tensor(np.ones(D, np.float32)))
        self.blocks = nn.CellList([Block(rng, [self.gate_scale]) for _ in range(layers)])
        self.norm = Parameter(Tensor(np.ones(D, np.float32)))
        self.head = Parameter(Tensor((rng.randn(V, D) * 0.2).astype(np.float32)))
        self.mask = Tensor(np.triu(np.full((S, S), -1e9, np.float32), 1))

    def construct(self, ids, labels):
        x = self.embed[ids]
        aux = 0.0
        for blk in self.blocks:
            x, a = blk(x, self.mask)
            aux = aux + a
        logits = _lin(_rms(x, self.norm), self.head)
        return ops.cross_entropy(logits.reshape(-1, V), labels.reshape(-1)) + aux


UNITS = ["blocks.0", "blocks.1"]
SHARED = {"gate_scale": UNITS}


class AdamW:
    """torch.optim.AdamW's update in numpy over named parameters, written with set_data."""

    def __init__(self, named, lr=1e-2, betas=(0.9, 0.95), eps=1e-8, wd=0.1):
        self.named = list(named)
        self.lr, (self.b1, self.b2), self.eps, self.wd = lr, betas, eps, wd
        self.m = [np.zeros(p.shape, np.float32) for _, p in self.named]
        self.v = [np.zeros(p.shape, np.float32) for _, p in self.named]
        self.t = 0

    def step(self, grads):
        self.t += 1
        bc1, bc2 = 1 - self.b1 ** self.t, 1 - self.b2 ** self.t
        for i, ((name, p), g) in enumerate(zip(self.named, grads)):
            g = g.asnumpy()
            w = p.asnumpy()
            decay = 0.0 if "norm" in name or len(p.shape) < 2 else self.wd
            w = w * np.float32(1 - self.lr * decay)
            self.m[i] = self.b1 * self.m[i] + (1 - self.b1) * g
            self.v[i] = self.b2 * self.v[i] + (1 - self.b2) * g * g
            w = w - self.lr * (self.m[i] / bc1) / (np.sqrt(self.v[i] / bc2) + self.eps)
            p.set_data(Tensor(w.astype(np.float32)))

    def state_bytes(self):
        return sum(a.nbytes for a in self.m + self.v)


def batch(step, size=8):
    rng = np.random.RandomState(100 + step)
    ids = rng.randint(0, V, (size, S + 1))
    return ids[:, :-1].astype(np.int32), ids[:, 1:].astype(np.int32)
