"""``mindtrain-plot RUN_DIR``: a PNG of the loss and grad-norm curves of a run."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Optional, Sequence

from mindtrain.trainer.metrics import read_metrics


def _num(v) -> float:
    return float(v)  # "nan"/"inf" strings written for non-finite values parse here too


def plot_run(path: str, out: Optional[str] = None) -> str:
    """Write the curves of the run at ``path`` (run folder, metrics dir or file); return the PNG path."""
    try:
        import matplotlib
    except ImportError:
        raise SystemExit("mindtrain-plot needs matplotlib: pip install 'mindtrain-trainer[plot]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = read_metrics(path)
    if not records:
        raise SystemExit(f"mindtrain-plot: '{path}' has no metrics records yet")
    steps = [r["step"] for r in records]
    fig, (ax_loss, ax_norm) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    ax_loss.plot(steps, [_num(r["loss"]) for r in records], label="loss")
    for extra in ("lm_loss", "load_balancing_loss", "mtp_loss"):
        if extra in records[0]:
            ax_loss.plot(steps, [_num(r[extra]) for r in records], label=extra, linewidth=0.8)
    ax_loss.set_ylabel("loss")
    ax_loss.legend()
    ax_norm.plot(steps, [_num(r["grad_norm"]) for r in records], color="tab:red")
    ax_norm.set_ylabel("grad_norm")
    ax_norm.set_xlabel("step")
    fig.tight_layout()
    if out is None:
        folder = path if os.path.isdir(path) else os.path.dirname(path) or "."
        out = os.path.join(folder, "curves.png")
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="mindtrain-plot", description=__doc__)
    parser.add_argument("run_dir", help="run folder (holding metrics.jsonl), the metrics_dir, or the file")
    parser.add_argument("-o", "--output", help="PNG path (default: <run_dir>/curves.png)")
    args = parser.parse_args(argv)
    if not os.path.exists(args.run_dir):
        print(f"mindtrain-plot: '{args.run_dir}' does not exist", file=sys.stderr)
        return 2
    try:
        out = plot_run(args.run_dir, args.output)
    except (FileNotFoundError, KeyError, ValueError) as err:
        print(f"mindtrain-plot: {err}", file=sys.stderr)
        return 2
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
