"""mindtrain-data vs Megatron-Core 0.16, side by side on one synthetic corpus.

    hatch run python benchmarks/bench_data.py                       # 50M tokens, 1M samples
    hatch run python benchmarks/bench_data.py --tokens 5000000 --samples 100000

Megatron runs in its own venv (default /tmp/megvenv, see tools/make_megatron_fixtures.py)
as a subprocess; each side builds the GPT indices into a fresh cache, reloads them from the
cache, and reads random samples with three flag sets. Preprocessing compares our
``preprocess`` with Megatron-LM's preprocess_data.py loop (json.loads -> tokenize -> append
eod -> IndexedDatasetBuilder.add_document over a multiprocessing Pool with chunks of 32),
re-created on megatron.core's builder because megatron-core does not ship that script;
both use the same byte-level tokenizer and worker count (and must write identical files).
The sides alternate over ``--rounds`` rounds and each side's best figure counts. Prints a
markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

SEQ_DEFAULT = 4096
VARIANTS = {
    "defaults": dict(eod_mask_loss=False, reset_position_ids=False, reset_attention_mask=False,
                     create_attention_mask=False),
    "reset_position_ids+eod_mask_loss": dict(eod_mask_loss=True, reset_position_ids=True,
                                             reset_attention_mask=False, create_attention_mask=False),
    "all flags + attention mask": dict(eod_mask_loss=True, reset_position_ids=True,
                                       reset_attention_mask=True, create_attention_mask=True),
}


def make_corpus(prefix: str, tokens: int, seed: int = 0) -> int:
    """Documents of log-normal length (median ~600 tokens) ending in eod=1; uint16 ids."""
    from mindtrain.data import IndexedDatasetBuilder
    rng = np.random.RandomState(seed)
    lengths = []
    total = 0
    while total < tokens:
        n = int(min(max(rng.lognormal(6.4, 1.0), 2), 20000))
        n = min(n, tokens - total) if tokens - total > 1 else 2
        lengths.append(n)
        total += n
    flat = rng.randint(3, 50000, size=total).astype(np.uint16)
    ends = np.cumsum(lengths) - 1
    flat[ends] = 1
    b = IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    start = 0
    for n in lengths:
        b.add_document(flat[start:start + n], [n])
        start += n
    b.finalize(prefix + ".idx")
    return len(lengths)


def make_jsonl(path: str, docs: int, seed: int = 1) -> None:
    rng = np.random.RandomState(seed)
    words = ["the", "data", "pipeline", "tokens", "model", "déjà", "vu", "零", "sample", "index"]
    with open(path, "w", encoding="utf-8") as f:
        for _ in range(docs):
            f.write(json.dumps({"text": " ".join(rng.choice(words, rng.randint(20, 400)))}) + "\n")


# --------------------------------------------------------------------------- ours
def run_ours(prefix, cache, samples, seq, reads, mask_reads, seed):
    from mindtrain.data import build_dataset

    def section(flags):
        return {"dataloader": {"type": "BlendedMegatronDatasetDataLoader", "datasets_type": "GPTDataset",
                               "sizes": [samples, 0, 0],
                               "column_names": ["input_ids", "labels", "loss_mask", "position_ids"]
                               + (["attention_mask"] if flags["create_attention_mask"] else []),
                               "config": dict(seed=1234, seq_length=seq, split="1, 0, 0", eod=1, pad=-1,
                                              data_path=[prefix], path_to_cache=cache, **flags)}}
    out = {}
    t = time.perf_counter()
    ds = build_dataset(section(VARIANTS["defaults"]))
    out["index_build_s"] = time.perf_counter() - t
    t = time.perf_counter()
    ds = build_dataset(section(VARIANTS["defaults"]))
    out["cache_reload_s"] = time.perf_counter() - t
    assert not ds.built_indices
    out["num_samples"] = len(ds)
    for name, flags in VARIANTS.items():
        ds = build_dataset(section(flags))
        n = mask_reads if flags["create_attention_mask"] else reads
        idx = np.random.RandomState(seed).randint(0, len(ds), n)
        ds[int(idx[0])]
        t = time.perf_counter()
        for i in idx:
            ds[int(i)]
        out[f"reads/s {name}"] = n / (time.perf_counter() - t)
    return out


def preprocess_ours(jsonl, prefix, workers):
    from mindtrain.data import ByteTokenizer, preprocess
    s = preprocess(jsonl, prefix, ByteTokenizer(), append_eod=True, workers=workers)
    return {"tokens": s["tokens"], "seconds": s["seconds"]}


# --------------------------------------------------------------------------- megatron (runs in its venv)
MEGATRON_SIDE = r'''
import json, sys, time, os, multiprocessing
import numpy as np
args = json.loads(sys.argv[1])
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
from megatron.core.datasets import indexed_dataset
from collections import OrderedDict

class Tok:
    vocab_size, eod = 259, 1
    unique_identifiers = OrderedDict(cls="bench")
    def tokenize(self, text):
        return (np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int32) + 3).tolist()

def build(flags):
    cfg = GPTDatasetConfig(random_seed=1234, sequence_length=args["seq"], blend=([args["prefix"]], None),
                           split="1,0,0", path_to_cache=args["cache"], tokenizer=Tok(), **flags)
    return BlendedMegatronDatasetBuilder(GPTDataset, [args["samples"], 0, 0], lambda: True, cfg).build()[0]

def encode(line):
    text = json.loads(line)["text"]
    ids = Tok().tokenize(text)
    if ids:
        ids.append(1)
    return ids, [len(ids)] if ids else [], len(line)

out = {}
if args["mode"] == "dataset":
    import torch
    t = time.perf_counter(); ds = build(args["variants"]["defaults"]); out["index_build_s"] = time.perf_counter() - t
    t = time.perf_counter(); ds = build(args["variants"]["defaults"]); out["cache_reload_s"] = time.perf_counter() - t
    out["num_samples"] = len(ds)
    for name, flags in args["variants"].items():
        ds = build(flags)
        n = args["mask_reads"] if flags["create_attention_mask"] else args["reads"]
        idx = np.random.RandomState(args["seed"]).randint(0, len(ds), n)
        ds[int(idx[0])]
        t = time.perf_counter()
        for i in idx:
            ds[int(i)]
        out["reads/s " + name] = n / (time.perf_counter() - t)
else:
    t = time.perf_counter()
    builder = indexed_dataset.IndexedDatasetBuilder(args["out"] + ".bin", dtype=np.uint16)
    tokens = 0
    with open(args["jsonl"], encoding="utf-8") as fin, multiprocessing.Pool(args["workers"]) as pool:
        for ids, lens, _ in pool.imap(encode, fin, 32):
            builder.add_document(ids, lens)
            tokens += len(ids)
    builder.finalize(args["out"] + ".idx")
    out = {"tokens": tokens, "seconds": time.perf_counter() - t}
print("RESULT" + json.dumps(out))
'''


def run_megatron(python, **args):
    r = subprocess.run([python, "-c", MEGATRON_SIDE, json.dumps(dict(args, variants=VARIANTS))],
                       capture_output=True, text=True)
    for line in r.stdout.splitlines():
        if line.startswith("RESULT"):
            return json.loads(line[6:])
    raise RuntimeError(f"Megatron side failed:\n{r.stderr[-3000:]}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=50_000_000)
    ap.add_argument("--samples", type=int, default=1_000_000)
    ap.add_argument("--seq-length", type=int, default=SEQ_DEFAULT)
    ap.add_argument("--reads", type=int, default=5000)
    ap.add_argument("--mask-reads", type=int, default=40)
    ap.add_argument("--preprocess-docs", type=int, default=40000)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--megatron-python", default="/tmp/megvenv/bin/python")
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds; best of each side counts")
    args = ap.parse_args()
    work = args.workdir or tempfile.mkdtemp(prefix="bench-data-")
    prefix = os.path.join(work, "corpus_text_document")
    t = time.perf_counter()
    docs = make_corpus(prefix, args.tokens)
    print(f"corpus: {args.tokens} tokens, {docs} documents, uint16 ({time.perf_counter() - t:.1f}s to write)", flush=True)
    common = dict(prefix=prefix, samples=args.samples, seq=args.seq_length, reads=args.reads,
                  mask_reads=args.mask_reads, seed=0)
    jsonl = os.path.join(work, "docs.jsonl")
    make_jsonl(jsonl, args.preprocess_docs)
    # Rounds alternate the two sides; the best figure of each side counts, which keeps the
    # comparison fair on a shared, noisy machine.
    meg, ours, p_meg, p_ours = {}, {}, None, None
    for r in range(args.rounds):
        m = run_megatron(args.megatron_python, mode="dataset", cache=os.path.join(work, f"cache_megatron{r}"), **common)
        o = run_ours(prefix, os.path.join(work, f"cache_ours{r}"), args.samples, args.seq_length, args.reads,
                     args.mask_reads, 0)
        assert o["num_samples"] == m["num_samples"], (o["num_samples"], m["num_samples"])
        for best, new in ((meg, m), (ours, o)):
            for k, v in new.items():
                better = min if k.endswith("_s") else max
                best[k] = better(best[k], v) if k in best else v
        pm = run_megatron(args.megatron_python, mode="preprocess", jsonl=jsonl, out=os.path.join(work, f"pp_meg{r}"),
                          workers=args.workers)
        po = preprocess_ours(jsonl, os.path.join(work, f"pp_ours{r}"), args.workers)
        assert po["tokens"] == pm["tokens"]
        with open(os.path.join(work, f"pp_meg{r}.bin"), "rb") as a, \
                open(os.path.join(work, f"pp_ours{r}_text_document.bin"), "rb") as b:
            assert a.read() == b.read(), "preprocessing outputs differ"
        p_meg = pm if p_meg is None or pm["seconds"] < p_meg["seconds"] else p_meg
        p_ours = po if p_ours is None or po["seconds"] < p_ours["seconds"] else p_ours
        print(f"round {r + 1}/{args.rounds} done", flush=True)

    print(f"\n{args.tokens / 1e6:g}M tokens, seq_length {args.seq_length}, {ours['num_samples']} samples; "
          f"{args.workers} preprocessing workers; best of {args.rounds} alternating rounds\n")
    print("| measure | mindtrain-data | Megatron-Core 0.16.1 | ratio (higher = ours better) |")
    print("|---|---|---|---|")
    for key in ("index_build_s", "cache_reload_s"):
        print(f"| {key.replace('_s', '')} (s) | {ours[key]:.3f} | {meg[key]:.3f} | {meg[key] / ours[key]:.2f}x |")
    for name in VARIANTS:
        k = f"reads/s {name}"
        print(f"| random reads/s, {name} | {ours[k]:.0f} | {meg[k]:.0f} | {ours[k] / meg[k]:.2f}x |")
    tp_o, tp_m = p_ours["tokens"] / p_ours["seconds"], p_meg["tokens"] / p_meg["seconds"]
    print(f"| preprocessing tokens/s ({p_ours['tokens']} tokens) | {tp_o:.0f} | {tp_m:.0f} | {tp_o / tp_m:.2f}x |")


if __name__ == "__main__":
    main()
