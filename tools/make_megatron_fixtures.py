"""Generate mindtrain-data's parity fixtures from Megatron-Core itself.

    python3 tools/make_megatron_fixtures.py            # creates /tmp/megvenv when missing

Installs torch==2.13.0 (a local CPU wheel on these machines) and megatron-core==0.16.1 into a
separate venv, re-runs itself there, and writes small .bin/.idx corpora built by Megatron's
IndexedDatasetBuilder plus one .npz per case (every sample of the dataset as Megatron-Core
returns it, and its index arrays) under packages/data/tests/fixtures/megatron/. Only data is
committed, never Megatron code.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "..", "packages", "data", "tests", "fixtures", "megatron")
VENV = os.environ.get("MEGATRON_VENV", "/tmp/megvenv")
PINS = ["torch==2.13.0", "megatron-core==0.16.1", "numpy"]
MAX_SAMPLES = 400

SEQ = 32
BASE = {"seed": 1234, "seq_length": SEQ, "split": "1, 0, 0", "eod": 1, "pad": -1,
        "eod_mask_loss": False, "reset_position_ids": False, "create_attention_mask": False,
        "reset_attention_mask": False, "add_extra_token_to_sequence": True}
ALL_FLAGS = {"eod_mask_loss": True, "reset_position_ids": True, "create_attention_mask": True,
             "reset_attention_mask": True, "pad": 2}

# name -> (dataset config overrides, data_path, sizes, splits to record)
CASES = {
    "defaults_single": ({}, ["corpus_a"], [150, 0, 0], ["train"]),
    "defaults_weighted": ({}, ["1", "corpus_a"], [150, 0, 0], ["train"]),
    "all_flags": (ALL_FLAGS, ["corpus_a"], [150, 0, 0], ["train"]),
    "no_extra_token": (dict(ALL_FLAGS, add_extra_token_to_sequence=False), ["corpus_a"], [150, 0, 0], ["train"]),
    "blend_03_07": ({}, ["0.3", "corpus_a", "0.7", "corpus_b"], [300, 0, 0], ["train"]),
    "int32": ({"seed": 7}, ["corpus_int32"], [100, 0, 0], ["train"]),
    "two_epochs_separate": ({}, ["corpus_a"], [None, 0, 0], ["train"]),
    "two_epochs_joined": ({}, ["corpus_a"], [None, 0, 0], ["train"]),
    "three_way_split": ({"split": "6,2,2", "seed": 99}, ["corpus_a"], [60, 20, 20], ["train", "valid", "test"]),
}


def ensure_venv() -> str:
    py = os.path.join(VENV, "bin", "python")
    if not os.path.exists(py):
        subprocess.check_call([sys.executable, "-m", "venv", VENV])
    subprocess.check_call([py, "-m", "pip", "install", "-q", *PINS])
    return py


def make_corpora(work: str, np, torch, mc_indexed) -> dict:
    """Random documents ending in eod=1, some holding the pad id 2; returns prefix paths."""
    rng = np.random.RandomState(20260101)
    prefixes = {}
    specs = {"corpus_a": (np.uint16, 500, 240), "corpus_b": (np.uint16, 500, 160),
             "corpus_int32": (np.int32, 100000, 120)}
    for name, (dtype, vocab, ndocs) in specs.items():
        prefix = os.path.join(work, name)
        builder = mc_indexed.IndexedDatasetBuilder(prefix + ".bin", dtype=dtype)
        for d in range(ndocs):
            n = int(rng.randint(1, 70))
            doc = rng.randint(3, vocab, size=n)
            if rng.rand() < 0.15:
                doc[rng.randint(0, n)] = 2  # a pad id inside real text
            doc[-1] = 1
            if d % 5 == 0 and n > 4:
                # a two-sequence document written item by item
                builder.add_item(torch.tensor(doc[: n // 2]))
                builder.add_item(torch.tensor(doc[n // 2:]))
                builder.end_document()
            else:
                builder.add_document(doc.tolist(), [n])
        builder.finalize(prefix + ".idx")
        prefixes[name] = prefix
    # A merge of two corpora through add_index, for the builder's byte-identity test.
    merged = os.path.join(work, "merged_ab")
    builder = mc_indexed.IndexedDatasetBuilder(merged + ".bin", dtype=np.uint16)
    builder.add_index(prefixes["corpus_a"])
    builder.add_index(prefixes["corpus_b"])
    builder.finalize(merged + ".idx")
    prefixes["merged_ab"] = merged
    return prefixes


def _no_mask_cache(datasets, BlendedDataset) -> None:
    """Turn off Megatron's cached masks before reading samples.

    With no reset/eod flags GPTDataset caches the loss mask of the first sample it reads, but
    then zeroes that sample's pad positions in the cached array itself, so every later sample
    inherits them (megatron-core 0.16.1). Reading uncached gives each sample its own mask,
    which is what the code intends and what mindtrain-data returns.
    """
    for ds in datasets:
        if ds is None:
            continue
        for member in (ds.datasets if isinstance(ds, BlendedDataset) else [ds]):
            member.masks_and_position_ids_are_cacheable = False


class _Tokenizer:
    """What Megatron's GPTDataset reads from a tokenizer: vocab size, eod, pad."""

    def __init__(self, vocab_size, eod, pad):
        from collections import OrderedDict
        self.vocab_size, self.eod = vocab_size, eod
        if pad is not None and pad >= 0:
            self.pad = pad
        self.unique_identifiers = OrderedDict(cls="fixture", vocab=vocab_size, eod=eod, pad=pad)


