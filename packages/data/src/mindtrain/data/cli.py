"""``mindtrain-data``: look inside Megatron .bin/.idx datasets."""

from __future__ import annotations

import argparse
import sys
from typing import Optional, Sequence

import numpy as np

from mindtrain.data.errors import exit_status
from mindtrain.data.indexed import IndexedDataset
from mindtrain.data.tokenizer import TOKENIZER_TYPES, load_tokenizer


def inspect_dataset(prefix: str, tokenizer=None, sample: int = 0, max_tokens: int = 200, eod: Optional[int] = None) -> str:
    """A text report: counts, dtype, document length histogram, and a decoded document."""
    ds = IndexedDataset(prefix)
    di = ds.document_indices
    seq_lens = ds.sequence_lengths.astype(np.int64)
    starts = np.concatenate(([0], np.cumsum(seq_lens)))
    doc_lens = starts[di[1:]] - starts[di[:-1]]
    lines = [f"dataset:    {prefix}",
             f"documents:  {len(di) - 1}",
             f"sequences:  {len(ds)}",
             f"tokens:     {ds.num_tokens}",
             f"dtype:      {ds.dtype.name}"]
    if len(doc_lens):
        lines.append(f"doc length: min {doc_lens.min()}  mean {doc_lens.mean():.1f}  "
                     f"median {int(np.median(doc_lens))}  max {doc_lens.max()}")
        edges = [0, 1]
        while edges[-1] <= doc_lens.max():
            edges.append(edges[-1] * 2)
        counts, _ = np.histogram(doc_lens, bins=edges)
        width = max(1, int(counts.max()))
        lines.append("length histogram (tokens per document):")
        for lo, hi, c in zip(edges[:-1], edges[1:], counts):
            if c:
                lines.append(f"  [{lo:>8}, {hi:>8})  {c:>9}  {'#' * max(1, int(40 * c / width))}")
    eod_id = eod if eod is not None else getattr(tokenizer, "eod", None)
    if eod_id is not None and ds.num_tokens:
        n_eod = int(sum(int(np.count_nonzero(ds[i] == eod_id)) for i in range(len(ds))))
        lines.append(f"eod id {eod_id}: {n_eod} occurrences")
    if tokenizer is not None and 0 <= sample < len(di) - 1:
        ids = np.concatenate([ds[j] for j in range(di[sample], di[sample + 1])] or [np.empty(0, ds.dtype)])
        shown = ids[:max_tokens]
        lines.append(f"document {sample} ({len(ids)} tokens, first {len(shown)} decoded):")
        lines.append("  ids:  " + " ".join(str(int(x)) for x in shown[:32]) + (" ..." if len(shown) > 32 else ""))
        lines.append("  text: " + repr(tokenizer.decode(shown)))
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="mindtrain-data", description="Megatron .bin/.idx dataset tools.")
    sub = ap.add_subparsers(dest="command", required=True)
    ins = sub.add_parser("inspect", help="documents, tokens, dtype, length histogram, a decoded sample")
    ins.add_argument("prefix", help="dataset prefix, without .bin/.idx")
    ins.add_argument("--tokenizer-type", choices=TOKENIZER_TYPES, default=None)
    ins.add_argument("--tokenizer-dir", default=None)
    ins.add_argument("--sample", type=int, default=0, help="document to decode (default 0)")
    ins.add_argument("--max-tokens", type=int, default=200)
    ins.add_argument("--eod-id", type=int, default=None, help="count this id")
    args = ap.parse_args(argv)

    def inspect() -> None:
        tok = (load_tokenizer(args.tokenizer_type, args.tokenizer_dir)
               if args.tokenizer_type or args.tokenizer_dir else None)
        print(inspect_dataset(args.prefix, tok, args.sample, args.max_tokens, args.eod_id))

    return exit_status(inspect)


if __name__ == "__main__":
    sys.exit(main())
