"""Triton skinny GEMM vs the plain-torch reference at tiny, odd shapes (GEMV and MMA forms, with and
without split-K, both split-K reductions, strided x, bias): interpreted on CPU tensors without CUDA,
compiled on the GPU with it; and (marked gpu) bf16 at the real shapes inside a CUDA graph."""

import pytest
import torch
import torch.nn.functional as F

from deltaserve.layers.kernels import device as device_module
from deltaserve.layers.kernels import linear as linear_kernels
from deltaserve.layers.kernels.device import DeviceInfo
from deltaserve.layers.kernels.linear import naive
from deltaserve.layers.kernels.linear import triton_linear as tl_

# conftest: TRITON_INTERPRET without CUDA, the `device` fixture, gpu-marked tests skipped on CPU
pytestmark = pytest.mark.usefixtures("nan_fill")


def tol(device: torch.device) -> float:
    """float32 inputs: float32 math everywhere (the MMA form uses ieee dots for float32)."""
    return 1e-4


def max_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert out.shape == ref.shape and out.dtype == ref.dtype
    assert not out.isnan().any(), "NaN in the output (an element was never written)"
    return (out.float() - ref.float()).abs().max().item()


def make(m, n, k, device, dtype=torch.float32, bias=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * max(k, 1) ** -0.5
    w = torch.randn(n, k, generator=g)
    b = torch.randn(n, generator=g) if bias else None
    to = dict(device=device, dtype=dtype)
    return x.to(**to), w.to(**to), None if b is None else b.to(**to)


# configs by name: GEMV 1 / 2 / 4 rows per program, MMA; each without and with split-K
CONFIGS = {
    "gemv1": dict(block_m=1, block_n=16, block_k=32, split_k=1),
    "gemv2_split3": dict(block_m=2, block_n=8, block_k=16, split_k=3),
    "gemv4_split4": dict(block_m=4, block_n=8, block_k=64, split_k=4),
    "gemv1_split2_pass": dict(block_m=1, block_n=16, block_k=16, split_k=2, reduce="pass"),
    "mma": dict(block_n=16, block_k=32, split_k=1, dot=True, num_stages=2),
    "mma_split3": dict(block_n=32, block_k=16, split_k=3, dot=True, num_stages=2),
}


# (M, N, K): every row count (1; 3 and 17, a partial row block; 16, whole ones), N (1 and 7, one
# partial column block; 37, several and a partial one) and K (5, under one chunk; 64, one whole;
# 136, several and a masked tail) at least twice, in different company. On CPU the pick is 8 x
# min(64, K) tiles of up to 4 rows; on the GPU 16 and 17 rows take the MMA form (17: two row tiles)
DEFAULT_SHAPES = [
    (1, 37, 136), (1, 1, 64), (3, 7, 5), (3, 37, 64), (16, 7, 136), (16, 1, 5), (17, 37, 64), (17, 1, 136),
]  # fmt: skip


@pytest.mark.parametrize(("m", "n", "k"), DEFAULT_SHAPES)
def test_default_config(device, m, n, k):
    """The shape heuristic's pick (on CPU: the GEMV form, no split)."""
    x, w, b = make(m, n, k, device)
    assert max_err(tl_.linear(x=x, weight=w, bias=b), naive.linear(x=x, weight=w, bias=b)) < tol(device)


# one row over column blocks of every config's width with a partial last one (37 > 32) and K in
# several chunks with a masked tail, split 2..4 ways (the last split partial); a partial row block
# with one partial column block; rows in whole blocks of 2 (partial of 4) with K under one chunk
# (the splits collapse to one); 17 rows (a tail of one for every row block, MMA's 16 included)
FORCED_SHAPES = [(1, 37, 200), (3, 7, 64), (6, 20, 5), (17, 1, 100)]


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize(("m", "n", "k"), FORCED_SHAPES)
def test_forced_configs(device, name, m, n, k):
    x, w, b = make(m, n, k, device, bias=m % 2 == 1)
    out = tl_.linear(x=x, weight=w, bias=b, config=CONFIGS[name])
    assert max_err(out, naive.linear(x=x, weight=w, bias=b)) < tol(device)


def test_split_k_taken_and_reproducible(device):
    """Split-K really splits here, both reductions give the same bits, and so do repeated calls."""
    m, n, k = 3, 20, 100  # 3 column blocks (the last partial) x 4 splits of 32 (the last of 4)
    cfg = dict(block_m=4, block_n=8, block_k=16, split_k=4)
    assert tl_.resolve(cfg, m, n, k, torch.float32)["split_k"] == 4
    x, w, b = make(m, n, k, device)
    first = tl_.linear(x=x, weight=w, bias=b, config=cfg)
    again = tl_.linear(x=x, weight=w, bias=b, config=cfg)
    passed = tl_.linear(x=x, weight=w, bias=b, config={**cfg, "reduce": "pass"})
    assert torch.equal(first, again) and torch.equal(first, passed)
    assert max_err(first, naive.linear(x=x, weight=w, bias=b)) < tol(device)
    # the "sem" counters are back to zero for the next launch
    assert int(tl_._counters(x.device).abs().sum()) == 0


def test_long_k_rolled_loop(device):
    """Over 16 K chunks a split: the GEMV form's K loop stays rolled (UNROLL off), K's tail masked."""
    m, n, k = 2, 20, 300
    cfg = dict(block_m=2, block_n=16, block_k=16, split_k=1)
    resolved = tl_.resolve(cfg, m, n, k, torch.float32)
    assert resolved["k_split"] // resolved["block_k"] > 16
    x, w, b = make(m, n, k, device)
    assert max_err(tl_.linear(x=x, weight=w, bias=b, config=cfg), naive.linear(x=x, weight=w, bias=b)) < tol(device)


def test_split_k_no_empty_splits():
    """split_k larger than K's chunks shrinks to the chunks there are."""
    cfg = tl_.resolve(dict(block_n=4, block_k=64, split_k=16), 1, 10, 200, torch.float32)
    assert cfg["split_k"] == 4 and cfg["k_split"] == 64


@pytest.mark.parametrize("name", ["gemv1", "gemv4_split4", "mma_split3"])
def test_strided_x(device, name):
    """x as a view: a column slice of a wider activation (row stride > K), and every other row."""
    m, n, k = 5, 20, 64
    wide = torch.randn(2 * m, k + 24, device=device)
    _, w, b = make(m, n, k, device)
    for x in (wide[:m, 8 : 8 + k], wide[::2, :k]):
        assert x.stride(0) != k
        out = tl_.linear(x=x, weight=w, bias=b, config=CONFIGS[name])
        assert max_err(out, naive.linear(x=x, weight=w, bias=b)) < tol(device)


def test_weight_row_view(device):
    """weight as a block of rows of a larger (fused) weight, as the MoE block's router view."""
    x, w, _ = make(2, 40, 64, device, bias=False)
    out = tl_.linear(x=x, weight=w[8:30], config=CONFIGS["gemv2_split3"])
    assert max_err(out, naive.linear(x=x, weight=w[8:30])) < tol(device)


@pytest.mark.parametrize("name", ["gemv1", "gemv2_split3", "gemv4_split4"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision(device, name, dtype):
    """16-bit inputs, float32 accumulation: within one rounding of the output."""
    x, w, b = make(3, 20, 200, device, dtype=dtype)  # 2-3 column blocks, split 3 and 4 ways
    ref = naive.linear(x=x, weight=w, bias=b)
    out = tl_.linear(x=x, weight=w, bias=b, config=CONFIGS[name])
    assert max_err(out, ref) <= 2 * ref.float().abs().max().item() * torch.finfo(dtype).eps


@pytest.mark.parametrize("name", ["mma", "mma_split3"])
def test_half_precision_mma(device, name):
    """float16 on the MMA form (the interpreter's bf16 tl.dot is broken; bf16 MMA is tested on the GPU)."""
    x, w, b = make(9, 37, 200, device, dtype=torch.float16)
    ref = naive.linear(x=x, weight=w, bias=b)
    out = tl_.linear(x=x, weight=w, bias=b, config=CONFIGS[name])
    assert max_err(out, ref) <= 2 * ref.float().abs().max().item() * torch.finfo(torch.float16).eps


def test_empty(device):
    x, w, b = make(0, 7, 64, device)
    assert tl_.linear(x=x, weight=w, bias=b).shape == (0, 7)
    x, w, b = make(2, 7, 0, device)
    assert max_err(tl_.linear(x=x, weight=w, bias=b), naive.linear(x=x, weight=w, bias=b)) == 0


def test_dispatch(device):
    """The op: F.linear on CPU and above MAX_TOKENS rows, the Triton kernel for few CUDA rows."""
    for m in (1, linear_kernels.MAX_TOKENS, linear_kernels.MAX_TOKENS + 1):
        x, w, b = make(m, 130, 64, device)
        out = linear_kernels.linear(x=x, weight=w, bias=b)
        if device.type == "cpu" or m > linear_kernels.MAX_TOKENS:
            assert torch.equal(out, F.linear(x, w, b))
        else:
            assert torch.equal(out, tl_.linear(x=x, weight=w, bias=b))


H200 = DeviceInfo(device_module.H200, num_sms=132, smem_per_block=232448, capability=(9, 0))
OTHER_GPU = DeviceInfo("NVIDIA B200", num_sms=148, smem_per_block=232448, capability=(10, 0))


def test_dispatch_above_gemv_rows_takes_only_tuned_half_shapes():
    """Up to MAX_TOKENS rows the Triton GEMV (a half-precision row: the one-row kernel unless
    row_gemv is off); 5..16 rows only at the device's tuned half-precision shapes, cuBLAS else."""

    def path(m, n, k, dtype, info=H200, row_gemv=True):
        return linear_kernels.gemm_path(m, n, k, dtype, info, row_gemv)

    (bucket, n, k), *_ = [key for key in linear_kernels.TUNED[device_module.H200] if key[0] == 16]
    assert path(1, 130, 64, torch.float32) == path(4, 130, 64, torch.float32) == "skinny"
    assert path(1, 130, 64, torch.bfloat16) == "row" and path(1, 130, 64, torch.bfloat16, row_gemv=False) == "skinny"
    assert path(5, n, k, torch.bfloat16) == path(16, n, k, torch.float16) == "skinny"
    assert path(5, n, k, torch.float32) == "torch"  # tiles measured in bf16 only
    assert path(17, n, k, torch.bfloat16) == path(8, n + 1, k, torch.bfloat16) == "torch"
    assert path(5, n, k, torch.bfloat16, OTHER_GPU) == "torch"  # measured on the H200 only


def test_tuned_configs_resolve():
    """Every measured config is complete and valid for its own shape (the GPU test runs them)."""
    for (bucket, n, k), cfg in linear_kernels.TUNED[device_module.H200].items():
        cfg = tl_.resolve(cfg, bucket, n, k, torch.bfloat16)
        assert cfg["dot"] == (bucket == 16) and cfg["k_split"] % cfg["block_k"] == 0


def test_tiles_by_device():
    """The H200 takes its measured tiles; another GPU the heuristic, its pipeline within its shared
    memory (a 99 KB part keeps fewer stages of the 16-row MMA form than it wants)."""
    (bucket, n, k), cfg = next(iter(linear_kernels.TUNED[device_module.H200].items()))
    assert tl_.pick_config(bucket, n, k, torch.bfloat16, H200) == cfg
    small = DeviceInfo("NVIDIA L40S", num_sms=142, smem_per_block=101376, capability=(8, 9))
    for info in (OTHER_GPU, small):
        for m in (1, 3, 16):
            got = tl_.resolve(tl_.pick_config(m, 12352, 2048, torch.bfloat16, info), m, 12352, 2048, torch.bfloat16)
            per_stage = 2 * got["block_k"] * (16 + got["block_n"])
            assert not got["dot"] or got["num_stages"] * per_stage + device_module.SMEM_SCRATCH <= info.smem_per_block
    tiny = DeviceInfo("tiny", num_sms=8, smem_per_block=40 * 1024, capability=(8, 0))
    assert tl_.pick_config(16, 12352, 2048, torch.bfloat16, tiny)["num_stages"] == 2


# --- GPU, bf16, the real shapes ------------------------------------------------------------------

SHAPES = [(12352, 2048), (8192 + 1024, 2048), (2048, 4096), (1288, 2048), (1281, 2048), (2048, 512)]


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 2, 4, 5, 8, 16])
@pytest.mark.parametrize(("n", "k"), SHAPES)
def test_gpu_bf16_real_shapes(m, n, k):
    x, w, b = make(m, n, k, "cuda", dtype=torch.bfloat16, bias=m == 2)
    ref = naive.linear(x=x, weight=w, bias=b)
    out = linear_kernels.linear(x=x, weight=w, bias=b)
    assert max_err(out, ref) <= 2 * ref.float().abs().max().item() * torch.finfo(torch.bfloat16).eps
    assert torch.equal(out, linear_kernels.linear(x=x, weight=w, bias=b))  # bit-reproducible


@pytest.mark.gpu
def test_gpu_cuda_graph():
    """Captured calls (split-K "sem" included) replay to the eager results, repeatedly."""
    shapes = [(1, 1281, 2048), (1, 2048, 4096), (8, 2048, 4096), (3, 12352, 2048)]
    inputs = [make(m, n, k, "cuda", dtype=torch.bfloat16, seed=i) for i, (m, n, k) in enumerate(shapes)]
    eager = [linear_kernels.linear(x=x, weight=w, bias=b) for x, w, b in inputs]
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = [linear_kernels.linear(x=x, weight=w, bias=b) for x, w, b in inputs]
    for _ in range(3):
        for o in outs:
            o.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        for o, e in zip(outs, eager, strict=True):
            assert torch.equal(o, e)
