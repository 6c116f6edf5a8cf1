"""The command line takes MindFormers' run_mindformer.py flags; mistakes end with one line on
stderr and exit status 2 (no MindSpore start-up)."""

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
    (["--config", TINY, "--mode", "1", "--use_parallel", "yes"], "argument --use_parallel: expected True or False, got 'yes'"),
    (["--config", TINY, "--mode", "1", "--seed", "x"], "argument --seed: invalid int value: 'x'"),
    (["--config", TINY, "--mode", "1", "--run_mode", "serve"], "--run_mode must be one of train, finetune"),
    (["--config", TINY, "--mode", "1", "--resume_training", "ck-10.ckpt"], "only True or False is accepted"),
    (["--config", TINY, "--mode", "1", "--register_path", "no_such_dir"], "--register_path: folder 'no_such_dir' does not exist"),
    (["--config", TINY, "--mode", "1", "--train_dataset_dir", "/data"], "--train_dataset_dir applies to train_dataset.dataloader.type MindDataset"),
    (["--config", TINY, "--mode", "1", "--options", "training.stepz=3"], "training.stepz: unknown key (did you mean 'steps'?)"),
    (["--config", TINY, "--mode", "1", "--options", "training.steps"], "--options 'training.steps' must look like section.field=value"),
    (["--config", TINY, "--mode", "1", "--training.stepz", "3"], "training.stepz: unknown key"),
    (["--config", TINY, "--mode", "1", "--resume_training", "True"], "--resume_training True: there is no checkpoint to load"),
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


# Every flag of MindFormers' run_mindformer.py (mindspore-ai/mindformers, HEAD), in its order.
MINDFORMERS_FLAGS = [
    ("config", "c.yaml"), ("mode", "1"), ("device_id", "0"), ("device_target", "CPU"), ("run_mode", "train"),
    ("do_eval", "False"), ("train_dataset_dir", None), ("eval_dataset_dir", "/e"), ("predict_data", "a b"),
    ("modal_type", "text"), ("predict_batch_size", "2"), ("adapter_id", "x"), ("load_checkpoint", "/ck"),
    ("src_strategy_path_or_dir", "/s"), ("auto_trans_ckpt", "True"), ("transform_process_num", "2"),
    ("only_save_strategy", "false"), ("resume_training", "True"), ("strategy_load_checkpoint", "/s"),
    ("remote_save_url", "obs://x"), ("seed", "3"), ("use_parallel", "TRUE"), ("profile", "False"),
    ("options", "training.steps=4"), ("epochs", "1"), ("batch_size", "1"), ("gradient_accumulation_steps", "1"),
    ("sink_mode", "False"), ("num_samples", "8"), ("output_dir", "/out"), ("register_path", None),
    ("do_sample", "False"), ("trust_remote_code", "False"),
]


def test_every_mindformers_flag_is_accepted_and_the_idle_ones_are_named():
    from mindtrain.trainer.cli import NO_EFFECT_FLAGS, ignored_flags, parse_args

    argv = [t for name, value in MINDFORMERS_FLAGS if value is not None for t in (f"--{name}", *value.split())]
    args = parse_args(argv)
    assert args.use_parallel is True and args.do_eval is False and args.resume_training is True
    assert args.predict_data == ["a", "b"] and args.seed == 3 and args.options == ["training.steps=4"]
    ignored = ignored_flags(args)
    assert ignored[:3] == ["--device_id 0", "--run_mode train", "--do_eval False"]
    assert "--predict_data a b" in ignored and "--use_parallel True" in ignored
    assert len(ignored) == len(NO_EFFECT_FLAGS) == 23
    acting = {"config", "mode", "device_target", "train_dataset_dir", "load_checkpoint", "resume_training", "seed",
              "options", "output_dir", "register_path"}
    assert {n for n, _ in MINDFORMERS_FLAGS} == acting | {n for n, _, _ in NO_EFFECT_FLAGS}
    assert ignored_flags(parse_args(["--config", "c.yaml", "--mode", "1"])) == []


