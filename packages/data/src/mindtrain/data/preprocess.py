"""json/jsonl -> ``<prefix>_<key>_document.bin/.idx``, as Megatron-LM's preprocess_data.py."""

from __future__ import annotations

import argparse
import glob
import gzip
import io
import json
import multiprocessing
import os
import sys
import time
from typing import Iterable, Iterator, Optional, Sequence

import numpy as np

from mindtrain.data.errors import DataFileError, UserError
from mindtrain.data.indexed import IndexedDatasetBuilder, optimal_dtype
from mindtrain.data.tokenizer import TOKENIZER_TYPES, load_tokenizer

_CHUNK = 64


def expand_inputs(inputs: Iterable[str]) -> list:
    """Files named directly or by glob, in the given order (each glob sorted)."""
    files = []
    for pattern in inputs:
        matches = sorted(glob.glob(pattern)) if glob.has_magic(pattern) else [pattern]
        if not matches:
            raise DataFileError(pattern, "matches no file")
        for m in matches:
            if not os.path.isfile(m):
                raise DataFileError(m, "input file not found")
            files.append(m)
    return files


def _open_text(path: str):
    raw = gzip.open(path, "rb") if path.endswith(".gz") else open(path, "rb")
    return io.TextIOWrapper(raw, encoding="utf-8", errors="strict")


def iter_records(path: str) -> Iterator[tuple]:
    """(path, line number, raw text) of every non-blank line; a JSON array file gives its items."""
    with _open_text(path) as f:
        try:
            first, blank_lines = f.read(1), 0
            while first and first.isspace():
                blank_lines += first == "\n"
                first = f.read(1)
            if first == "[":
                try:
                    items = json.loads(first + f.read())
                except json.JSONDecodeError as err:
                    raise DataFileError(path, f"invalid JSON array: {err}") from None
                for i, item in enumerate(items, 1):
                    yield path, i, item
                return
            line_no, pending = blank_lines, first
            for line in f:
                line_no += 1
                line, pending = pending + line, ""
                if line.strip():
                    yield path, line_no, line
            if pending.strip():
                yield path, line_no + 1, pending
        except UnicodeDecodeError as err:
            raise DataFileError(path, f"is not UTF-8 text ({err.reason} at byte {err.start})") from None
        except (OSError, EOFError) as err:
            raise DataFileError(path, f"cannot be read: {err}") from None


class _Encoder:
    """Turns one record into token ids per json key (runs in worker processes)."""

    tokenizer = None

    def __init__(self, tokenizer, json_keys: Sequence[str], append_eod: bool):
        self.json_keys, self.append_eod = list(json_keys), append_eod
        _Encoder.tokenizer = tokenizer

    def __call__(self, record):
        path, line_no, raw = record
        if isinstance(raw, str):
            try:
                obj = json.loads(raw)
            except json.JSONDecodeError as err:
                return path, line_no, None, f"invalid JSON ({err.msg} at column {err.colno})"
        else:
            obj = raw
        if not isinstance(obj, dict):
            return path, line_no, None, f"expected a JSON object, got {type(obj).__name__}"
        out = []
        for key in self.json_keys:
            if key not in obj:
                return path, line_no, None, f"missing key {key!r}"
            text = obj[key]
            parts = text if isinstance(text, list) else [text]
            if not all(isinstance(p, str) for p in parts):
                return path, line_no, None, f"{key!r} must be a string or a list of strings"
            ids, lengths = [], []
            for p in parts:
                t = _Encoder.tokenizer.encode(p)
                if len(t):
                    ids.append(t)
                    lengths.append(len(t))
            if ids and self.append_eod:
                ids.append(np.array([_Encoder.tokenizer.eod], dtype=np.int64))
                lengths[-1] += 1
            out.append((np.concatenate(ids) if ids else np.empty(0, dtype=np.int64), lengths))
        return path, line_no, out, None


def _init_worker(encoder):
    global _WORKER_ENCODER
    _WORKER_ENCODER = encoder


def _encode_in_worker(record):
    return _WORKER_ENCODER(record)


def _progress(enabled: bool, total_files: int):
    if not enabled:
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(unit=" docs", desc=f"tokenizing {total_files} file(s)", file=sys.stderr, mininterval=0.5)


