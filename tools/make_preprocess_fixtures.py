"""Generate the preprocessing parity fixtures by running Megatron-LM's own tools/preprocess_data.py.

    python3 tools/make_preprocess_fixtures.py --megatron-lm /path/to/Megatron-LM

Megatron-LM (a checkout; fixtures were made at commit d98e8a64ddf3) is not on the package
index: its tools/ and megatron/training/ come from the checkout, torch==2.13.0 (CPU),
megatron-core 0.16.1's dependencies, transformers, triton (imported at module level by
megatron.core, never run here) and nltk==3.8.1 (the last nltk that loads punkt's .pickle
models, which Megatron's script asks for) from the index into a throwaway venv (default
/tmp/megprep). On Python 3.11 typing.override (3.12) is taken from typing_extensions.
The script runs Megatron twice for --split-sentences: with one partition, its first run only
writes <input>_ss.jsonl. Its GPT2BPETokenizer needs the hub's "gpt2" config (no network here),
so the GPT-2 case runs its HuggingFaceTokenizer on a folder with the same vocab.json/merges.txt
and a GPT2Tokenizer config, which builds the same transformers tokenizer.
Writes packages/data/tests/fixtures/preprocess/: the inputs (two jsonl corpora, a tiny
HuggingFace tokenizer folder, a tiny GPT-2 vocab.json/merges.txt, Punkt parameters as
punkt_tab text files for two "languages"), Megatron's outputs per case and manifest.json
(each case's flags). Only data is committed, never Megatron code.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import pickle
import shutil
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "..", "packages", "data", "tests", "fixtures", "preprocess")
VENV = os.environ.get("MEGATRON_PREP_VENV", "/tmp/megprep")
PINS = ["torch==2.13.0", "megatron-core==0.16.1", "numpy", "transformers<5", "nltk==3.8.1", "triton"]

SENTENCES = [
    "Mr. Smith went to Washington. He arrived at noon!", "Is this the end? No, it is not.",
    "Dr. Brown lives on Elm St. near the park.", "The U.S. economy grew 3.5 percent.",
    "Line one.\nLine two follows.\n\nA new paragraph starts here.", "ünïcode sentence ✓. Another one.",
    "short", "e.g. this starts with an abbreviation. Then more text.", "Numbers 1. 2. 3. are listed.",
]

# Punkt parameters: "english" knows a few abbreviations, "tiny" knows none (so it splits after "Mr.").
PUNKT = {
    "english": {"abbrev_types": ["mr", "dr", "st", "u.s", "e.g"], "collocations": [["##number##", "are"]],
                "sent_starters": ["he", "the", "a"], "ortho_context": {"he": 2, "the": 34, "line": 36}},
    "tiny": {"abbrev_types": [], "collocations": [], "sent_starters": [], "ortho_context": {}},
}

# case -> (Megatron flags, mindtrain flags) besides --input/--output-prefix; paths relative to OUT
HF = ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", "hf_tok"]
CASES = {
    "hf_keys_eod": (HF + ["--json-keys", "text", "title", "--append-eod", "--workers", "1"],
                    ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-dir", "hf_tok", "--json-keys", "text",
                     "title", "--append-eod", "--workers", "1"]),
    "hf_no_eod_workers2": (HF + ["--workers", "2"], ["--tokenizer-dir", "hf_tok", "--workers", "2"]),
    # Megatron's GPT2BPETokenizer is transformers' GPT-2 tokenizer from these two files, but it asks the
    # hub for "gpt2"'s config first (no network here): its HuggingFaceTokenizer on a folder holding the
    # same two files and a GPT2Tokenizer config builds the same tokenizer offline.
    "gpt2_bpe": (["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", "gpt2", "--append-eod",
                  "--workers", "1"],
                 ["--vocab-file", "gpt2/vocab.json", "--merges-file", "gpt2/merges.txt", "--append-eod"]),
    "null": (["--tokenizer-type", "NullTokenizer", "--vocab-size", "1000", "--append-eod", "--workers", "1"],
             ["--tokenizer-type", "NullTokenizer", "--vocab-size", "1000", "--append-eod"]),
    "split": (HF + ["--split-sentences", "--append-eod", "--workers", "1"],
              ["--tokenizer-dir", "hf_tok", "--split-sentences", "--append-eod"]),
    "split_keep_newlines": (HF + ["--split-sentences", "--keep-newlines", "--append-eod", "--workers", "1"],
                            ["--tokenizer-dir", "hf_tok", "--split-sentences", "--keep-newlines", "--append-eod"]),
    "split_lang": (HF + ["--split-sentences", "--lang", "tiny", "--workers", "1"],
                   ["--tokenizer-dir", "hf_tok", "--split-sentences", "--lang", "tiny"]),
    "partitions3": (HF + ["--partitions", "3", "--workers", "3", "--append-eod"],
                    ["--tokenizer-dir", "hf_tok", "--partitions", "3", "--workers", "3", "--append-eod"]),
    "partitions3_sequential": (HF + ["--partitions", "3", "--workers", "3", "--keep-sequential-samples",
                                     "--append-eod"],
                               ["--tokenizer-dir", "hf_tok", "--partitions", "3", "--workers", "3",
                                "--keep-sequential-samples", "--append-eod"]),
}
INPUT = {"null": "numbers.jsonl"}


def ensure_venv() -> str:
    py = os.path.join(VENV, "bin", "python")
    if not os.path.exists(py):
        subprocess.check_call([sys.executable, "-m", "venv", VENV])
    subprocess.check_call([py, "-m", "pip", "install", "-q", *PINS])
    return py


def make_inputs() -> None:
    """The corpora and the tokenizer/punkt files (built with the `tokenizers` library)."""
    import random

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    rng = random.Random(20261201)
    os.makedirs(OUT, exist_ok=True)
    with open(os.path.join(OUT, "corpus.jsonl"), "w", encoding="utf-8") as f:
        for i in range(40):
            text = " ".join(rng.choice(SENTENCES) for _ in range(rng.randint(0 if i % 13 == 5 else 1, 4)))
            f.write(json.dumps({"text": text, "title": f"Title {i}. Part {i % 3}!"}) + "\n")
    with open(os.path.join(OUT, "numbers.jsonl"), "w", encoding="utf-8") as f:
        for i in range(12):
            f.write(json.dumps({"text": " ".join(str(rng.randint(0, 998)) for _ in range(rng.randint(1, 9)))}) + "\n")
    training = SENTENCES * 30 + [f"Title {i}. Part {i % 3}!" for i in range(40)]
    # a HuggingFace folder: BPE with a post-processor that puts <s> first, eos </s>
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    tok.train_from_iterator(training, trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"]))
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    d = os.path.join(OUT, "hf_tok")
    os.makedirs(d, exist_ok=True)
    tok.save(os.path.join(d, "tokenizer.json"))
    with open(os.path.join(d, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
                   "unk_token": "<unk>"}, f)
    # GPT-2 style byte-level BPE files
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.train_from_iterator(training, trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>"],
                                                          initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    g = os.path.join(OUT, "gpt2")
    os.makedirs(g, exist_ok=True)
    bpe.model.save(g)
    with open(os.path.join(g, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "GPT2Tokenizer", "add_prefix_space": False, "bos_token": "<|endoftext|>",
                   "eos_token": "<|endoftext|>", "unk_token": "<|endoftext|>"}, f)
    for lang, p in PUNKT.items():
        d = os.path.join(OUT, "nltk_data", "tokenizers", "punkt_tab", lang)
        os.makedirs(d, exist_ok=True)
        with open(os.path.join(d, "abbrev_types.txt"), "w") as f:
            f.write("".join(a + "\n" for a in p["abbrev_types"]))
        with open(os.path.join(d, "collocations.tab"), "w") as f:
            f.write("".join(f"{a}\t{b}\n" for a, b in p["collocations"]))
        with open(os.path.join(d, "sent_starters.txt"), "w") as f:
            f.write("".join(s + "\n" for s in p["sent_starters"]))
        with open(os.path.join(d, "ortho_context.tab"), "w") as f:
            f.write("".join(f"{k}\t{v}\n" for k, v in p["ortho_context"].items()))


def punkt_pickles(nltk_data: str) -> None:
    """The same parameters as the pickled PunktSentenceTokenizer Megatron's script loads."""
    from nltk.tokenize.punkt import PunktParameters, PunktSentenceTokenizer

    for d in (os.path.join(nltk_data, "tokenizers", "punkt"), os.path.join(nltk_data, "tokenizers", "punkt", "PY3")):
        os.makedirs(d, exist_ok=True)
        _pickle_params(d)