def inside() -> None:
    import numpy as np
    import torch
    import megatron.core
    from megatron.core.datasets import indexed_dataset as mc_indexed
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
    from megatron.core.datasets.blended_dataset import BlendedDataset

    version = getattr(megatron.core, "__version__", "unknown")
    out = os.path.abspath(OUT)
    if os.path.isdir(out):
        shutil.rmtree(out)
    os.makedirs(out)
    work = tempfile.mkdtemp(prefix="megfix-")
    prefixes = make_corpora(work, np, torch, mc_indexed)
    for name, prefix in prefixes.items():
        for ext in (".bin", ".idx"):
            shutil.copy(prefix + ext, os.path.join(out, name + ext))

    # Epoch arithmetic for the two-epoch cases (add_extra_token_to_sequence = 1).
    a = mc_indexed.IndexedDataset(prefixes["corpus_a"])
    tokens = int(a.sequence_lengths.sum())
    per_epoch = (tokens - 1) // SEQ
    sizes_for = {"two_epochs_separate": per_epoch + max(1, per_epoch // 5),
                 "two_epochs_joined": per_epoch + int(0.9 * per_epoch)}

    manifest = {"megatron_core": version, "torch": torch.__version__, "numpy": np.__version__,
                "seq_length": SEQ, "cases": {}}
    for name, (overrides, data_path, sizes, splits) in CASES.items():
        cfg = dict(BASE, **overrides)
        sizes = [sizes_for.get(name, s) if s is None else s for s in sizes]
        # A private copy of the corpora per case: Megatron caches indices beside the data under
        # a hash that ignores add_extra_token_to_sequence, so cases must not share that cache.
        case_dir = os.path.join(work, name)
        os.makedirs(case_dir)
        for p in prefixes:
            for ext in (".bin", ".idx"):
                shutil.copy(prefixes[p] + ext, os.path.join(case_dir, p + ext))
        blend_list = [os.path.join(case_dir, p) if not p.replace(".", "").isdigit() else p for p in data_path]
        prefixes_, weights = [], None
        if len(blend_list) == 1:
            prefixes_ = blend_list
        else:
            prefixes_ = blend_list[1::2]
            weights = [float(w) for w in blend_list[0::2]]
        vocab = 100000 if name == "int32" else 500
        mconf = GPTDatasetConfig(
            random_seed=cfg["seed"], sequence_length=SEQ, blend=(prefixes_, weights),
            split=cfg["split"], path_to_cache=None,
            tokenizer=_Tokenizer(vocab, cfg["eod"], cfg["pad"]),
            reset_position_ids=cfg["reset_position_ids"], reset_attention_mask=cfg["reset_attention_mask"],
            eod_mask_loss=cfg["eod_mask_loss"], create_attention_mask=cfg["create_attention_mask"],
            add_extra_token_to_sequence=cfg["add_extra_token_to_sequence"])
        built = BlendedMegatronDatasetBuilder(GPTDataset, sizes, lambda: True, mconf).build()
        _no_mask_cache(built, BlendedDataset)
        section = {"dataloader": {"type": "BlendedMegatronDatasetDataLoader", "datasets_type": "GPTDataset",
                                  "sizes": sizes, "shuffle": False,
                                  "column_names": ["input_ids", "labels", "loss_mask", "position_ids"]
                                  + (["attention_mask"] if cfg["create_attention_mask"] else []),
                                  "config": dict(cfg, data_path=data_path)},
                   "drop_remainder": True, "num_parallel_workers": 0}
        entry = {"section": section, "splits": {}}
        for split in splits:
            ds = built[["train", "valid", "test"].index(split)]
            n = min(len(ds), MAX_SAMPLES)
            rows = [ds[i] for i in range(n)]
            arrays = {
                "input_ids": np.stack([r["tokens"].numpy() for r in rows]).astype(np.int32),
                "labels": np.stack([r["labels"].numpy() for r in rows]).astype(np.int32),
                "loss_mask": np.stack([r["loss_mask"].numpy() for r in rows]).astype(np.float32),
                "position_ids": np.stack([r["position_ids"].numpy() for r in rows]).astype(np.int32),
            }
            if cfg["create_attention_mask"]:
                mask = np.stack([r["attention_mask"].numpy() for r in rows]).astype(bool)
                arrays["attention_mask_bits"] = np.packbits(mask.reshape(n, -1), axis=1)
            if isinstance(ds, BlendedDataset):
                arrays["dataset_index"] = np.asarray(ds.dataset_index)
                arrays["dataset_sample_index"] = np.asarray(ds.dataset_sample_index)
                members = ds.datasets
            else:
                members = [ds]
            for m, member in enumerate(members):
                arrays[f"m{m}_document_index"] = np.asarray(member.document_index)
                arrays[f"m{m}_sample_index"] = np.asarray(member.sample_index)
                arrays[f"m{m}_shuffle_index"] = np.asarray(member.shuffle_index)
            fname = f"{name}-{split}.npz"
            np.savez_compressed(os.path.join(out, fname), **arrays)
            entry["splits"][split] = {"file": fname, "length": len(ds), "recorded": n,
                                      "kind": type(ds).__name__}
        manifest["cases"][name] = entry
        print(f"{name}: " + ", ".join(f"{s}={v['length']}" for s, v in entry["splits"].items()))
    manifest["random_cases"] = random_cases(out, work, np, torch, mc_indexed, BlendedMegatronDatasetBuilder,
                                            GPTDataset, GPTDatasetConfig, BlendedDataset)
    with open(os.path.join(out, "manifest.json"), "w") as f:
        json.dump(manifest, f, indent=1)
    shutil.rmtree(work)
    print(f"fixtures written to {out} (megatron-core {version})")


def _splits_have_tokens(out, prefixes, c, np, mc_indexed) -> bool:
    from megatron.core.datasets.blended_megatron_dataset_config import (
        convert_split_vector_to_split_matrix, parse_and_normalize_split)
    matrix = convert_split_vector_to_split_matrix(parse_and_normalize_split(c["split"]))
    for p in prefixes:
        ds = mc_indexed.IndexedDataset(os.path.join(out, p))
        lengths = np.array(ds.sequence_lengths)  # a copy: Megatron unmaps the index when ds dies
        del ds
        for bookends in matrix:
            if bookends is None:
                continue
            beg, end = (int(round(b * float(len(lengths)))) for b in bookends)
            if int(lengths[beg:end].sum()) <= c["seq_length"] + 1:
                return False
    return True


def random_cases(out, work, np, torch, mc_indexed, Builder, GPTDataset, GPTDatasetConfig, BlendedDataset,
                 count: int = 24, per_split: int = 12) -> list:
    """Random settings over corpora with empty documents: 1-3 prefixes, weights, splits, epochs.

    Samples at random positions of every split go to random_cases.npz; returns the settings.
    """
    rng = np.random.RandomState(424242)
    for name in ("r0", "r1", "r2"):
        b = mc_indexed.IndexedDatasetBuilder(os.path.join(out, name + ".bin"), dtype=np.uint16)
        for _ in range(rng.randint(20, 200)):
            n = int(rng.randint(0, 90))
            doc = rng.randint(2, 500, n)
            if n:
                doc[-1] = 1
            b.add_document(doc.tolist(), [n] if n else [])
        b.finalize(os.path.join(out, name + ".idx"))
    cases, arrays = [], {}
    while len(cases) < count:
        pre = [str(p) for p in rng.choice(["r0", "r1", "r2"], int(rng.choice([1, 1, 2, 3])), replace=False)]
        weights = ([float(np.round(rng.rand() * 3 + 0.01, 3)) for _ in pre]
                   if len(pre) > 1 or rng.rand() < 0.5 else None)
        c = dict(seed=int(rng.randint(0, 10000)), seq_length=int(rng.choice([8, 16, 33, 64])),
                 split=str(rng.choice(["1,0,0", "98,1,1", "6,2,2", "0.7, 0.2, 0.1", "3,3,3"])), eod=1,
                 pad=int(rng.choice([-1, 2])), add_extra_token_to_sequence=bool(rng.rand() < 0.7))
        c["eod_mask_loss"] = c["reset_position_ids"] = bool(rng.rand() < 0.5)
        sizes = [int(rng.randint(1, 2000)), int(rng.randint(0, 50)), int(rng.randint(0, 50))]
        if not _splits_have_tokens(out, pre, c, np, mc_indexed):
            continue  # Megatron loops forever on a split without tokens; ours raises a UserError
        k = len(cases)
        case_dir = os.path.join(work, f"random{k}")
        os.makedirs(case_dir)
        for p in pre:
            for ext in (".bin", ".idx"):
                shutil.copy(os.path.join(out, p + ext), os.path.join(case_dir, p + ext))
        mconf = GPTDatasetConfig(
            random_seed=c["seed"], sequence_length=c["seq_length"],
            blend=([os.path.join(case_dir, p) for p in pre], weights), split=c["split"], path_to_cache=None,
            tokenizer=_Tokenizer(500, 1, c["pad"]), reset_position_ids=c["reset_position_ids"],
            reset_attention_mask=False, eod_mask_loss=c["eod_mask_loss"], create_attention_mask=False,
            add_extra_token_to_sequence=c["add_extra_token_to_sequence"])
        built = Builder(GPTDataset, sizes, lambda: True, mconf).build()
        _no_mask_cache(built, BlendedDataset)
        data_path = pre if weights is None else [x for w, p in zip(weights, pre) for x in (str(w), p)]
        lengths = {}
        for s, ds in enumerate(built):
            if ds is None:
                continue
            split = ["train", "valid", "test"][s]
            lengths[split] = len(ds)
            if isinstance(ds, BlendedDataset):
                arrays[f"c{k}_{split}_dataset_index"] = np.asarray(ds.dataset_index)
                arrays[f"c{k}_{split}_dataset_sample_index"] = np.asarray(ds.dataset_sample_index)
            idx = rng.randint(0, len(ds), min(len(ds), per_split)) if len(ds) else np.zeros(0, int)
            rows = [ds[int(i)] for i in idx]
            arrays[f"c{k}_{split}_idx"] = idx
            for ours, theirs, dt in (("input_ids", "tokens", np.int32), ("labels", "labels", np.int32),
                                     ("loss_mask", "loss_mask", np.float32),
                                     ("position_ids", "position_ids", np.int32)):
                arrays[f"c{k}_{split}_{ours}"] = (np.stack([r[theirs].numpy() for r in rows]).astype(dt)
                                                  if rows else np.zeros((0, c["seq_length"]), dt))
        cases.append({"config": dict(c, data_path=data_path), "sizes": sizes, "lengths": lengths})
    np.savez_compressed(os.path.join(out, "random_cases.npz"), **arrays)
    print(f"random cases: {count}")
    return cases


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--inside", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.inside:
        inside()
        return
    py = ensure_venv()
    subprocess.check_call([py, os.path.abspath(__file__), "--inside"])


if __name__ == "__main__":
    main()
