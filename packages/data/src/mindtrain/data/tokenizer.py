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

    def token_id(self, token: str) -> Optional[int]:
        return {v: k for k, v in self._specials.items()}.get(token)

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
_BOS_CANDIDATES = ("<s>", "<|begin_of_text|>", "<｜begin▁of▁sentence｜>", "<bos>", "<|endoftext|>")


def _import_tokenizers():
    try:
        import tokenizers
    except ImportError:
        raise UserError("HuggingFace and BPE tokenizers need the 'tokenizers' package: "
                        "pip install 'mindtrain-data[tokenizers]'") from None
    return tokenizers


class HFTokenizer:
    """A HuggingFace ``tokenizer.json`` (a folder holding one, or the file itself), loaded offline.

    Encodes like Megatron's HuggingFaceTokenizer (special tokens of the post-processor, e.g.
    BOS, included). The eod id is tokenizer_config.json's eos_token, else a common end token.
    """

    name = "HuggingFaceTokenizer"

    def __init__(self, directory: Optional[str] = None, eod: Optional[int] = None, file: Optional[str] = None):
        self.directory, self.file = directory, file
        if file is None:
            path = os.path.join(directory, "tokenizer.json")
            if not os.path.isfile(path):
                raise DataFileError(directory, "no tokenizer.json in this directory; pass a HuggingFace "
                                               "tokenizer folder to --tokenizer-dir")
        else:
            path = file
            if not os.path.isfile(path):
                raise DataFileError(path, "tokenizer file not found (--tokenizer-file)")
        Tokenizer = _import_tokenizers().Tokenizer
        try:
            self._tok = Tokenizer.from_file(path)
        except Exception as err:
            raise DataFileError(path, f"cannot be loaded by the tokenizers library: {err}") from None
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.eod = self._find_special("eos_token", _EOD_CANDIDATES) if eod is None else int(eod)
        if self.eod is None:
            raise DataFileError(directory or path, "cannot tell the end-of-document token (no eos_token in "
                                                   "tokenizer_config.json); pass --eos_token or --eod-id")
        self.pad = None

    def _config(self) -> dict:
        folder = self.directory or os.path.dirname(os.path.abspath(self.file))
        cfg = os.path.join(folder, "tokenizer_config.json")
        if not os.path.isfile(cfg):
            return {}
        with open(cfg, encoding="utf-8") as f:
            return json.load(f)

    def _find_special(self, key: str, candidates) -> Optional[int]:
        value = self._config().get(key)
        if isinstance(value, dict):
            value = value.get("content")
        for name in ([value] if isinstance(value, str) else []) + list(candidates):
            i = self._tok.token_to_id(name)
            if i is not None:
                return int(i)
        return None

    @property
    def bos(self) -> Optional[int]:
        return self._find_special("bos_token", _BOS_CANDIDATES)

    def token_id(self, token: str) -> Optional[int]:
        i = self._tok.token_to_id(token)
        return None if i is None else int(i)

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self._tok.encode(text).ids, dtype=np.int64)

    def decode(self, ids) -> str:
        return self._tok.decode([int(i) for i in np.asarray(ids).tolist()], skip_special_tokens=False)

    def __reduce__(self):  # workers reload from the files instead of pickling Rust state
        return (HFTokenizer, (self.directory, self.eod, self.file))


