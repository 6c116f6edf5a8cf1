"""The checkpoint MindFormers' own save_checkpoint wrote (tools/make_mindformers_checkpoint.py)
is found through its tracker, read, and loads into a mindtrain model with its optimizer state."""

import json
import os

import numpy as np
from safetensors.numpy import load_file

from mindtrain.trainer import checkpoint as ck
from mindtrain.trainer import mindformers_checkpoint as mf

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures")
SAVE_PATH = os.path.join(FIXTURES, "mindformers_ckpt")


def test_independent_reader_agrees():
    """safetensors + json only: the tracker names the folder, the files hold what mindtrain reads."""
    with open(os.path.join(SAVE_PATH, "latest_checkpointed_iteration.txt")) as f:
        folder = os.path.join(SAVE_PATH, f"iteration_{int(f.read()):08d}")
    plain = load_file(os.path.join(folder, "tiny-model-0000000-0000001.safetensors"))
    plain_opt = load_file(os.path.join(folder, "tiny-opt-0000000-0000001.safetensors"))
    with open(os.path.join(folder, "common.json")) as f:
        common = json.load(f)
    assert common["global_step"] == 2 and common["consumed_samples"] == 8
    assert ck.resolve_checkpoint(SAVE_PATH) == ("mindformers", folder)
    model, opt, ours = mf.read_checkpoint(folder, workers=2)
    assert ours == common and set(model) == set(plain) and set(opt) == set(plain_opt)
    for k in plain:
        np.testing.assert_array_equal(model[k], plain[k])
    for k in plain_opt:
        np.testing.assert_array_equal(opt[k], plain_opt[k])


def test_mindformers_written_checkpoint_loads_into_a_mindtrain_model():
    """Read box by box under the model's names, as the trainer reads it into each rank's
    pieces: every parameter, its moments and the step equal the files'."""
    import mindspore as ms

    from mindtrain.models import build_model, config_from_hf

    ms.set_device("CPU")
    ms.runtime.launch_blocking()  # eager ops in the calling thread, as the trainer runs them on CPU
    with open(os.path.join(FIXTURES, "mindformers_ckpt_model.json")) as f:
        model = build_model(config_from_hf(json.load(f)), jit=False, empty=True)
    kind, folder = ck.resolve_checkpoint(SAVE_PATH)
    weights, opt, common = mf.read_checkpoint(folder)
    params = {p.name: tuple(p.shape) for p in model.get_parameters()}
    boxes = mf.MindFormersBoxes(folder, model.config, params)
    boxes.check_shapes(params.items())
    boxes.check_files()
    assert not boxes.missing
    for name, shape in params.items():
        np.testing.assert_array_equal(boxes.read_full(name), weights[name])
        if len(shape) == 2 and shape[0] > 1:  # a rank's box
            np.testing.assert_array_equal(boxes.read(name, (1, 0), (shape[0] - 1, shape[1])), weights[name][1:])
    names = [p.name for p in model.trainable_params()]
    boxes.check_moments(names)
    assert int(boxes.read_full("step")) == 2
    assert mf.state_from_common(common, 4) == {"step": 2, "consumed_samples": 8, "skipped_total": 0,
                                               "skipped_in_row": 0}
    np.testing.assert_array_equal(boxes.read_full(f"exp_avg_sq.{names[0]}"), opt[f"adam_v.{names[0]}"])
