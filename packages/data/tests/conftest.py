import json
import os

import pytest

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures", "megatron")


@pytest.fixture(scope="session")
def manifest():
    with open(os.path.join(FIXTURES, "manifest.json")) as f:
        return json.load(f)


@pytest.fixture(scope="session")
def fixtures_dir():
    return FIXTURES


@pytest.fixture(scope="session")
def make_section():
    return fixture_section


def fixture_section(case: dict, cache_dir: str) -> dict:
    """A case's train_dataset section with fixture paths and a private index cache."""
    section = json.loads(json.dumps(case["section"]))
    cfg = section["dataloader"]["config"]
    cfg["data_path"] = [p if p.replace(".", "").isdigit() else os.path.join(FIXTURES, p) for p in cfg["data_path"]]
    cfg["path_to_cache"] = cache_dir
    return section