class GPT2BPETokenizer(HFTokenizer):
    """GPT-2 byte-level BPE from ``vocab.json`` + ``merges.txt`` (Megatron's GPT2BPETokenizer).

    Built with the ``tokenizers`` library the way HF's GPT2TokenizerFast is: byte-level
    pre-tokenizer without a prefix space, no post-processor; eod = ``<|endoftext|>``.
    """

    name = "GPT2BPETokenizer"

    def __init__(self, vocab_file: str, merges_file: str, eod: Optional[int] = None):
        for flag, path in (("--vocab-file", vocab_file), ("--merges-file", merges_file)):
            if not path:
                raise UserError(f"{flag}: required with --tokenizer-type GPT2BPETokenizer")
            if not os.path.isfile(path):
                raise DataFileError(path, f"file not found ({flag})")
        tk = _import_tokenizers()
        self.vocab_file, self.merges_file, self.directory, self.file = vocab_file, merges_file, None, None
        try:
            model = tk.models.BPE.from_file(vocab_file, merges_file)
        except Exception as err:
            raise DataFileError(vocab_file, f"cannot be read as a GPT-2 vocab with {merges_file}: {err}") from None
        self._tok = tk.Tokenizer(model)
        self._tok.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
        self._tok.decoder = tk.decoders.ByteLevel()
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        end = self._tok.token_to_id("<|endoftext|>")
        self.eod = int(eod) if eod is not None else end
        if self.eod is None:
            raise DataFileError(vocab_file, "has no <|endoftext|> token; pass --eos_token or --eod-id")
        self.pad = None

    def _config(self) -> dict:
        return {"bos_token": "<|endoftext|>"}

    def __reduce__(self):
        return (GPT2BPETokenizer, (self.vocab_file, self.merges_file, self.eod))


class NullTokenizer:
    """Megatron's NullTokenizer: the text is space-separated ids; eod = vocab_size - 1."""

    name = "NullTokenizer"
    bos = None
    pad = None

    def __init__(self, vocab_size: int):
        self.vocab_size = int(vocab_size)
        self.eod = self.vocab_size - 1

    def encode(self, text: str) -> np.ndarray:
        try:
            return np.asarray([int(x) for x in text.split(" ")], dtype=np.int64)
        except ValueError:
            raise UserError(f"NullTokenizer: the text must be space-separated integers, got {text[:40]!r}") from None

    def decode(self, ids) -> str:
        return " ".join(str(int(i)) for i in np.asarray(ids).tolist())

    def token_id(self, token: str) -> Optional[int]:
        return None


class SpecialTokens:
    """A tokenizer with --eos_token, --add_bos_token and --add_eos_token applied (MindFormers' flags).

    ``eos_token`` names the end-of-document token; add_bos/add_eos put the bos/eos id around
    every encoded text where the tokenizer's own post-processor did not already.
    """

    def __init__(self, inner, eos_token: Optional[str] = None, add_bos: bool = False, add_eos: bool = False):
        self.inner, self.eos_token, self.add_bos, self.add_eos = inner, eos_token, add_bos, add_eos
        self.name, self.vocab_size, self.pad = inner.name, inner.vocab_size, getattr(inner, "pad", None)
        self.eod = inner.eod
        if eos_token is not None:
            i = inner.token_id(eos_token)
            if i is None:
                raise UserError(f"--eos_token: {eos_token!r} is not a token of the {inner.name} vocabulary")
            self.eod = i
        self.bos = getattr(inner, "bos", None)
        if add_bos and self.bos is None:
            raise UserError(f"--add_bos_token: the {inner.name} tokenizer has no beginning-of-text token")

    def encode(self, text: str) -> np.ndarray:
        ids = self.inner.encode(text)
        head = [self.bos] if self.add_bos and not (len(ids) and ids[0] == self.bos) else []
        tail = [self.eod] if self.add_eos and not (len(ids) and ids[-1] == self.eod) else []
        return np.concatenate([np.asarray(head, np.int64), ids, np.asarray(tail, np.int64)]) if head or tail else ids

    def decode(self, ids) -> str:
        return self.inner.decode(ids)


TOKENIZER_TYPES = ("ByteTokenizer", "HuggingFaceTokenizer", "GPT2BPETokenizer", "NullTokenizer", "AutoRegister")