def preprocess(inputs=None, output_prefix: Optional[str] = None, tokenizer=None, append_eod: bool = True,
               workers: int = 1, json_keys: Sequence[str] = ("text",), on_error: str = "fail",
               progress: bool = False, log=None, input=None) -> dict:
    """Tokenize json/jsonl(.gz) files into Megatron .bin/.idx pairs; returns a summary dict.

    ``inputs``: a path/glob or a list of them (``input`` is accepted as an alias).
    ``tokenizer``: a tokenizer object, "byte"/"ByteTokenizer", a HuggingFace tokenizer
    directory, or None for the byte tokenizer.

    Writes ``<output_prefix>_<key>_document.bin/.idx`` per json key (atomically: files appear
    complete or not at all). Bad records raise DataFileError naming file and line, or are
    skipped and counted with ``on_error="skip"``.
    """
    inputs = input if inputs is None else inputs
    if inputs is None or output_prefix is None:
        raise TypeError("preprocess() needs inputs and output_prefix")
    if isinstance(inputs, (str, os.PathLike)):
        inputs = [os.fspath(inputs)]
    if isinstance(tokenizer, str):
        tokenizer = (load_tokenizer("ByteTokenizer") if tokenizer.lower() in ("byte", "bytetokenizer")
                     else load_tokenizer("HuggingFaceTokenizer", tokenizer))
    if on_error not in ("skip", "fail"):
        raise UserError(f"--on-error: must be skip or fail, got {on_error!r}")
    tokenizer = tokenizer if tokenizer is not None else load_tokenizer()
    files = expand_inputs(inputs)
    out_dir = os.path.dirname(os.path.abspath(output_prefix))
    if not os.path.isdir(out_dir):
        os.makedirs(out_dir, exist_ok=True)
    dtype = optimal_dtype(tokenizer.vocab_size)
    finals = {k: f"{output_prefix}_{k}_document" for k in json_keys}
    tmps = {k: f"{p}.tmp{os.getpid()}" for k, p in finals.items()}
    builders = {k: IndexedDatasetBuilder(tmps[k] + ".bin", dtype=dtype) for k in json_keys}
    encoder = _Encoder(tokenizer, json_keys, append_eod)
    records = (r for path in files for r in iter_records(path))
    bar = _progress(progress, len(files))
    docs = tokens = skipped = 0
    errors = []
    t0 = time.perf_counter()
    pool = None
    try:
        if workers > 1:
            pool = multiprocessing.get_context().Pool(workers, initializer=_init_worker, initargs=(encoder,))
            results = pool.imap(_encode_in_worker, records, _CHUNK)
        else:
            results = map(encoder, records)
        for path, line_no, out, error in results:
            if error is not None:
                if on_error == "fail":
                    raise DataFileError(f"{path}:{line_no}", f"{error}; fix the record or pass --on-error skip")
                skipped += 1
                if len(errors) < 20:
                    errors.append(f"{path}:{line_no}: {error}")
                continue
            for key, (ids, lengths) in zip(json_keys, out):
                builders[key].add_document(ids, lengths)
                tokens += len(ids)
            docs += 1
            if bar is not None:
                bar.update(1)
        for key, b in builders.items():
            b.finalize(tmps[key] + ".idx")
            for ext in (".bin", ".idx"):
                os.replace(tmps[key] + ext, finals[key] + ext)
    finally:
        if pool is not None:
            pool.terminate()
            pool.join()
        if bar is not None:
            bar.close()
        for key, b in builders.items():
            b.data_file.close()
            for ext in (".bin", ".idx"):
                if os.path.exists(tmps[key] + ext):
                    os.remove(tmps[key] + ext)
    seconds = time.perf_counter() - t0
    summary = {"documents": docs, "tokens": tokens, "dtype": np.dtype(dtype).name, "eod": tokenizer.eod,
               "vocab_size": tokenizer.vocab_size, "tokenizer": tokenizer.name,
               "outputs": list(finals.values()), "skipped": skipped, "skipped_examples": errors,
               "seconds": round(seconds, 3), "tokens_per_second": round(tokens / seconds) if seconds else 0}
    if log is not None:
        for e in errors:
            log(f"skipped {e}")
        log(f"documents: {docs}  tokens: {tokens}  dtype: {summary['dtype']}  eod id: {tokenizer.eod}  "
            f"skipped: {skipped}  ({summary['tokens_per_second']} tokens/s)")
        for p in finals.values():
            log(f"wrote {p}.bin and {p}.idx")
    return summary


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="mindtrain-preprocess",
                                 description="Tokenize json/jsonl files into Megatron .bin/.idx datasets.")
    ap.add_argument("--input", nargs="+", required=True, help="json/jsonl files or globs; .gz is read too")
    ap.add_argument("--json-keys", nargs="+", default=["text"], help="keys to tokenize (default: text)")
    ap.add_argument("--output-prefix", required=True, help="writes <prefix>_<key>_document.bin/.idx")
    ap.add_argument("--tokenizer-type", choices=TOKENIZER_TYPES, default=None,
                    help="HuggingFaceTokenizer with --tokenizer-dir, or the built-in ByteTokenizer (default)")
    ap.add_argument("--tokenizer-dir", default=None, help="folder holding a HuggingFace tokenizer.json")
    ap.add_argument("--eod-id", type=int, default=None, help="override the end-of-document id")
    ap.add_argument("--append-eod", action="store_true", help="append the eod token to every document")
    ap.add_argument("--workers", type=int, default=1, help="tokenizer processes (default 1)")
    ap.add_argument("--on-error", choices=("skip", "fail"), default="fail",
                    help="bad records: stop with file and line (fail, default) or skip and count them")
    ap.add_argument("--quiet", action="store_true", help="no progress bar")
    return ap


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.workers < 1:
            raise UserError(f"--workers: must be >= 1, got {args.workers}")
        tok = load_tokenizer(args.tokenizer_type, args.tokenizer_dir, args.eod_id)
        preprocess(args.input, args.output_prefix, tok, append_eod=args.append_eod, workers=args.workers,
                   json_keys=args.json_keys, on_error=args.on_error, progress=not args.quiet,
                   log=lambda m: print(m, flush=True))
    except UserError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
