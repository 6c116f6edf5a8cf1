"""Command-line mistakes end with one line on stderr and exit status 2 (no MindSpore start-up)."""

import os
import subprocess
import sys

import pytest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
TINY = os.path.join(ROOT, "configs", "pynative_ds3_tiny.yaml")


def run(*args, cwd=ROOT):
    return subprocess.run([sys.executable, os.path.join(ROOT, "run_mindformer.py"), *args], cwd=cwd,
                          capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("args, needle", [
    (["--config", TINY], "--mode is required"),
    (["--config", TINY, "--mode", "0"], "only eager mode is (pass --mode 1)"),
    (["--mode", "1"], "--config is required"),
    (["--config", "nope.yaml", "--mode", "1"], "config file 'nope.yaml' does not exist"),
    (["--config", TINY, "--mode", "1", "--override", "training.stepz=3"], "training.stepz: unknown key (did you mean 'steps'?)"),
    (["--config", TINY, "--mode", "1", "--override", "model.seq_length=128"], "seq_length: 256 must equal model.seq_length (128)"),
    (["--config", TINY, "--mode", "1", "--override", "training.steps"], "must look like section.field=value"),
    (["--config", TINY, "--mode", "1", "--bogus"], "unrecognized arguments: --bogus"),
])
def test_one_line_and_status_2(args, needle):
    r = run(*args)
    assert r.returncode == 2, r.stderr
    assert r.stderr.count("\n") == 1 and "Traceback" not in r.stderr, r.stderr
    assert needle in r.stderr
    assert r.stdout == ""


def test_scheduler_message_names_the_lost_rank():
    from mindtrain.trainer.runtime import scheduler_message

    text = ("The total number of timed out node is 1. Timed out node list is: [const vector]{1}, worker 1 is "
            "the first one timed out, please check its log.\nmore")
    assert scheduler_message(text) == ("msrun scheduler: worker rank 1 stopped responding (it died or hung), so "
                                       "the job is ending; see its log worker_1.log")
