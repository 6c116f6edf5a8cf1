"""MindFormers' and Megatron-LM's preprocessing flags, against outputs of Megatron-LM's own tool.

Fixtures: tools/make_preprocess_fixtures.py ran Megatron-LM's tools/preprocess_data.py on the
inputs under fixtures/preprocess/ and kept its .bin/.idx; we run the same flags and compare bytes.
"""

import json
import os
import subprocess
import sys

import nltk  # the workspace installs mindtrain-data[sentences]; a missing nltk fails here, not skips
import numpy as np
import pytest

from mindtrain.data import IndexedDataset
from mindtrain.data.preprocess import main

FIX = os.path.join(os.path.dirname(__file__), "fixtures", "preprocess")
with open(os.path.join(FIX, "manifest.json")) as _f:
    CASES = json.load(_f)["cases"]
ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))


@pytest.fixture(autouse=True)
def punkt_data(monkeypatch):
    """The fixture Punkt parameters (punkt_tab text files) come first on NLTK's data path."""
    monkeypatch.setattr(nltk.data, "path", [os.path.join(FIX, "nltk_data"), *nltk.data.path])


def _fix_paths(flags):
    return [os.path.join(FIX, a) if os.path.exists(os.path.join(FIX, a)) else a for a in flags]


def _same_bytes(ours_prefix, theirs_prefix):
    for ext in (".bin", ".idx"):
        with open(ours_prefix + ext, "rb") as a, open(theirs_prefix + ext, "rb") as b:
            assert a.read() == b.read(), f"{ours_prefix}{ext} differs from Megatron's {theirs_prefix}{ext}"


@pytest.mark.parametrize("case", sorted(CASES))
def test_same_bytes_as_megatron(case, tmp_path):
    c = CASES[case]
    out = str(tmp_path / case)
    assert main(["--input", os.path.join(FIX, c["input"]), "--output-prefix", out, "--quiet",
                 *_fix_paths(c["mindtrain_flags"])]) == 0
    for o in c["outputs"]:
        _same_bytes(f"{out}_{o}", os.path.join(FIX, f"{case}_{o}"))


def test_tokenizer_file_equals_its_folder(tmp_path):
    out = str(tmp_path / "f")
    assert main(["--input", os.path.join(FIX, "corpus.jsonl"), "--output-prefix", out, "--quiet", "--append-eod",
                 "--tokenizer-file", os.path.join(FIX, "hf_tok", "tokenizer.json"),
                 "--json-keys", "text", "title"]) == 0
    for key in ("text", "title"):
        _same_bytes(f"{out}_{key}_document", os.path.join(FIX, f"hf_keys_eod_{key}_document"))


def test_workers_and_sequential_partitions_equal_one_process(tmp_path):
    """--keep-sequential-samples keeps the input order, so any partitions/workers give one file."""
    base = ["--input", os.path.join(FIX, "corpus.jsonl"), "--tokenizer-dir", os.path.join(FIX, "hf_tok"),
            "--append-eod", "--quiet"]
    assert main([*base, "--output-prefix", str(tmp_path / "one")]) == 0
    assert main([*base, "--output-prefix", str(tmp_path / "many"), "--workers", "4", "--partitions", "2",
                 "--keep-sequential-samples"]) == 0
    _same_bytes(str(tmp_path / "many_text_document"), str(tmp_path / "one_text_document"))
    _same_bytes(str(tmp_path / "one_text_document"), os.path.join(FIX, "partitions3_sequential_text_document"))


def _docs(prefix):
    ds = IndexedDataset(prefix)
    di = ds.document_indices
    return [np.concatenate([ds[j] for j in range(di[d], di[d + 1])]).tolist() if di[d + 1] > di[d] else []
            for d in range(len(di) - 1)]


def test_bos_eos_flags(tmp_path):
    from tokenizers import Tokenizer

    ref = Tokenizer.from_file(os.path.join(FIX, "hf_tok", "tokenizer.json"))
    (tmp_path / "a.jsonl").write_text('{"text": "Mr. Smith went home."}\n{"text": "short"}\n')
    out = str(tmp_path / "o")
    assert main(["--input", str(tmp_path / "a.jsonl"), "--output-prefix", out, "--quiet", "--tokenizer-dir",
                 os.path.join(FIX, "hf_tok"), "--add_bos_token", "True", "--add_eos_token", "true",
                 "--eos_token", "<unk>", "--append-eod"]) == 0
    unk, bos = ref.token_to_id("<unk>"), ref.token_to_id("<s>")
    # the post-processor already puts <s> first: no second one; eos = --eos_token, then the eod (same id)
    expect = [ref.encode(t).ids + [unk, unk] for t in ("Mr. Smith went home.", "short")]
    assert all(e[0] == bos and e[1] != bos for e in expect)
    assert _docs(out + "_text_document") == expect


