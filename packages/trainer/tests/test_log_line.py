"""The step line has exactly the quick start's shape."""

import re

from mindtrain.trainer.log_line import format_flops, format_step_line, mtp_fields

SEED_1 = ("{ step:[    1/   10], loss:  11.813965, per_step_time:  13570ms, load_balancing_loss:   1.093977, "
          "lr: 1.000000e-05, grad_norm:  13.831877, throughput:   1.36T }")
SEED_2 = ("{ step:[    2/   10], loss:  11.755612, per_step_time:    710ms, load_balancing_loss:   1.106543, "
          "lr: 1.000000e-05, grad_norm:  19.926786, throughput:  25.92T }")


def test_reproduces_the_seed_lines_character_for_character():
    assert format_step_line(1, 10, 11.813965, 13570, 1e-5, 13.831877, 1.36e12, load_balancing_loss=1.093977) == SEED_1
    assert format_step_line(2, 10, 11.755612, 710.2, 1e-5, 19.926786, 25.92e12, load_balancing_loss=1.106543) == SEED_2


def test_dense_model_omits_load_balancing_and_mtp_goes_before_lr():
    dense = format_step_line(3, 10, 2.5, 5, 1e-3, 0.5, 2e12)
    assert "load_balancing_loss" not in dense and "mtp" not in dense
    mtp = format_step_line(3, 10, 2.5, 5, 1e-3, 0.5, 2e12, load_balancing_loss=0.1, mtp=mtp_fields(2.75, 1, 0.1))
    assert re.search(r"load_balancing_loss:   0\.100000, mtp_1_loss:   0\.275000, lr: ", mtp)


def test_mtp_named_as_mindformers_names_it():
    # mindformers/pynative/callback/loss_callback.py: f"mtp_{ind + 1}_loss", value scaled by
    # mtp_loss_scaling_factor / depth
    assert mtp_fields(3.0, 0, 0.1) == []
    (name, value), = mtp_fields(3.0, 1, 0.3)
    assert name == "mtp_1_loss" and abs(value - 0.9) < 1e-12


def test_throughput_always_in_T_and_never_rounds_to_zero():
    assert format_flops(1.36e12) == "  1.36T"
    assert format_flops(25.92e12) == " 25.92T"
    assert format_flops(0.5e12) == "  0.50T"
    assert format_flops(1.2e9) == "0.0012T"
    assert format_flops(3.456e7) == "0.000035T"
    assert format_flops(0.996e12) == "  1.00T"
    for v in (1e3, 5e6, 9.99e8, 2e10, 3e11):
        text = format_flops(v)
        assert text.endswith("T") and not any(u in text for u in "GMK")
        figure = float(text[:-1])
        assert figure > 0 and abs(figure * 1e12 - v) / v < 0.05, text  # two significant digits
