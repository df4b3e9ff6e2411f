import os
import sys
from pathlib import Path

import pytest
import torch

# Triton kernel tests: without CUDA the kernels run under Triton's interpreter on CPU tensors; with
# CUDA the same tests run compiled on the GPU. Triton reads the switch when it is imported and when
# a kernel is decorated, so it is set here, before any test module (or transformers, through
# tiny_models) imports triton, and never on a CUDA machine: there it would also reach Triton's own
# modules (gluon) and no kernel could be compiled.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
else:
    # float32 dots as IEEE float32 for the whole run, not per test: Triton keys its in-process kernel
    # cache by specialization and launch options, not by this variable, so a test that sets it after
    # another compiled the same kernel reused that TF32 build (an H100 run of several GPU files in one
    # process: eleven float32 checks off by TF32-sized gaps, 0.3-0.5 in a logprob)
    os.environ.setdefault("TRITON_F32_DEFAULT", "ieee")

# One intra-op thread per process (Ray actors inherit it): the tests' tensors are tiny, and two
# threads per process on a 2-core machine shared with Ray workers made ops up to 10x slower.
os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

sys.path.insert(0, str(Path(__file__).parent))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from tiny_models import FAMILIES, save_tiny, save_tiny_chat  # noqa: E402

if os.environ.get("TRITON_INTERPRET") == "1":
    from interpreter_speedup import install  # noqa: E402

    install()

_MEASURED: list[str] = []


@pytest.fixture
def report():
    """report(line): a line for the run's summary (what a test measured: examples tried, requests
    sent, memory), shown under -q too."""
    return _MEASURED.append


def pytest_terminal_summary(terminalreporter):
    if _MEASURED:
        terminalreporter.section("measured")
        for line in _MEASURED:
            terminalreporter.write_line(line)


def pytest_collection_modifyitems(config, items):
    """Tests marked gpu are skipped, with the reason, where there is no CUDA device."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def device() -> torch.device:
    """Where the kernel tests' tensors live: the GPU when there is one (compiled kernels), else the
    CPU (interpreted kernels)."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.fixture
def nan_fill():
    """While the test runs, torch.empty / empty_like hand out NaN-filled memory (integers: their
    largest value), so an output element a kernel never writes fails its check."""
    det, fill = torch.are_deterministic_algorithms_enabled(), torch.utils.deterministic.fill_uninitialized_memory
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.utils.deterministic.fill_uninitialized_memory = True
    yield
    torch.use_deterministic_algorithms(det, warn_only=warn_only)
    torch.utils.deterministic.fill_uninitialized_memory = fill


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory) -> dict:
    """family -> (checkpoint dir, transformers model) for each of the three families."""
    out = {}
    for family in FAMILIES:
        path = tmp_path_factory.mktemp(family)
        out[family] = (path, save_tiny(family, path))
    return out


@pytest.fixture(scope="session")
def tiny_chat_model(tiny_checkpoints, tmp_path_factory) -> Path:
    """The tiny qwen3_5_moe checkpoint with the demo model's chat template (the demo model, shrunk)."""
    return save_tiny_chat(tiny_checkpoints["qwen3_5_moe"][0], tmp_path_factory.mktemp("tiny_chat"))


@pytest.fixture(scope="session")
def demo_path() -> str:
    """The built-in demo model's folder (built on first use)."""
    from deltaserve.cluster.entrypoints.demo_model import ensure_demo_model

    return str(ensure_demo_model())


@pytest.fixture(scope="module")
def demo_llm(demo_path):
    """An engine on the demo model (64 sequences), shut down after the module."""
    from deltaserve import LLM

    llm = LLM(demo_path, max_num_seqs=64)
    yield llm
    llm.shutdown()


@pytest.fixture(scope="session")
def ray_session():
    """One local Ray instance for every test that needs it (starting one costs seconds)."""
    import ray

    # address="local": always a fresh cluster of our own, never one `ray start` left on the machine.
    # Once on a 2-core CI machine the raylet never registered within Ray's 30 s (no raylet log at
    # all) and every Ray test errored at set-up: a second start is tried before giving up
    for attempt in range(2):
        try:
            ray.init(address="local", num_cpus=8, include_dashboard=False, log_to_driver=False, configure_logging=False)
            break
        except Exception:
            ray.shutdown()
            if attempt:
                raise
    yield ray
    ray.shutdown()