def _pickle_params(d: str) -> None:
    from nltk.tokenize.punkt import PunktParameters, PunktSentenceTokenizer

    for lang, p in PUNKT.items():
        params = PunktParameters()
        params.abbrev_types = set(p["abbrev_types"])
        params.collocations = {tuple(c) for c in p["collocations"]}
        params.sent_starters = set(p["sent_starters"])
        params.ortho_context.update(p["ortho_context"])
        with open(os.path.join(d, f"{lang}.pickle"), "wb") as f:
            pickle.dump(PunktSentenceTokenizer(params), f)


def run_megatron(megatron_lm: str) -> None:
    work = tempfile.mkdtemp(prefix="megprep_")
    nltk_data = os.path.join(work, "nltk_data")
    punkt_pickles(nltk_data)
    # Megatron-LM's training package uses typing.override (Python 3.12); on 3.11 give it the
    # typing_extensions one, the same decorator (it only marks methods).
    shim = os.path.join(work, "shim")
    os.makedirs(shim)
    with open(os.path.join(shim, "sitecustomize.py"), "w") as f:
        f.write("import typing\nif not hasattr(typing, 'override'):\n"
                "    import typing_extensions\n    typing.override = typing_extensions.override\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([shim, megatron_lm]), NLTK_DATA=nltk_data,
               CUDA_VISIBLE_DEVICES="")
    manifest = {}
    for case, (meg_flags, ours) in CASES.items():
        src = os.path.join(OUT, INPUT.get(case, "corpus.jsonl"))
        inp = os.path.join(work, case + ".jsonl")  # Megatron writes partition/_ss files beside its input
        shutil.copy(src, inp)
        flags = [os.path.join(OUT, a) if os.path.exists(os.path.join(OUT, a)) else a for a in meg_flags]
        cmd = [sys.executable, os.path.join(megatron_lm, "tools", "preprocess_data.py"), "--input", inp,
               "--output-prefix", os.path.join(work, case), *flags]
        subprocess.check_call(cmd, env=env, cwd=work)
        if "--split-sentences" in meg_flags:  # with one partition its first run only writes <input>_ss.jsonl
            subprocess.check_call(cmd, env=env, cwd=work)
        keys = meg_flags[meg_flags.index("--json-keys") + 1:meg_flags.index("--append-eod")] \
            if "--json-keys" in meg_flags else ["text"]
        level = "sentence" if "--split-sentences" in meg_flags else "document"
        outputs = [f"{k}_{level}" for k in keys]
        for o in outputs:
            for ext in (".bin", ".idx"):
                shutil.copy(os.path.join(work, f"{case}_{o}{ext}"), os.path.join(OUT, f"{case}_{o}{ext}"))
        manifest[case] = {"input": INPUT.get(case, "corpus.jsonl"), "megatron_flags": meg_flags,
                          "mindtrain_flags": ours, "outputs": outputs}
        print(case, outputs)
    with open(os.path.join(OUT, "manifest.json"), "w") as f:
        json.dump({"megatron_lm_tool": "tools/preprocess_data.py", "cases": manifest}, f, indent=1)
    shutil.rmtree(work)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--megatron-lm", required=True, help="a Megatron-LM checkout (its tools/ and megatron/)")
    ap.add_argument("--inside", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.inside:
        make_inputs()
        run_megatron(os.path.abspath(args.megatron_lm))
        return
    py = ensure_venv()
    subprocess.check_call([py, os.path.abspath(__file__), "--inside", "--megatron-lm", args.megatron_lm])


if __name__ == "__main__":
    main()
