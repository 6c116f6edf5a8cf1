"""The one rule for which devices mindtrain dispatches synchronously (the runtime sets it,
the estimator counts what follows from it)."""

from mindtrain.config.plan import SYNCHRONOUS_DEVICES, dispatches_synchronously


def test_cpu_dispatches_synchronously_and_accelerators_do_not():
    assert SYNCHRONOUS_DEVICES == {"CPU"}
    assert dispatches_synchronously("CPU") and dispatches_synchronously("cpu")
    assert not dispatches_synchronously("Ascend") and not dispatches_synchronously("GPU")
