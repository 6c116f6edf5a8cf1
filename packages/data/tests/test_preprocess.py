"""Preprocessing jsonl into .bin/.idx, the CLIs, and the path from raw text to loader batches."""

import gzip
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from mindtrain.data import (ByteTokenizer, DataFileError, HFTokenizer, IndexedDataset, PretrainingLoader,
                            build_dataset, preprocess)

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
TEXTS = ["hello world", "", "ünïcode ✓ text", "a" * 300, "line\nbreak", "x"]


def _write_jsonl(path, texts, key="text"):
    with open(path, "w", encoding="utf-8") as f:
        for t in texts:
            f.write(json.dumps({key: t, "meta": 1}) + "\n")


def _docs(prefix):
    ds = IndexedDataset(prefix)
    di = ds.document_indices
    return [np.concatenate([ds[j] for j in range(di[d], di[d + 1])]).tolist() if di[d + 1] > di[d] else []
            for d in range(len(di) - 1)]


def test_byte_tokenizer_ids():
    tok = ByteTokenizer()
    assert (tok.vocab_size, tok.bos, tok.eod, tok.pad) == (259, 0, 1, 2)
    assert tok.encode("A").tolist() == [ord("A") + 3]
    assert tok.decode(tok.encode("ünï ✓")) == "ünï ✓"
    assert tok.decode([0, 3 + 104, 3 + 105, 1]) == "<s>hi</s>"


def test_jsonl_gz_and_globs_with_eod(tmp_path):
    _write_jsonl(tmp_path / "a.jsonl", TEXTS[:3])
    with gzip.open(tmp_path / "b.jsonl.gz", "wt", encoding="utf-8") as f:
        for t in TEXTS[3:]:
            f.write(json.dumps({"text": t}) + "\n\n")
    summary = preprocess([str(tmp_path / "a.jsonl"), str(tmp_path / "b*.gz")], str(tmp_path / "out" / "corpus"),
                         ByteTokenizer(), append_eod=True)
    tok = ByteTokenizer()
    expect = [tok.encode(t).tolist() + [1] if t else [] for t in TEXTS]
    assert _docs(str(tmp_path / "out" / "corpus_text_document")) == expect
    assert summary["documents"] == len(TEXTS) and summary["tokens"] == sum(map(len, expect))
    assert (summary["dtype"], summary["eod"]) == ("uint16", 1)
    assert not [p for p in os.listdir(tmp_path / "out") if "tmp" in p]


def test_workers_give_identical_files(tmp_path):
    _write_jsonl(tmp_path / "a.jsonl", [f"document {i} " * (i % 7) for i in range(500)])
    preprocess(str(tmp_path / "a.jsonl"), str(tmp_path / "w1"), ByteTokenizer(), workers=1)
    preprocess(input=str(tmp_path / "a.jsonl"), output_prefix=str(tmp_path / "w2"), tokenizer="byte", workers=2)
    for ext in (".bin", ".idx"):
        assert (tmp_path / f"w1_text_document{ext}").read_bytes() == (tmp_path / f"w2_text_document{ext}").read_bytes()


