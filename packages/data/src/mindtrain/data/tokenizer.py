"""Tokenizers for preprocessing: a built-in byte-level one and HF tokenizer.json directories."""

from __future__ import annotations

import json
import os
from typing import Optional

import numpy as np

from mindtrain.data.errors import DataFileError, UserError


class ByteTokenizer:
    """UTF-8 bytes as tokens: 0 = <s> (bos), 1 = </s> (eod), 2 = <pad>, byte b -> b + 3."""

    name = "ByteTokenizer"
    vocab_size = 259
    bos, eod, pad = 0, 1, 2
    _specials = {0: "<s>", 1: "</s>", 2: "<pad>"}

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int32) + 3

    def decode(self, ids) -> str:
        out, run = [], bytearray()
        for i in np.asarray(ids).tolist():
            if i >= 3:
                run.append(i - 3)
                continue
            if run:
                out.append(run.decode("utf-8", errors="replace"))
                run = bytearray()
            out.append(self._specials.get(i, f"<{i}>"))
        if run:
            out.append(run.decode("utf-8", errors="replace"))
        return "".join(out)


_EOD_CANDIDATES = ("<|endoftext|>", "</s>", "<｜end▁of▁sentence｜>", "<|end_of_text|>", "<eos>", "<|im_end|>")


class HFTokenizer:
    """A HuggingFace ``tokenizer.json`` directory, loaded offline with the ``tokenizers`` library.

    Encodes like Megatron's HuggingFaceTokenizer (special tokens of the post-processor, e.g.
    BOS, included). The eod id is tokenizer_config.json's eos_token, else a common end token.
    """

    name = "HuggingFaceTokenizer"

    def __init__(self, directory: str, eod: Optional[int] = None):
        self.directory = directory
        path = os.path.join(directory, "tokenizer.json")
        if not os.path.isfile(path):
            raise DataFileError(directory, "no tokenizer.json in this directory; pass a HuggingFace "
                                           "tokenizer folder to --tokenizer-dir")
        try:
            from tokenizers import Tokenizer
        except ImportError:
            raise UserError("HuggingFace tokenizers need the 'tokenizers' package: "
                            "pip install 'mindtrain-data[tokenizers]'") from None
        try:
            self._tok = Tokenizer.from_file(path)
        except Exception as err:
            raise DataFileError(path, f"cannot be loaded by the tokenizers library: {err}") from None
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.eod = self._find_eod() if eod is None else int(eod)
        self.pad = None

    def _find_eod(self) -> int:
        names = []
        cfg = os.path.join(self.directory, "tokenizer_config.json")
        if os.path.isfile(cfg):
            with open(cfg, encoding="utf-8") as f:
                eos = json.load(f).get("eos_token")
            if isinstance(eos, dict):
                eos = eos.get("content")
            if isinstance(eos, str):
                names.append(eos)
        for name in [*names, *_EOD_CANDIDATES]:
            i = self._tok.token_to_id(name)
            if i is not None:
                return int(i)
        raise DataFileError(self.directory, "cannot tell the end-of-document token (no eos_token in "
                                            "tokenizer_config.json); pass --eod-id")

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self._tok.encode(text).ids, dtype=np.int64)

    def decode(self, ids) -> str:
        return self._tok.decode([int(i) for i in np.asarray(ids).tolist()], skip_special_tokens=False)

    def __reduce__(self):  # workers reload from the directory instead of pickling Rust state
        return (HFTokenizer, (self.directory, self.eod))


TOKENIZER_TYPES = ("ByteTokenizer", "HuggingFaceTokenizer")


def load_tokenizer(tokenizer_type: Optional[str] = None, tokenizer_dir: Optional[str] = None,
                   eod: Optional[int] = None):
    """ByteTokenizer when nothing is given; HuggingFaceTokenizer needs ``tokenizer_dir``."""
    if tokenizer_type is None:
        tokenizer_type = "HuggingFaceTokenizer" if tokenizer_dir else "ByteTokenizer"
    if tokenizer_type == "ByteTokenizer":
        return ByteTokenizer()
    if tokenizer_type == "HuggingFaceTokenizer":
        if not tokenizer_dir:
            raise UserError("--tokenizer-dir: required with --tokenizer-type HuggingFaceTokenizer")
        return HFTokenizer(tokenizer_dir, eod)
    raise UserError(f"--tokenizer-type: unknown {tokenizer_type!r}; choose {' or '.join(TOKENIZER_TYPES)}")