def _load(*argv, base_dir=None):
    from mindtrain.trainer.cli import load_with_flags, parse_args

    return load_with_flags(parse_args(["--config", TINY, "--mode", "1", *argv]), base_dir)


def test_acting_flags_set_the_config():
    cfg = _load("--seed", "7", "--load_checkpoint", "/ck/iter_0000002", "--device_target", "CPU")
    assert (cfg.training.seed, cfg.checkpoint.load_path, cfg.context.device_target) == (7, "/ck/iter_0000002", "CPU")
    assert cfg.checkpoint.no_load_optim is False
    ck = ("--load_checkpoint", "/ck")
    assert _load(*ck, "--resume_training", "False").checkpoint.no_load_optim is True  # weights only
    assert _load(*ck, "--resume_training", "true").checkpoint.no_load_optim is False


def test_options_as_mindformers_reads_them_then_override_then_pairs():
    cfg = _load("--seed", "7", "--options", "training.seed=9", "optimizer.betas=0.8,0.9", "training.max_norm=0.5",
                "checkpoint.enable_save=True")
    assert cfg.training.seed == 9  # --options is merged after the flags, as in MindFormers
    assert cfg.optimizer.betas == [0.8, 0.9] and cfg.training.max_norm == 0.5 and cfg.checkpoint.enable_save is True
    cfg = _load("--options", "training.steps=4", "--override", "training.steps=5", "--training.log_interval", "2",
                "--model.seq_length=128", "--train_dataset.dataloader.config.seq_length", "128")
    assert (cfg.training.steps, cfg.training.log_interval, cfg.model.seq_length) == (5, 2, 128)


def test_output_dir_roots_the_outputs_the_config_leaves_unset(tmp_path):
    out = str(tmp_path / "out")
    cfg = _load("--output_dir", out)
    assert cfg.checkpoint.save_path == "./output/ds3_tiny"  # set in the YAML: kept
    assert cfg.monitor.metrics_dir == os.path.join(out, "metrics")
    assert cfg.profiler.output_path == os.path.join(out, "profile")
    cfg = _load("--output_dir", out, "--override", "checkpoint.save_path=", "--override", "monitor.metrics_dir=/m")
    assert cfg.checkpoint.save_path == os.path.join(out, "checkpoint") and cfg.monitor.metrics_dir == "/m"


def test_train_dataset_dir_feeds_a_mindrecord_loader(tmp_path):
    import yaml

    raw = yaml.safe_load(open(TINY))
    raw["train_dataset"]["dataloader"] = {"type": "MindDataset", "dataset_files": "/old",
                                          "column_names": ["input_ids"], "shuffle": False}
    path = tmp_path / "md.yaml"
    path.write_text(yaml.safe_dump(raw))
    from mindtrain.trainer.cli import load_with_flags, parse_args

    cfg = load_with_flags(parse_args(["--config", str(path), "--mode", "1", "--train_dataset_dir", str(tmp_path)]))
    assert cfg.train_dataset.dataloader.dataset_files == str(tmp_path)


def test_relative_config_is_found_beside_run_mindformer_then_in_the_current_directory(tmp_path, monkeypatch):
    from mindtrain.trainer.cli import resolve_path

    rel = os.path.join("configs", "pynative_ds3_tiny.yaml")
    monkeypatch.chdir(tmp_path)
    assert resolve_path(rel, ROOT) == os.path.join(ROOT, rel)
    (tmp_path / "mine.yaml").write_text("training: {steps: 3}\n")
    assert resolve_path("mine.yaml", ROOT) == "mine.yaml"
    assert resolve_path("/abs/x.yaml", ROOT) == "/abs/x.yaml"
    # through the real entry point, from another directory: config errors come after the lookup
    r = run("--config", rel, "--mode", "1", "--override", "training.stepz=1", cwd=str(tmp_path))
    assert r.returncode == 2 and "training.stepz: unknown key" in r.stderr, r.stderr
