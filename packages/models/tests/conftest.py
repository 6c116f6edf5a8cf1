import os

import mindspore as ms
import pytest

ms.set_device("CPU")

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures")


@pytest.fixture(scope="session")
def fixtures_dir():
    return FIXTURES
