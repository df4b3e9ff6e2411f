"""Triton RMSNorm variants vs the plain-torch references: CPU under the Triton interpreter, and
(marked gpu) bf16 at the real shapes."""

import functools
import importlib.util
import os

_INTERPRET_BEFORE = os.environ.get("TRITON_INTERPRET")
os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported: the CPU tests' kernels are interpreted

import pytest  # noqa: E402
import torch  # noqa: E402

from deltaserve.layers.kernels.norm import naive  # noqa: E402

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture(autouse=True)
def kernel_env(request, monkeypatch):
    """torch.empty hands out NaN-filled memory, so an output element a kernel never writes fails;
    the interpreter switch is on while a CPU test runs (its kernels check it when called)."""
    det, fill = torch.are_deterministic_algorithms_enabled(), torch.utils.deterministic.fill_uninitialized_memory
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.utils.deterministic.fill_uninitialized_memory = True
    if request.node.get_closest_marker("gpu") is None:
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    else:
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    yield
    torch.use_deterministic_algorithms(det)
    torch.utils.deterministic.fill_uninitialized_memory = fill


def kernel_module(*, interpret: bool):
    """A private copy of the Triton kernel module, decorated for the interpreter (CPU tensors) or
    compiled (CUDA). The canonical module, which the engine imports, stays untouched."""
    name = "deltaserve.layers.kernels.norm.triton_norm"
    previous = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1" if interpret else "0"
    try:
        origin = importlib.util.find_spec(name).origin
        spec = importlib.util.spec_from_file_location(name + ("_interpreted" if interpret else "_compiled"), origin)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        if previous is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = previous
    return module


tn = kernel_module(interpret=True)
# later test modules and the engine decorate their kernels after this: leave the switch as found
# (the kernel_env fixture turns it on around each CPU test)
if _INTERPRET_BEFORE is None:
    del os.environ["TRITON_INTERPRET"]
else:
    os.environ["TRITON_INTERPRET"] = _INTERPRET_BEFORE
compiled_kernels = functools.cache(functools.partial(kernel_module, interpret=False))


def max_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert out.shape == ref.shape and out.dtype == ref.dtype
    assert not out.isnan().any(), "NaN in the output (an element was never written)"
    return (out.float() - ref.float()).abs().max().item()


@pytest.mark.parametrize("shape", [(7, 64), (3, 5, 20), (1, 48)])
@pytest.mark.parametrize("zero_centered", [True, False])
def test_rms_norm(shape, zero_centered):
    x = torch.randn(shape)
    w = torch.randn(shape[-1]) * 0.5
    ref = naive.rms_norm(x=x, weight=w, eps=1e-6, zero_centered=zero_centered)
    assert max_err(tn.rms_norm(x=x, weight=w, eps=1e-6, zero_centered=zero_centered), ref) < 1e-5


def test_rms_norm_strided_rows():
    """q out of a fused q/gate projection: [T, H, 2D] sliced to [..., :D] (row stride 2D)."""
    qg = torch.randn(5, 3, 2 * 24)
    q = qg[..., :24]
    w = torch.randn(24)
    assert max_err(tn.rms_norm(x=q, weight=w, eps=1e-6), naive.rms_norm(x=q, weight=w, eps=1e-6)) < 1e-5


@pytest.mark.parametrize("shape", [(9, 4, 16), (6, 3, 40)])
def test_gated_rms_norm(shape):
    x, gate = torch.randn(shape), torch.randn(shape)
    w = 1 + 0.2 * torch.randn(shape[-1])
    ref = naive.gated_rms_norm(x=x, gate=gate, weight=w, eps=1e-6)
    assert max_err(tn.gated_rms_norm(x=x, gate=gate, weight=w, eps=1e-6), ref) < 1e-5


def test_fused_add_rms_norm():
    x, residual = torch.randn(11, 56), torch.randn(11, 56)
    w = torch.randn(56) * 0.3
    out, summed = tn.fused_add_rms_norm(x=x, residual=residual, weight=w, eps=1e-5)
    ref, ref_summed = naive.fused_add_rms_norm(x=x, residual=residual, weight=w, eps=1e-5)
    assert torch.equal(summed, ref_summed)
    assert max_err(out, ref) < 1e-5


# --- GPU, bf16, the real shapes ------------------------------------------------------------------


@pytest.mark.gpu
@gpu
def test_gpu_rms_norm_bf16():
    kernels = compiled_kernels()
    x = torch.randn(8192, 2048, device="cuda", dtype=torch.bfloat16)
    w = (0.1 * torch.randn(2048, device="cuda")).to(torch.bfloat16)
    assert max_err(kernels.rms_norm(x=x, weight=w, eps=1e-6), naive.rms_norm(x=x, weight=w, eps=1e-6)) < 5e-2
    q = torch.randn(64, 16, 512, device="cuda", dtype=torch.bfloat16)[..., :256]
    wq = (0.1 * torch.randn(256, device="cuda")).to(torch.bfloat16)
    assert max_err(kernels.rms_norm(x=q, weight=wq, eps=1e-6), naive.rms_norm(x=q, weight=wq, eps=1e-6)) < 5e-2


@pytest.mark.gpu
@gpu
def test_gpu_gated_rms_norm_bf16():
    kernels = compiled_kernels()
    x = torch.randn(8192, 32, 128, device="cuda", dtype=torch.bfloat16)
    gate = torch.randn_like(x)
    w = 1 + 0.1 * torch.randn(128, device="cuda")
    ref = naive.gated_rms_norm(x=x, gate=gate, weight=w, eps=1e-6)
    assert max_err(kernels.gated_rms_norm(x=x, gate=gate, weight=w, eps=1e-6), ref) < 5e-2


@pytest.mark.gpu
@gpu
def test_gpu_fused_add_rms_norm_bf16():
    kernels = compiled_kernels()
    x = torch.randn(4096, 2048, device="cuda", dtype=torch.bfloat16)
    residual = torch.randn_like(x)
    w = (0.1 * torch.randn(2048, device="cuda")).to(torch.bfloat16)
    out, summed = kernels.fused_add_rms_norm(x=x, residual=residual, weight=w, eps=1e-6)
    ref, ref_summed = naive.fused_add_rms_norm(x=x, residual=residual, weight=w, eps=1e-6)
    assert torch.equal(summed, ref_summed)
    assert max_err(out, ref) < 5e-2