def load_tokenizer(tokenizer_type: Optional[str] = None, tokenizer_dir: Optional[str] = None,
                   eod: Optional[int] = None, *, tokenizer_file: Optional[str] = None,
                   vocab_file: Optional[str] = None, merges_file: Optional[str] = None,
                   vocab_size: Optional[int] = None, eos_token: Optional[str] = None,
                   add_bos_token: bool = False, add_eos_token: bool = False,
                   register_path: Optional[str] = None, auto_register: Optional[str] = None):
    """Build the tokenizer the flags describe; a flag the chosen type does not use is an error.

    Without a type: HuggingFaceTokenizer given --tokenizer-dir or --tokenizer-file,
    GPT2BPETokenizer given --vocab-file and --merges-file, else the built-in ByteTokenizer.
    """
    if tokenizer_type is None:
        tokenizer_type = ("HuggingFaceTokenizer" if tokenizer_dir or tokenizer_file else
                          "GPT2BPETokenizer" if vocab_file or merges_file else
                          "NullTokenizer" if vocab_size is not None else
                          "AutoRegister" if register_path or auto_register else "ByteTokenizer")
    if tokenizer_type not in TOKENIZER_TYPES:
        raise UserError(f"--tokenizer-type: unknown {tokenizer_type!r}; choose one of {', '.join(TOKENIZER_TYPES)}")
    uses = {"ByteTokenizer": set(), "HuggingFaceTokenizer": {"--tokenizer-dir", "--tokenizer-file"},
            "GPT2BPETokenizer": {"--vocab-file", "--merges-file"}, "NullTokenizer": {"--vocab-size"},
            "AutoRegister": {"--register_path", "--auto_register", "--vocab-file", "--merges-file",
                             "--tokenizer-file"}}[tokenizer_type]
    given = {"--tokenizer-dir": tokenizer_dir, "--tokenizer-file": tokenizer_file, "--vocab-file": vocab_file,
             "--merges-file": merges_file, "--vocab-size": vocab_size, "--register_path": register_path,
             "--auto_register": auto_register}
    for flag, value in given.items():
        if value is not None and flag not in uses:
            raise UserError(f"{flag}: not used by --tokenizer-type {tokenizer_type}; drop it or choose the "
                            "tokenizer type it belongs to")
    if tokenizer_type == "AutoRegister":
        from mindtrain.data.user_tokenizer import UserTokenizer

        if eod is not None:
            raise UserError("--eod-id: an AutoRegister tokenizer gives its own eos_token_id; pass --eos_token")
        return UserTokenizer(register_path, auto_register, vocab_file=vocab_file, merges_file=merges_file,
                             tokenizer_file=tokenizer_file, eos_token=eos_token, add_bos_token=add_bos_token,
                             add_eos_token=add_eos_token)
    if tokenizer_type == "ByteTokenizer":
        tok = ByteTokenizer()
    elif tokenizer_type == "HuggingFaceTokenizer":
        if tokenizer_dir and tokenizer_file:
            raise UserError("--tokenizer-file: give either --tokenizer-dir or --tokenizer-file, not both")
        if not (tokenizer_dir or tokenizer_file):
            raise UserError("--tokenizer-dir: required with --tokenizer-type HuggingFaceTokenizer "
                            "(or --tokenizer-file for a single tokenizer.json)")
        tok = HFTokenizer(tokenizer_dir, eod if eos_token is None else None, file=tokenizer_file)
    elif tokenizer_type == "GPT2BPETokenizer":
        tok = GPT2BPETokenizer(vocab_file, merges_file, eod if eos_token is None else None)
    else:
        if vocab_size is None or int(vocab_size) < 1:
            raise UserError(f"--vocab-size: a positive size is required with NullTokenizer, got {vocab_size}")
        tok = NullTokenizer(vocab_size)
    if eod is not None and eos_token is not None:
        raise UserError("--eod-id: give either --eod-id or --eos_token, not both")
    if eod is not None and tokenizer_type in ("ByteTokenizer", "NullTokenizer"):
        tok.eod = int(eod)
    if eos_token is not None or add_bos_token or add_eos_token:
        return SpecialTokens(tok, eos_token, add_bos_token, add_eos_token)
    return tok
