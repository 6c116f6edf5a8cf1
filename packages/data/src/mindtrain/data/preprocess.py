"""json/jsonl -> ``<prefix>_<key>_document.bin/.idx``, as Megatron-LM's preprocess_data.py."""

from __future__ import annotations

import argparse
import glob
import gzip
import io
import json
import math
import multiprocessing
import os
import sys
import time
from typing import Iterable, Iterator, Optional, Sequence

import numpy as np

from mindtrain.data.errors import DataFileError, UserError, exit_status
from mindtrain.data.indexed import IndexedDatasetBuilder, optimal_dtype
from mindtrain.data.sentence_splitter import load_splitter, split_sentences
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
    splitters: dict = {}

    def __init__(self, tokenizer, json_keys: Sequence[str], append_eod: bool, split_sentences: bool = False,
                 lang: str = "english", keep_newlines: bool = False):
        self.json_keys, self.append_eod = list(json_keys), append_eod
        self.split = (lang, keep_newlines) if split_sentences else None
        _Encoder.tokenizer = tokenizer

    def _sentences(self, text: str) -> list:
        if self.split not in _Encoder.splitters:  # once per process: Punkt's tables are not worth pickling
            _Encoder.splitters[self.split] = load_splitter(*self.split)
        return split_sentences(_Encoder.splitters[self.split], text)

    def __call__(self, record):
        path, line_no, raw = record
        size = len(raw) if isinstance(raw, str) else 0
        if isinstance(raw, str):
            try:
                obj = json.loads(raw)
            except json.JSONDecodeError as err:
                return path, line_no, None, f"invalid JSON ({err.msg} at column {err.colno})", size
        else:
            obj = raw
        if not isinstance(obj, dict):
            return path, line_no, None, f"expected a JSON object, got {type(obj).__name__}", size
        out = []
        for key in self.json_keys:
            if key not in obj:
                return path, line_no, None, f"missing key {key!r}", size
            text = obj[key]
            if self.split is not None and isinstance(text, str):
                text = self._sentences(text)
            parts = text if isinstance(text, list) else [text]
            if not all(isinstance(p, str) for p in parts):
                return path, line_no, None, f"{key!r} must be a string or a list of strings", size
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
        return path, line_no, out, None, size


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


def _partition_of(partitions: int, sequential: bool, total: int):
    """Record number -> partition, as Megatron deals lines out: round robin, or in contiguous
    blocks of ceil(total / partitions) with --keep-sequential-samples."""
    if partitions == 1:
        return lambda i: 0
    if sequential:
        size = max(1, math.ceil(total / partitions))
        return lambda i: i // size
    return lambda i: i % partitions


