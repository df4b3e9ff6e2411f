"""The few-row GEMV (layers/kernels/linear/triton_rows.py) against the plain-torch reference at
odd shapes (rows past a group, weight rows past a block, K not a power of two, strided x, bias),
interpreted on CPU tensors, compiled on the GPU; and its place in the linear op's dispatch."""

import pytest
import torch

from deltaserve.layers.kernels import device as device_module
from deltaserve.layers.kernels import linear as linear_kernels
from deltaserve.layers.kernels.device import DeviceInfo
from deltaserve.layers.kernels.linear import naive, triton_rows

pytestmark = pytest.mark.usefixtures("nan_fill")

H200 = DeviceInfo(device_module.H200, num_sms=132, smem_per_block=232448, capability=(9, 0))


def make(m, n, k, device, dtype, bias, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * k**-0.5
    w = torch.randn(n, k, generator=g)
    b = torch.randn(n, generator=g) if bias else None
    to = dict(device=device, dtype=dtype)
    return x.to(**to), w.to(**to), None if b is None else b.to(**to)


def check(out, ref, dtype):
    """Within one rounding of the output (float32 accumulation both sides); every element written."""
    assert out.shape == ref.shape and out.dtype == ref.dtype
    assert not out.isnan().any(), "NaN in the output (an element was never written)"
    err = (out.float() - ref.float()).abs().max().item()
    assert err <= 2 * ref.float().abs().max().item() * torch.finfo(dtype).eps


# rows: one group of 2 (exact), one of 4 with rows past M, groups of 4 with a partial last one,
# whole groups of 4; N: one row, two row blocks (the last partial), several (the last partial);
# K 64 a power of two, 40 and 200 masked. Every (rows, shape), the dtypes alternating so that each
# dtype meets every shape and both bias settings (odd rows: bias)
DEFAULT_ROWS = [2, 3, 5, 8, 13]
DEFAULT_SHAPES = [(1, 64), (7, 40), (18, 200)]
DEFAULT_CASES = [
    (m, n, k, (torch.bfloat16, torch.float16)[(i + j) % 2])
    for i, m in enumerate(DEFAULT_ROWS)
    for j, (n, k) in enumerate(DEFAULT_SHAPES)
]


@pytest.mark.parametrize(("m", "n", "k", "dtype"), DEFAULT_CASES, ids=lambda v: str(v).removeprefix("torch."))
def test_default_config(device, m, n, k, dtype):
    x, w, b = make(m, n, k, device, dtype, bias=m % 2 == 1)
    check(triton_rows.rows_gemv(x=x, weight=w, bias=b)[0], naive.linear(x=x, weight=w, bias=b), dtype)


@pytest.mark.parametrize(
    "cfg",
    [
        dict(block_n=1, num_warps=1, group=1),
        dict(block_n=2, num_warps=2, group=4),
        dict(block_n=8, num_warps=1, group=2),
    ],
)
@pytest.mark.parametrize("preload", [True, False])
def test_forced_configs(device, cfg, preload):
    """Groups that do and do not divide M, blocks past N, the weight loaded before or after the wait."""
    x, w, b = make(7, 13, 48, device, torch.bfloat16, bias=True)
    out = triton_rows.rows_gemv(x=x, weight=w, bias=b, config=cfg, preload=preload)[0]
    check(out, naive.linear(x=x, weight=w, bias=b), torch.bfloat16)


def test_strided_x_and_weight_rows(device):
    """x as a column slice of a wider activation and as every other row; weight as a row block of a
    larger (fused) weight."""
    m, n, k = 4, 40, 64
    wide = torch.randn(2 * m, k + 24, device=device).to(torch.bfloat16)
    _, w, _ = make(m, n, k, device, torch.bfloat16, bias=False)
    for x in (wide[:m, 8 : 8 + k], wide[::2, :k]):
        check(triton_rows.rows_gemv(x=x, weight=w[8:30])[0], naive.linear(x=x, weight=w[8:30]), torch.bfloat16)


def test_empty(device):
    x, w, b = make(0, 7, 64, device, torch.bfloat16, bias=False)
    assert triton_rows.rows_gemv(x=x, weight=w)[0].shape == (0, 7)


def test_tiles_at_model_shapes():
    """The heuristic keeps the weight tile and a group's products within their register budgets,
    and a group never exceeds the rows (a power of two)."""
    for n, k in [(12352, 2048), (9216, 2048), (2048, 4096), (1288, 2048), (2048, 512)]:
        for m in (2, 3, 4, 8, 16):
            cfg = triton_rows.pick_config(m, n, k, H200)
            threads = 32 * cfg["num_warps"]
            assert cfg["block_n"] * k <= triton_rows.MAX_W_PER_THREAD * threads
            assert cfg["group"] * cfg["block_n"] * k <= triton_rows.MAX_PRODUCT_PER_THREAD * threads
            assert cfg["group"] <= triton_rows.triton.next_power_of_2(m)
    assert triton_rows.pick_config(4, 12352, 2048, H200) == dict(block_n=2, num_warps=8, group=4)


def test_dispatch_by_rows():
    """A half-precision CUDA call: one row the one-row GEMV, 2..few_rows rows the few-row GEMV,
    more the skinny GEMM or cuBLAS; few_rows = 0 leaves 2..4 rows on the skinny GEMM; float32 and
    K over the kernel's limit never take it."""

    def path(m, n=12352, k=2048, dtype=torch.bfloat16, few_rows=linear_kernels.FEW_ROWS_MAX):
        return linear_kernels.gemm_path(m, n, k, dtype, H200, True, few_rows)

    assert path(1) == "row"
    assert path(2) == path(4) == path(linear_kernels.FEW_ROWS_MAX) == "rows"
    assert path(linear_kernels.FEW_ROWS_MAX + 1) in ("skinny", "torch")
    assert path(4, few_rows=0) == "skinny" and path(8, few_rows=4) != "rows"
    assert path(4, dtype=torch.float32) == "skinny"
    assert path(4, k=triton_rows.MAX_K + 1) == "skinny"


@pytest.mark.gpu
@pytest.mark.parametrize("m", [2, 3, 4, 8, 16])
@pytest.mark.parametrize(("n", "k"), [(12352, 2048), (9216, 2048), (2048, 4096), (1288, 2048), (1281, 2048)])
def test_gpu_bf16_real_shapes(m, n, k):
    x, w, b = make(m, n, k, "cuda", torch.bfloat16, bias=m == 3)
    out = linear_kernels.linear(x=x, weight=w, bias=b)
    check(out, naive.linear(x=x, weight=w, bias=b), torch.bfloat16)
    if m <= linear_kernels.FEW_ROWS_MAX:  # the op took it, bit-reproducibly (more rows: the skinny GEMM)
        assert torch.equal(out, triton_rows.rows_gemv(x=x, weight=w, bias=b)[0])


@pytest.mark.parametrize(("m", "n", "k"), [(4, 7, 200), (3, 18, 64), (9, 13, 48)])
@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("cfg", [None, dict(block_n=2, num_warps=2, group=2)])
def test_fused_norm(device, m, n, k, with_residual, cfg):
    """The residual add + zero-centred norm inside the few-row GEMV: the new residual is the exact
    sum (one bf16 step under the interpreter, whose float32 -> bf16 cast truncates), the normed rows
    what the unfused norm writes to one rounding, the projection the composition's; every row written
    (groups that do not divide M included)."""
    from deltaserve.layers.kernels.norm import naive as norm_naive

    g = torch.Generator().manual_seed(m + n + k)
    to = dict(device=device, dtype=torch.bfloat16)
    x = torch.randn(m, k, generator=g).to(**to)
    residual = (torch.randn(m, k, generator=g) * 3).to(**to) if with_residual else None
    norm_w = (torch.randn(k, generator=g) * 0.1).to(**to)
    w = (torch.randn(n, k, generator=g) * k**-0.5).to(**to)
    out, normed, summed = triton_rows.rows_gemv(
        x=x, weight=w, residual=residual, norm_weight=norm_w, eps=1e-6, write_normed=True, config=cfg
    )
    ref_summed = x if residual is None else x + residual
    ref_normed = norm_naive.rms_norm(x=ref_summed, weight=norm_w, eps=1e-6)
    eps = torch.finfo(torch.bfloat16).eps
    if with_residual:
        assert (summed.float() - ref_summed.float()).abs().max() <= eps * ref_summed.float().abs().max()
    else:
        assert summed is None
    for got, want in ((normed, ref_normed), (out, naive.linear(x=ref_normed, weight=w))):
        assert not got.isnan().any()
        assert (got.float() - want.float()).abs().max() <= 4 * eps * want.float().abs().max()


def test_rms_norm_linear_takes_the_fused_few_rows(monkeypatch):
    """rms_norm_linear on 2..few_rows rows of a weight of at most FUSED_NORM_MAX_N rows runs the
    norm inside the few-row GEMV (no norm kernel), FP8 weights included, and never with few_rows = 0
    or few_rows_norm off."""
    from deltaserve.layers.kernels import linear as lk
    from deltaserve.layers.kernels import norm as norm_kernels

    calls = []
    monkeypatch.setattr(lk, "_path", lambda x, n, row_gemv, few_rows=0: "rows" if few_rows else "torch")
    monkeypatch.setattr(norm_kernels, "fused_add_rms_norm", lambda **kw: calls.append("norm") or (kw["x"], kw["x"]))
    monkeypatch.setattr(lk, "linear", lambda **kw: calls.append("linear") or kw["x"])
    monkeypatch.setattr(triton_rows, "rows_gemv", lambda **kw: calls.append("fused") or (kw["x"], None, kw["x"]))
    x = torch.zeros(4, 8)
    kw = dict(x=x, residual=x, norm_weight=torch.zeros(8), eps=1e-6, weight=torch.zeros(16, 8))
    lk.rms_norm_linear(**kw)
    assert calls == ["fused"]
    calls.clear()
    lk.rms_norm_linear(**kw, few_rows=0)
    assert calls == ["norm", "linear"]
    calls.clear()
    lk.rms_norm_linear(**kw, few_rows_norm=False)
    assert calls == ["norm", "linear"]
    calls.clear()
    lk.rms_norm_linear(**kw, weight_scale=torch.ones(1, 1))  # FP8 weights take it too
    assert calls == ["fused"]
