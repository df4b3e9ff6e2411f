import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from tiny_models import FAMILIES, save_tiny  # noqa: E402


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory) -> dict:
    """family -> (checkpoint dir, transformers model) for each of the three families."""
    out = {}
    for family in FAMILIES:
        path = tmp_path_factory.mktemp(family)
        out[family] = (path, save_tiny(family, path))
    return out


@pytest.fixture(scope="session")
def ray_session():
    """One local Ray instance for every test that needs it (starting one costs seconds)."""
    import ray

    # address="local": always a fresh cluster of our own, never one `ray start` left on the machine
    ray.init(address="local", num_cpus=8, include_dashboard=False, log_to_driver=False, configure_logging=False)
    yield ray
    ray.shutdown()