def preprocess(inputs=None, output_prefix: Optional[str] = None, tokenizer=None, append_eod: bool = True,
               workers: int = 1, json_keys: Sequence[str] = ("text",), on_error: str = "fail",
               progress: bool = False, log=None, input=None, split_sentences: bool = False,
               lang: str = "english", keep_newlines: bool = False, partitions: int = 1,
               keep_sequential_samples: bool = False, log_interval: Optional[int] = None) -> dict:
    """Tokenize json/jsonl(.gz) files into Megatron .bin/.idx pairs; returns a summary dict.

    ``inputs``: a path/glob or a list of them (``input`` is accepted as an alias).
    ``tokenizer``: a tokenizer object, "byte"/"ByteTokenizer", a HuggingFace tokenizer
    directory, or None for the byte tokenizer.

    Writes ``<output_prefix>_<key>_document.bin/.idx`` per json key (``_sentence`` with
    ``split_sentences``: every sentence one sequence of its document), atomically: files appear
    complete or not at all. ``partitions`` orders the documents as Megatron's --partitions does
    (records dealt round robin, or in contiguous blocks with ``keep_sequential_samples``, then
    the partitions concatenated); the tokenizing itself runs on ``workers`` processes. Bad
    records raise DataFileError naming file and line, or are skipped and counted with
    ``on_error="skip"``. ``log_interval``: a "Processed N documents" line on stderr every N.
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
    checks = (("--workers", workers), ("--partitions", partitions),
              ("--log-interval", 1 if log_interval is None else log_interval))
    for flag, value in checks:
        if int(value) < 1:
            raise UserError(f"{flag}: must be >= 1, got {value}")
    if workers % partitions:
        raise UserError(f"--workers: {workers} must be a multiple of --partitions ({partitions}), "
                        "as in Megatron-LM (each partition gets workers/partitions processes)")
    if split_sentences:
        load_splitter(lang, keep_newlines)  # a missing nltk or punkt_tab stops here, before any work
    tokenizer = tokenizer if tokenizer is not None else load_tokenizer()
    files = expand_inputs(inputs)
    out_dir = os.path.dirname(os.path.abspath(output_prefix))
    if not os.path.isdir(out_dir):
        os.makedirs(out_dir, exist_ok=True)
    dtype = optimal_dtype(tokenizer.vocab_size)
    level = "sentence" if split_sentences else "document"
    finals = {k: f"{output_prefix}_{k}_{level}" for k in json_keys}
    tmps = {(k, p): f"{f}.tmp{os.getpid()}" + (f"_{p}" if partitions > 1 else "")
            for k, f in finals.items() for p in range(partitions)}
    builders = {kp: IndexedDatasetBuilder(t + ".bin", dtype=dtype) for kp, t in tmps.items()}
    total = sum(1 for path in files for _ in iter_records(path)) if partitions > 1 and keep_sequential_samples else 0
    part = _partition_of(partitions, keep_sequential_samples, total)
    encoder = _Encoder(tokenizer, json_keys, append_eod, split_sentences, lang, keep_newlines)
    records = (r for path in files for r in iter_records(path))
    bar = _progress(progress, len(files))
    docs = tokens = skipped = seen = nbytes = 0
    errors = []
    t0 = time.perf_counter()
    pool = None
    merged = []
    try:
        if workers > 1:
            pool = multiprocessing.get_context().Pool(workers, initializer=_init_worker, initargs=(encoder,))
            results = pool.imap(_encode_in_worker, records, _CHUNK)
        else:
            results = map(encoder, records)
        for path, line_no, out, error, size in results:
            p = part(seen)
            seen += 1
            nbytes += size
            if error is not None:
                if on_error == "fail":
                    raise DataFileError(f"{path}:{line_no}", f"{error}; fix the record or pass --on-error skip")
                skipped += 1
                if len(errors) < 20:
                    errors.append(f"{path}:{line_no}: {error}")
                continue
            for key, (ids, lengths) in zip(json_keys, out):
                builders[key, p].add_document(ids, lengths)
                tokens += len(ids)
            docs += 1
            if bar is not None:
                bar.update(1)
            if log_interval and docs % log_interval == 0:
                elapsed = max(time.perf_counter() - t0, 1e-9)
                print(f"Processed {docs} documents ({docs / elapsed:.1f} docs/s, "
                      f"{nbytes / elapsed / 1024 / 1024:.2f} MB/s).", file=sys.stderr, flush=True)
        for kp, b in builders.items():
            b.finalize(tmps[kp] + ".idx")
        for key, final in finals.items():
            if partitions > 1:  # concatenate the partitions in order, as Megatron's merge step does
                merged.append(f"{final}.tmp{os.getpid()}")
                whole = IndexedDatasetBuilder(merged[-1] + ".bin", dtype=dtype)
                try:
                    for p in range(partitions):
                        whole.add_index(tmps[key, p])
                    whole.finalize(merged[-1] + ".idx")
                finally:
                    whole.data_file.close()
                source = merged[-1]
            else:
                source = tmps[key, 0]
            for ext in (".bin", ".idx"):
                os.replace(source + ext, final + ext)
    finally:
        if pool is not None:
            pool.terminate()
            pool.join()
        if bar is not None:
            bar.close()
        for b in builders.values():
            b.data_file.close()
        for t in [*tmps.values(), *merged]:
            for ext in (".bin", ".idx"):
                if os.path.exists(t + ext):
                    os.remove(t + ext)
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


def _flag_bool(value: str) -> bool:
    """MindFormers passes --add_bos_token/--add_eos_token a value; a bare flag means true."""
    low = str(value).strip().lower()
    if low in ("true", "1", "yes"):
        return True
    if low in ("false", "0", "no"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {value!r}")


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="mindtrain-preprocess",
                                 description="Tokenize json/jsonl files into Megatron .bin/.idx datasets "
                                             "(the flags of MindFormers' and Megatron-LM's preprocessing scripts).")
    g = ap.add_argument_group("input data")
    g.add_argument("--input", nargs="+", required=True, help="json/jsonl files or globs; .gz is read too")
    g.add_argument("--json-keys", nargs="+", default=["text"], help="keys to tokenize, one output per key")
    g.add_argument("--split-sentences", action="store_true",
                   help="one sequence per sentence (NLTK punkt; needs mindtrain-data[sentences])")
    g.add_argument("--keep-newlines", action="store_true", help="keep newlines between split sentences")
    g.add_argument("--lang", default=None, help="punkt language for --split-sentences (default english)")
    g = ap.add_argument_group("tokenizer")
    g.add_argument("--tokenizer-type", choices=TOKENIZER_TYPES, default=None,
                   help="default: HuggingFaceTokenizer given --tokenizer-dir/--tokenizer-file, GPT2BPETokenizer "
                        "given --vocab-file/--merges-file, else the built-in ByteTokenizer")
    g.add_argument("--tokenizer-dir", "--tokenizer-model", dest="tokenizer_dir", default=None,
                   help="folder holding a HuggingFace tokenizer.json")
    g.add_argument("--tokenizer-file", default=None, help="a single HuggingFace tokenizer.json")
    g.add_argument("--vocab-file", default=None, help="GPT-2 BPE vocab.json (or passed to an AutoRegister class)")
    g.add_argument("--merges-file", "--merge-file", dest="merges_file", default=None,
                   help="GPT-2 BPE merges.txt (or passed to an AutoRegister class)")
    g.add_argument("--vocab-size", type=int, default=None, help="vocabulary size of the NullTokenizer")
    g.add_argument("--eos_token", default=None, help="the end-of-document token (default: the tokenizer's)")
    g.add_argument("--add_bos_token", type=_flag_bool, nargs="?", const=True, default=False,
                   help="put the bos token before every text (true/false)")
    g.add_argument("--add_eos_token", type=_flag_bool, nargs="?", const=True, default=False,
                   help="put the eos token after every text (true/false)")
    g.add_argument("--register_path", default=None, help="AutoRegister: folder holding the tokenizer module")
    g.add_argument("--auto_register", default=None, help="AutoRegister: module.ClassName inside --register_path")
    g.add_argument("--eod-id", type=int, default=None, help="override the end-of-document id")
    g.add_argument("--append-eod", action="store_true", help="append the eod token to every document")
    g = ap.add_argument_group("output data")
    g.add_argument("--output-prefix", required=True, help="writes <prefix>_<key>_document.bin/.idx")
    g = ap.add_argument_group("runtime")
    g.add_argument("--workers", type=int, default=1, help="tokenizer processes (default 1)")
    g.add_argument("--partitions", type=int, default=1,
                   help="Megatron's file partitions: documents dealt round robin into this many parts, "
                        "then concatenated (order kept with --keep-sequential-samples)")
    g.add_argument("--keep-sequential-samples", action="store_true",
                   help="with --partitions: contiguous blocks, so the input order is kept")
    g.add_argument("--log-interval", type=int, default=None,
                   help="print 'Processed N documents' on stderr every N documents")
    g.add_argument("--on-error", choices=("skip", "fail"), default="fail",
                   help="bad records: stop with file and line (fail, default) or skip and count them")
    g.add_argument("--quiet", action="store_true", help="no progress bar")
    return ap


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = _parser().parse_args(argv)

    def run() -> None:
        if not args.split_sentences:
            for flag, given in (("--keep-newlines", args.keep_newlines), ("--lang", args.lang is not None)):
                if given:
                    raise UserError(f"{flag}: only applies with --split-sentences")
        tok = load_tokenizer(args.tokenizer_type, args.tokenizer_dir, args.eod_id,
                             tokenizer_file=args.tokenizer_file, vocab_file=args.vocab_file,
                             merges_file=args.merges_file, vocab_size=args.vocab_size, eos_token=args.eos_token,
                             add_bos_token=args.add_bos_token, add_eos_token=args.add_eos_token,
                             register_path=args.register_path, auto_register=args.auto_register)
        preprocess(args.input, args.output_prefix, tok, append_eod=args.append_eod, workers=args.workers,
                   json_keys=args.json_keys, on_error=args.on_error, progress=not args.quiet,
                   log=lambda m: print(m, flush=True), split_sentences=args.split_sentences,
                   lang=args.lang or "english", keep_newlines=args.keep_newlines, partitions=args.partitions,
                   keep_sequential_samples=args.keep_sequential_samples, log_interval=args.log_interval)

    return exit_status(run)


if __name__ == "__main__":
    sys.exit(main())
