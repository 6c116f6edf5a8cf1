"""``hatch run quickstart``: the quick start on bundled data, end to end, on this machine.

1. Builds a small real-text corpus from the Python language reference that every Python
   ships (``pydoc_data.topics``) as ``run_data/pydoc.jsonl``.
2. Preprocesses it with the built-in byte-level tokenizer into
   ``run_data/pydoc_text_document.bin/.idx`` (the tiny config's data_path).
3. Launches ``msrun --worker_num=2 --local_worker_num=2 --master_port=8118 --join=True
   --log_dir=./msrun_log run_mindformer.py --config configs/pynative_ds3_tiny.yaml --mode 1``
   and shows rank 0's per-step lines as they appear in ``msrun_log/worker_0.log``.

Extra arguments are passed to run_mindformer.py (e.g. ``--override training.steps=20``).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from typing import Optional, Sequence

DATA_DIR = "run_data"
PREFIX = os.path.join(DATA_DIR, "pydoc")
CONFIG = os.path.join("configs", "pynative_ds3_tiny.yaml")
LOG_DIR = "msrun_log"
SHOWN = ("{ step:", "mindtrain:", "run_mindformer.py:")


def write_corpus(path: str) -> int:
    """One JSON line per language-reference topic, in a fixed order; returns the count."""
    from pydoc_data.topics import topics

    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for name in sorted(topics):
            f.write(json.dumps({"text": topics[name]}) + "\n")
    return len(topics)


def prepare_data(prefix: str = PREFIX) -> str:
    """Corpus + .bin/.idx under ``prefix``; returns the dataset prefix (with _text_document)."""
    jsonl = prefix + ".jsonl"
    count = write_corpus(jsonl)
    from mindtrain.data import preprocess

    out = prefix + "_text_document"
    preprocess(input=jsonl, output_prefix=prefix, tokenizer="byte", append_eod=True, workers=1)
    print(f"quickstart: {count} documents from pydoc_data.topics -> {out}.bin/.idx (byte tokenizer)")
    return out


def msrun_command(extra: Sequence[str], worker_num: int = 2, master_port: int = 8118,
                  log_dir: str = LOG_DIR, config: str = CONFIG) -> list[str]:
    return ["msrun", f"--worker_num={worker_num}", f"--local_worker_num={worker_num}",
            f"--master_port={master_port}", "--join=True", f"--log_dir={log_dir}",
            "run_mindformer.py", "--config", config, "--mode", "1", *extra]


def port_is_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port(preferred: int) -> int:
    """``preferred`` when nothing listens there, else a port the OS hands out."""
    if port_is_free(preferred):
        return preferred
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker_env() -> dict:
    """os.environ with this interpreter's bin first on PATH (msrun starts bare ``python``)."""
    env = dict(os.environ)
    # msrun and the workers must come from this interpreter's environment.
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    return env


def run_and_show(cmd: Sequence[str], log_dir: str, console_log: str) -> int:
    """Run msrun, echoing rank 0's step lines while it runs; return msrun's exit status."""
    worker0 = os.path.join(log_dir, "worker_0.log")
    if os.path.exists(worker0):
        os.remove(worker0)
    os.makedirs(log_dir, exist_ok=True)
    print("quickstart: " + " ".join(cmd))
    with open(console_log, "w") as console:
        proc = subprocess.Popen(cmd, stdout=console, stderr=subprocess.STDOUT, env=worker_env())
        pos = 0
        while True:
            done = proc.poll() is not None
            if os.path.exists(worker0):
                with open(worker0, encoding="utf-8", errors="replace") as f:
                    f.seek(pos)
                    chunk = f.read()
                    # only whole lines; a partial last line waits for the next poll
                    cut = chunk.rfind("\n") + 1 if not done else len(chunk)
                    pos += len(chunk[:cut].encode("utf-8", errors="replace"))
                    for line in chunk[:cut].splitlines():
                        if line.startswith(SHOWN):
                            print(line, flush=True)
            if done:
                return proc.returncode
            time.sleep(0.5)


def main(argv: Optional[Sequence[str]] = None) -> int:
    extra = list(sys.argv[1:] if argv is None else argv)
    if not os.path.isfile("run_mindformer.py") or not os.path.isfile(CONFIG):
        print("quickstart: run it from the repository root (where run_mindformer.py and configs/ are)",
              file=sys.stderr)
        return 2
    prepare_data()
    console_log = os.path.join(LOG_DIR, "msrun_console.log")
    start = time.time()
    port = free_port(8118)
    if port != 8118:
        print(f"quickstart: port 8118 is in use on this machine; using --master_port={port}")
    status = run_and_show(msrun_command(extra, master_port=port), LOG_DIR, console_log)
    took = time.time() - start
    if status != 0:
        print(f"quickstart: msrun failed with status {status} after {took:.0f} s; see {LOG_DIR}/worker_*.log "
              f"and {console_log}", file=sys.stderr)
        return 1
    print(f"quickstart: done in {took:.0f} s; logs in {LOG_DIR}/, metrics under ./output/metrics "
          f"(plot with: hatch run mindtrain-plot output/metrics)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
