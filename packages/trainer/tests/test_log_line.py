"""The step line has exactly the quick start's shape."""

import re

from mindtrain.trainer.log_line import format_flops, format_step_line

SEED_1 = ("{ step:[    1/   10], loss:  11.813965, per_step_time:  13570ms, load_balancing_loss:   1.093977, "
          "lr: 1.000000e-05, grad_norm:  13.831877, throughput:   1.36T }")
SEED_2 = ("{ step:[    2/   10], loss:  11.755612, per_step_time:    710ms, load_balancing_loss:   1.106543, "
          "lr: 1.000000e-05, grad_norm:  19.926786, throughput:  25.92T }")


def test_reproduces_the_seed_lines_character_for_character():
    assert format_step_line(1, 10, 11.813965, 13570, 1e-5, 13.831877, 1.36e12, load_balancing_loss=1.093977) == SEED_1
    assert format_step_line(2, 10, 11.755612, 710.2, 1e-5, 19.926786, 25.92e12, load_balancing_loss=1.106543) == SEED_2


def test_dense_model_omits_load_balancing_and_mtp_goes_before_lr():
    dense = format_step_line(3, 10, 2.5, 5, 1e-3, 0.5, 2e9)
    assert "load_balancing_loss" not in dense and "mtp_loss" not in dense
    mtp = format_step_line(3, 10, 2.5, 5, 1e-3, 0.5, 2e9, load_balancing_loss=0.1, mtp_loss=2.75)
    assert re.search(r"load_balancing_loss:   0\.100000, mtp_loss:   2\.750000, lr: ", mtp)


def test_throughput_unit_never_rounds_to_zero():
    assert format_flops(1.36e12) == "  1.36T"
    assert format_flops(3.2e9) == "  3.20G"
    assert format_flops(4.5e6) == "  4.50M"
    assert format_flops(7.0e3) == "  7.00K"
    for v in (1e3, 5e6, 9.99e8, 2e10):
        assert float(format_flops(v)[:-1]) >= 1.0