class_source = '''
class WordTokenizer:
    """A user's tokenizer in MindFormers' style: __call__ -> {"input_ids": [...]}, eos_token_id."""

    def __init__(self, vocab_file=None, merges_file=None, tokenizer_file=None, eos_token="</s>",
                 add_bos_token=False, add_eos_token=False):
        self.words = open(vocab_file, encoding="utf-8").read().split()
        self.eos_token_id = self.words.index(eos_token)
        self.add_eos = add_eos_token
        self.vocab_size = len(self.words)

    def __call__(self, text):
        ids = [self.words.index(w) for w in text.split()]
        return {"input_ids": ids + ([self.eos_token_id] if self.add_eos else [])}
'''


def test_auto_register_loads_the_users_class_from_its_folder(tmp_path):
    reg = tmp_path / "research" / "mine"
    reg.mkdir(parents=True)
    (reg / "word_tokenizer.py").write_text(class_source)
    (tmp_path / "vocab.txt").write_text("<pad> </s> hello world again")
    (tmp_path / "a.jsonl").write_text('{"text": "hello world"}\n{"text": "again hello"}\n')
    out = str(tmp_path / "o")
    args = ["--input", str(tmp_path / "a.jsonl"), "--output-prefix", out, "--quiet", "--tokenizer-type",
            "AutoRegister", "--register_path", str(reg), "--auto_register", "word_tokenizer.WordTokenizer",
            "--vocab-file", str(tmp_path / "vocab.txt"), "--add_eos_token", "True", "--workers", "2"]
    assert main(args) == 0
    assert _docs(out + "_text_document") == [[2, 3, 1], [4, 2, 1]]
    assert main([*args[:-2], "--append-eod", "--eos_token", "<pad>"]) == 0
    assert _docs(out + "_text_document") == [[2, 3, 0, 0], [4, 2, 0, 0]]


def _one_line(capsys, *args):
    assert main(list(args)) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    return lines[0]


def test_user_mistakes_are_one_line(tmp_path, capsys):
    inp = ["--input", os.path.join(FIX, "corpus.jsonl"), "--output-prefix", str(tmp_path / "x"), "--quiet"]
    (tmp_path / "elsewhere").mkdir()
    assert "--auto_register: required" in _one_line(capsys, *inp, "--tokenizer-type", "AutoRegister",
                                                    "--register_path", str(tmp_path))
    # a module name that lives only outside the named folder (here: the standard library) is not imported
    line = _one_line(capsys, *inp, "--tokenizer-type", "AutoRegister", "--register_path", str(tmp_path / "elsewhere"),
                     "--auto_register", "json.JSONDecoder")
    assert "json.py" in line and "inside --register_path" in line
    assert "--vocab-size: not used by --tokenizer-type HuggingFaceTokenizer" in _one_line(
        capsys, *inp, "--tokenizer-dir", os.path.join(FIX, "hf_tok"), "--vocab-size", "786")
    assert "--keep-newlines: only applies with --split-sentences" in _one_line(capsys, *inp, "--keep-newlines")
    assert "--workers: 3 must be a multiple of --partitions (2)" in _one_line(capsys, *inp, "--workers", "3",
                                                                             "--partitions", "2")
    assert "--eos_token: 'nope' is not a token" in _one_line(capsys, *inp, "--tokenizer-dir",
                                                             os.path.join(FIX, "hf_tok"), "--eos_token", "nope")
    assert "punkt_tab data for --lang klingon" in _one_line(capsys, *inp, "--split-sentences", "--lang", "klingon")
    assert not os.listdir(tmp_path / "elsewhere") and not list(tmp_path.glob("x_*"))


def test_split_sentences_without_nltk_is_one_line(tmp_path):
    code = ("import sys; sys.modules['nltk'] = None; from mindtrain.data.preprocess import main; "
            "sys.exit(main(sys.argv[1:]))")
    r = subprocess.run([sys.executable, "-c", code, "--input", os.path.join(FIX, "corpus.jsonl"),
                        "--output-prefix", str(tmp_path / "x"), "--split-sentences"], capture_output=True, text=True)
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert "pip install 'mindtrain-data[sentences]'" in r.stderr


def test_log_interval(tmp_path):
    r = subprocess.run([sys.executable, os.path.join(ROOT, "preprocess_indexed_dataset.py"), "--input",
                        os.path.join(FIX, "corpus.jsonl"), "--output-prefix", str(tmp_path / "o"), "--quiet",
                        "--log-interval", "15"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    counts = [line.split()[1] for line in r.stderr.splitlines() if line.startswith("Processed ")]
    assert counts == ["15", "30"]
