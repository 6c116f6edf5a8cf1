"""``--tokenizer-type AutoRegister``: a user's tokenizer class from the folder named by --register_path.

As in MindFormers, ``--auto_register module.ClassName`` names the class; the module is loaded
from ``<register_path>/module.py`` (or ``module/__init__.py``) and from nowhere else, so no flag
or config value can import code from an installed package by name
(:mod:`mindtrain.config.register_path`, the loader the trainer uses too).
"""

from __future__ import annotations

from typing import Optional

import numpy as np

from mindtrain.config.register_path import load_register_class
from mindtrain.data.errors import UserError


def load_class(register_path: Optional[str], auto_register: Optional[str]):
    """The class ``auto_register`` ("module.Class", dots for sub-modules) under ``register_path``
    (mindtrain.config's --register_path loader, the trainer's too)."""
    if not register_path or not auto_register:
        missing = "--register_path" if not register_path else "--auto_register"
        raise UserError(f"{missing}: required with --tokenizer-type AutoRegister (e.g. --register_path "
                        "research/qwen2 --auto_register qwen2_tokenizer.Qwen2Tokenizer)")
    return load_register_class(register_path, auto_register)


class UserTokenizer:
    """Wraps an instance of the user's class: ``obj(text)["input_ids"]`` (or ``obj.encode(text)``),
    ``obj.eos_token_id`` as the eod id, ``obj.vocab_size`` (or ``len(obj)``).

    The class is built with MindFormers' keywords: vocab_file, merges_file, tokenizer_file,
    eos_token (default "</s>"), add_bos_token, add_eos_token.
    """

    name = "AutoRegister"
    pad = None

    def __init__(self, register_path: str, auto_register: str, **kwargs):
        self.register_path, self.auto_register = register_path, auto_register
        self.kwargs = dict(kwargs, eos_token=kwargs.get("eos_token") or "</s>")
        cls = load_class(register_path, auto_register)
        try:
            self._tok = cls(**self.kwargs)
        except Exception as err:
            raise UserError(f"--auto_register: {auto_register}({', '.join(f'{k}=...' for k in self.kwargs)}) "
                            f"failed: {type(err).__name__}: {err}") from None
        eod = getattr(self._tok, "eos_token_id", None)
        if not isinstance(eod, (int, np.integer)):
            raise UserError(f"--auto_register: {auto_register} has no integer eos_token_id; set eos_token")
        self.eod = int(eod)
        size = getattr(self._tok, "vocab_size", None)
        if size is None and hasattr(self._tok, "__len__"):
            size = len(self._tok)
        if not isinstance(size, (int, np.integer)):
            raise UserError(f"--auto_register: {auto_register} has no vocab_size (nor len())")
        self.vocab_size = int(size)

    def encode(self, text: str) -> np.ndarray:
        out = self._tok(text) if callable(self._tok) else self._tok.encode(text)
        ids = out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out
        return np.asarray(ids, dtype=np.int64).reshape(-1)

    def decode(self, ids) -> str:
        return self._tok.decode([int(i) for i in np.asarray(ids).tolist()])

    def __reduce__(self):  # worker processes load the class again from the same folder
        return (_rebuild, (self.register_path, self.auto_register, self.kwargs))


def _rebuild(register_path, auto_register, kwargs):
    return UserTokenizer(register_path, auto_register, **kwargs)
