"""Record every dropout mask each rank draws in a few Qwen3-MoE training steps and compare
them with one process's, element by element (issue 34: is a layout's difference a mask
difference or round-off?).

    python benchmarks/probe_dropout_masks.py record OUT ref DATA_PREFIX
    msrun --worker_num=2 ... benchmarks/probe_dropout_masks.py record OUT tp2 DATA_PREFIX parallelism.tensor_parallel=2
    python benchmarks/probe_dropout_masks.py compare OUT tp2 [cp2 ...]

Each mask row is keyed by (kind, step, layer, site, token identity); attention rows are
compared on the rank's global heads (``head_offset``)."""

from __future__ import annotations

import glob
import os
import pickle
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def record(out: str, case: str, prefix: str, extra: list) -> None:
    from mindtrain.config import load_config
    from mindtrain.models import dropout as D
    from mindtrain.trainer.runtime import start
    from mindtrain.trainer.trainer import Trainer

    rec = []
    hidden, attention = D.Dropout.hidden_mask, D.Dropout.attention_mask

    def hidden_mask(self, layer, site, shape):
        m = hidden(self, layer, site, shape)
        rec.append(("h", self.step, layer, site, self._rows(shape[1]).copy(), 0, m.asnumpy()))
        return m

    def attention_mask(self, layer, heads, head_offset, keys):
        m = attention(self, layer, heads, head_offset, keys)
        rec.append(("a", self.step, layer, 0, self.tokens.copy(), head_offset, m.asnumpy()))
        return m

    D.Dropout.hidden_mask, D.Dropout.attention_mask = hidden_mask, attention_mask
    cfg = load_config(os.path.join(ROOT, "configs", "pynative_qwen3_moe_tiny.yaml"), [
        "training.steps=2", "training.global_batch_size=4", "model.seq_length=32",
        "train_dataset.dataloader.config.seq_length=32", f"train_dataset.dataloader.config.data_path=['1', '{prefix}']",
        "model.attention_dropout=0.1", "model.hidden_dropout=0.1", f"monitor.metrics_dir={out}/{case}", *extra])
    rt, _ = start("CPU")
    rows = Trainer(cfg, rt, out=lambda _line: None).train()
    with open(os.path.join(out, f"{case}.{rt.rank}.pkl"), "wb") as f:
        pickle.dump({"rec": rec, "rows": rows}, f)


def _row(kind, m, b, t):
    return m[b, t] if kind == "h" else m[b, :, t]


def compare(out: str, cases: list) -> None:
    table = {}
    for kind, step, layer, site, tok, _, m in pickle.load(open(os.path.join(out, "ref.0.pkl"), "rb"))["rec"]:
        for b, t in np.ndindex(*tok.shape):
            table[(kind, step, layer, site, int(tok[b, t]))] = _row(kind, m, b, t)
    for case in cases:
        n = bad = 0
        for path in sorted(glob.glob(os.path.join(out, f"{case}.*.pkl"))):
            for kind, step, layer, site, tok, off, m in pickle.load(open(path, "rb"))["rec"]:
                for b, t in np.ndindex(*tok.shape):
                    got = _row(kind, m, b, t)
                    want = table[(kind, step, layer, site, int(tok[b, t]))]
                    want = want[off:off + got.shape[0]] if kind == "a" else want
                    n += got.size
                    bad += int((got != want).sum())
        print(f"{case}: {n} mask elements compared with one process's, {bad} differ")


if __name__ == "__main__":
    if sys.argv[1] == "record":
        record(sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5:])
    else:
        compare(sys.argv[2], sys.argv[3:])