def test_bad_records_fail_with_file_and_line_or_are_skipped(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"text": "ok"}\n{"text": broken\n{"other": "x"}\n{"text": "fine"}\n', encoding="utf-8")
    with pytest.raises(DataFileError, match=r"bad\.jsonl:2: invalid JSON"):
        preprocess(str(path), str(tmp_path / "o"), ByteTokenizer())
    assert not (tmp_path / "o_text_document.bin").exists()
    s = preprocess(str(path), str(tmp_path / "o"), ByteTokenizer(), on_error="skip")
    assert s["skipped"] == 2 and s["documents"] == 2
    assert any("bad.jsonl:3: missing key 'text'" in e for e in s["skipped_examples"])


def test_json_array_file_and_several_keys(tmp_path):
    (tmp_path / "arr.json").write_text(json.dumps([{"text": "ab", "title": "t"}, {"text": "c", "title": ["u", "v"]}]))
    preprocess(str(tmp_path / "arr.json"), str(tmp_path / "o"), ByteTokenizer(), json_keys=("text", "title"))
    assert _docs(str(tmp_path / "o_text_document")) == [[100, 101, 1], [102, 1]]
    title = IndexedDataset(str(tmp_path / "o_title_document"))
    assert title.sequence_lengths.tolist() == [2, 1, 2]  # list entries become sequences; eod on the last
    assert title.document_indices.tolist() == [0, 1, 3]


def _hf_tokenizer_dir(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import models, pre_tokenizers, trainers
    tok = tokenizers.Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.BpeTrainer(vocab_size=120, special_tokens=["<unk>", "<s>", "</s>"])
    tok.train_from_iterator([t for t in TEXTS if t] * 20, trainer)
    d = tmp_path / "tok"
    d.mkdir()
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    return d, tok


def test_huggingface_tokenizer_dir(tmp_path):
    d, ref = _hf_tokenizer_dir(tmp_path)
    hf = HFTokenizer(str(d))
    assert hf.eod == ref.token_to_id("</s>") and hf.vocab_size == ref.get_vocab_size()
    _write_jsonl(tmp_path / "a.jsonl", TEXTS)
    preprocess(str(tmp_path / "a.jsonl"), str(tmp_path / "o"), hf, workers=2)
    expect = [ref.encode(t).ids + [hf.eod] if ref.encode(t).ids else [] for t in TEXTS]
    assert _docs(str(tmp_path / "o_text_document")) == expect


def _run(args, **kw):
    env = dict(os.environ, PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env, **kw)


def test_cli_shim_and_inspect(tmp_path):
    _write_jsonl(tmp_path / "a.jsonl", TEXTS)
    r = _run([os.path.join(ROOT, "preprocess_indexed_dataset.py"), "--input", str(tmp_path / "a.jsonl"),
              "--output-prefix", str(tmp_path / "c"), "--append-eod", "--workers", "2", "--quiet"])
    assert r.returncode == 0, r.stderr
    assert "eod id: 1" in r.stdout and "documents: 6" in r.stdout
    r = _run(["-m", "mindtrain.data.cli", "inspect", str(tmp_path / "c_text_document"),
              "--tokenizer-type", "ByteTokenizer", "--sample", "2"])
    assert r.returncode == 0, r.stderr
    assert "documents:  6" in r.stdout and "dtype:      uint16" in r.stdout and "ünïcode ✓ text</s>" in r.stdout
    bad = _run([os.path.join(ROOT, "preprocess_indexed_dataset.py"), "--input", str(tmp_path / "missing.jsonl"),
                "--output-prefix", str(tmp_path / "x")])
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "missing.jsonl" in bad.stderr
    bad = _run(["-m", "mindtrain.data.cli", "inspect", str(tmp_path / "nope")])
    assert bad.returncode == 2 and "nope" in bad.stderr


def test_jsonl_to_loader_batches(tmp_path):
    rng = np.random.RandomState(0)
    words = ["alpha", "beta", "gamma", "delta", "ε"]
    _write_jsonl(tmp_path / "a.jsonl", [" ".join(rng.choice(words, rng.randint(1, 40))) for _ in range(200)])
    preprocess(str(tmp_path / "a.jsonl"), str(tmp_path / "run_data" / "pydoc"), ByteTokenizer())
    section = {"dataloader": {"type": "BlendedMegatronDatasetDataLoader", "datasets_type": "GPTDataset",
                              "sizes": [64, 0, 0], "config": {"seq_length": 64, "split": "1, 0, 0", "eod": 1,
                              "data_path": ["1", str(tmp_path / "run_data" / "pydoc_text_document")]}},
               "num_parallel_workers": 2}
    ds = build_dataset(section)
    assert len(ds) == 64
    loader = PretrainingLoader(ds, 4, 16, 1, 2, num_workers=2)
    batch = next(loader)
    assert set(batch) == {"input_ids", "labels", "loss_mask", "position_ids"}
    assert batch["input_ids"].shape == (4, 64)
    np.testing.assert_array_equal(batch["labels"][:, :-1], batch["input_ids"][:, 1:])
    assert os.path.isdir(tmp_path / "run_data" / "cache")
    loader.close()
