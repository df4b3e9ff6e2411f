"""FP8 kernels against their plain-torch references (which dequantize and run in float32): the
per-token-group activation quantization (bit for bit), linear with an FP8 weight on each path
(one-row GEMV with the fused norm and a tail of unquantized rows, skinny GEMM forms, the
block-scaled W8A8 GEMM), and the fused MoE's FP8 pairs and sorted paths. Interpreted on CPU tensors
without CUDA (Triton's interpreter runs float8 dots; its float32 -> float8 cast mis-rounds, so the
kernels round by hand), compiled on the GPU with it; and (marked gpu) the model's real shapes,
outputs NaN-prefilled so that an element never written fails."""

from __future__ import annotations

import functools

import pytest
import torch

from deltaserve.layers.kernels import fp8 as fp8_kernels
from deltaserve.layers.kernels import linear as linear_kernels
from deltaserve.layers.kernels.device import H200, DeviceInfo
from deltaserve.layers.kernels.fp8 import naive as fp8_naive
from deltaserve.layers.kernels.fp8.triton_quant import quantize_act
from deltaserve.layers.kernels.linear import naive, triton_fp8, triton_linear, triton_row, triton_rows
from deltaserve.layers.kernels.moe import naive as moe_naive
from deltaserve.layers.kernels.moe import triton_moe
from deltaserve.layers.kernels.moe.naive import AddNorm, SharedExpert
from deltaserve.layers.kernels.norm import naive as norm_naive

# conftest: TRITON_INTERPRET without CUDA, the `device` fixture, gpu-marked tests skipped on CPU
pytestmark = pytest.mark.usefixtures("nan_fill")
EPS = 1e-6


@functools.cache
def weight(n: int, k: int, block=(128, 128), lead=(), seed: int = 0, device="cpu"):
    """(float8 values, block scales) of a random [*lead, n, k] weight (made once: tests only read it).
    Each block's magnitude is drawn from 2^-3 .. 2^3, so that its scale differs from its neighbours'
    as a trained checkpoint's do: a kernel reading another block's scale (or a dot spanning two
    blocks under one scale) is then off by several times the values, not by the few percent that
    separates the block maxima of one Gaussian."""
    g = torch.Generator(device=device).manual_seed(seed)  # made where it is used: the experts are 0.5 G values
    bn, bk = block
    grid = torch.rand(*lead, -(-n // bn), -(-k // bk), generator=g, device=device) * 6 - 3
    magnitude = fp8_naive.expand_scale(torch.exp2(grid), n, k, block)
    w = torch.randn(*lead, n, k, generator=g, device=device) * k**-0.5 * magnitude
    return fp8_naive.quantize_weight(w, block)


def rand(*shape, dtype=torch.bfloat16, device="cpu", seed: int = 1, scale: float = 1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(device=device, dtype=dtype)


def close(out: torch.Tensor, ref: torch.Tensor, roundings: float = 4) -> bool:
    """Within a few roundings of the output dtype at the output's scale (accumulation orders
    differ; on CPU the interpreter's float32 -> 16-bit casts truncate)."""
    assert out.shape == ref.shape and out.dtype == ref.dtype and not out.isnan().any()
    eps = torch.finfo(out.dtype).eps if out.dtype != torch.float32 else 2.0**-20
    return (out.float() - ref.float()).abs().max().item() <= roundings * eps * ref.float().abs().max().item()


# Hopper's FP8 tensor-core dots keep about 14 bits while they accumulate (DeepSeek-V3 report, 3.3.2),
# under the float32 the interpreter sums in: float32 outputs of FP8 dots are held to that on the GPU
MMA_FP8_ROUNDINGS = 2.0**8  # in float32 roundings (2^-20): 2^-12 of the output's scale


def fp8_dot_roundings(device: torch.device, cpu: float = 8) -> float:
    return MMA_FP8_ROUNDINGS if device.type == "cuda" else cpu


# one of a token's quantized activations on the other float8 neighbour (its float32 inputs summed in
# another order land across the midpoint) moves that token's row by up to ~2e-2 of the output's scale
FLIP_BOUND = 5e-2


def rows_close(out: torch.Tensor, ref: torch.Tensor, roundings: float = 8) -> bool:
    """Float32 outputs of an FP8 path that quantizes activations: every token row within `roundings`
    float32 roundings (as `close`) of the output's scale, except at most one row in 8 (at least one)
    on another float8 neighbour, each within FLIP_BOUND. A systematic error (a scale, a group, the
    rounding, a dtype, a quantization on one side only) moves every row: at 1e-3 of the output's
    scale it is 130 times the tolerance."""
    assert out.shape == ref.shape and out.dtype == ref.dtype == torch.float32 and not out.isnan().any()
    scale = ref.abs().max().item()
    rows = (out - ref).abs().amax(dim=1)
    off = int((rows > roundings * 2.0**-20 * scale).sum())
    return off <= max(1, rows.shape[0] // 8) and rows.max().item() <= FLIP_BOUND * scale


# ---- activation quantization -------------------------------------------------------------------
@pytest.mark.parametrize(("m", "k", "group"), [(3, 200, 128), (5, 64, 128), (2, 1000, 32), (7, 256, 128)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantize_act_bit_for_bit(device, m, k, group, dtype):
    x = rand(m, k + 16, dtype=dtype, device=device, scale=3.0)[:, 8 : 8 + k]  # strided rows
    x[0, :10] = 0  # an all-zero start: the scale floor, zeros out
    x[-1, :5] = 1e-6  # subnormal e4m3 values
    x[-1, 5:8] = -1e-9  # negatives that round to zero: -0, as the cast gives
    q, s = quantize_act(x=x, group=group)
    q_ref, s_ref = fp8_naive.quantize_act(x=x.cpu(), group=group)
    assert torch.equal(s.cpu(), s_ref)
    assert torch.equal(q.cpu().view(torch.uint8), q_ref.view(torch.uint8))


def test_quantize_act_m_major_scales(device):
    """m_major (cuBLAS's 1 x 128 scale layout): the same values, rows fastest in memory."""
    x = rand(5, 384, device=device, scale=3.0)
    q, s = fp8_kernels.quantize_act(x=x, m_major=True)
    q_ref, s_ref = fp8_naive.quantize_act(x=x.cpu(), group=128)
    assert s.shape == (5, 3) and s.stride() == (1, 5)
    assert torch.equal(s.cpu(), s_ref) and torch.equal(q.cpu().view(torch.uint8), q_ref.view(torch.uint8))


def test_cublas_fp8_takes_only_its_layout():
    """cuBLAS's block-scaled GEMM takes 128 x 128 scale blocks over rows of 128 and K of 512; any
    other weight stays on the Triton kernel."""
    ok = triton_fp8.cublas_fp8_ok
    has = hasattr(torch.nn.functional, "scaled_mm")
    assert ok(*weight(256, 2048)) is has
    assert not ok(*weight(256, 2048, block=(64, 128)))  # a TP shard's smaller blocks
    assert not ok(*weight(200, 2048))  # rows not a multiple of 128
    assert not ok(*weight(256, 384))  # three K groups: cuBLAS wants them padded to four


def test_quantize_act_rounds_every_e4m3_tie_to_even(device):
    """Every e4m3 value, every midpoint between two and values just off them, as rows whose amax
    is 448 (scale 1): the kernel's rounding is the cast's (round to nearest even)."""
    grid = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    grid = torch.sort(grid[~grid.isnan()]).values
    mids = (grid[1:] + grid[:-1]) / 2
    values = torch.cat([grid, mids, mids * (1 + 2e-6), mids * (1 - 2e-6)])
    values = values[values.abs() < 448]
    rows = -(-values.numel() // 127)
    x = torch.zeros(rows * 127)
    x[: values.numel()] = values
    x = torch.cat([x.view(rows, 127), torch.full((rows, 1), 448.0)], dim=1).to(device)
    q, s = quantize_act(x=x, group=128)
    assert torch.equal(s.cpu(), torch.ones(rows, 1))
    assert torch.equal(q.cpu().float(), x.cpu().to(torch.float8_e4m3fn).float())


# ---- linear ------------------------------------------------------------------------------------
# two scale rows, the second partial, and K masked over a scale block's tail; two scale rows and four
# scale columns with a power-of-two K and a tail. Default tiles: one row a program, x scaled as a row
@pytest.mark.parametrize(("n", "k", "tail", "block"), [(20, 200, 0, (16, 128)), (32, 128, 6, (16, 32))])
@pytest.mark.parametrize("cfg", [None, dict(block_n=8, num_warps=4), dict(block_n=8, num_warps=4, x_row=False)])
def test_row_gemv_fp8(device, n, k, tail, block, cfg):
    q, s = weight(n, k, block, device=device)
    t = rand(tail, k, device=device, scale=k**-0.5) if tail else None
    x, b = rand(1, k, device=device), rand(n + tail, device=device)
    out, _, _ = triton_row.row_gemv(x=x, weight=q, weight_scale=s, weight_tail=t, bias=b, config=cfg)
    assert close(out, naive.linear(x=x, weight=q, weight_scale=s, weight_tail=t, bias=b))


@pytest.mark.parametrize("block_n", [2, 16])
def test_row_gemv_fp8_fused_norm(device, block_n):
    """The residual add + norm prologue feeds the FP8 dot the normed row, writes the residual and
    the normed row; the tail's programs use the same row."""
    n, k, tail = 32, 96, 3
    q, s = weight(n, k, (8, 32), device=device)
    t = rand(tail, k, device=device, scale=k**-0.5)
    x, res, g = rand(1, k, device=device), rand(1, k, device=device, seed=2), rand(k, device=device, scale=0.1)
    out, normed, summed = triton_row.row_gemv(
        x=x, weight=q, weight_scale=s, weight_tail=t, residual=res, norm_weight=g, eps=EPS, write_normed=True,
        config=dict(block_n=block_n, num_warps=2),
    )  # fmt: skip
    ref_sum = (x.float() + res.float()).to(x.dtype)
    ref_normed = norm_naive.rms_norm(x=ref_sum, weight=g, eps=EPS)
    assert close(summed, ref_sum, 1) and close(normed, ref_normed, 2)
    assert close(out, naive.linear(x=ref_normed, weight=q, weight_scale=s, weight_tail=t))


# the few-row GEMV over FP8 weights (2..FEW_ROWS_MAX rows: small decode batches, speculative verifies):
# rows past a group, the scale grids and tails of the one-row cases, forced tiles with blocks past N
@pytest.mark.parametrize(("n", "k", "tail", "block"), [(20, 200, 0, (16, 128)), (32, 128, 6, (16, 32))])
@pytest.mark.parametrize(("m", "cfg"), [(2, None), (5, None), (3, dict(block_n=8, num_warps=2, group=2))])
@pytest.mark.parametrize("preload", [True, False])
def test_rows_gemv_fp8(device, n, k, tail, block, m, cfg, preload):
    q, s = weight(n, k, block, device=device)
    t = rand(tail, k, device=device, scale=k**-0.5) if tail else None
    x, b = rand(m, k, device=device), rand(n + tail, device=device)
    out, _, _ = triton_rows.rows_gemv(
        x=x, weight=q, weight_scale=s, weight_tail=t, bias=b, config=cfg, preload=preload
    )  # fmt: skip
    assert out.shape == (m, n + tail)
    assert close(out, naive.linear(x=x, weight=q, weight_scale=s, weight_tail=t, bias=b))


def test_rows_gemv_fp8_fused_norm(device):
    """The few-row GEMV's residual add + norm in front of an FP8 dot (the MoE input at a small batch):
    every row's sum and normed row written, the projection the composition's, tail rows included."""
    m, n, k, tail = 3, 32, 96, 3
    q, s = weight(n, k, (8, 32), device=device)
    t = rand(tail, k, device=device, scale=k**-0.5)
    x, res, g = rand(m, k, device=device), rand(m, k, device=device, seed=2), rand(k, device=device, scale=0.1)
    out, normed, summed = triton_rows.rows_gemv(
        x=x, weight=q, weight_scale=s, weight_tail=t, residual=res, norm_weight=g, eps=EPS, write_normed=True,
        config=dict(block_n=4, num_warps=2, group=2),
    )  # fmt: skip
    ref_sum = (x.float() + res.float()).to(x.dtype)
    ref_normed = norm_naive.rms_norm(x=ref_sum, weight=g, eps=EPS)
    assert close(summed, ref_sum, 1) and close(normed, ref_normed, 2)
    assert close(out, naive.linear(x=ref_normed, weight=q, weight_scale=s, weight_tail=t))


def test_rows_gemv_fp8_tiles():
    """FP8 tiles on the H200 at the model's shapes: FP8_W_PER_THREAD weights a thread, at least a program
    an SM, the group at most the rows and FP8_MAX_GROUP."""
    info = DeviceInfo(H200, num_sms=132, smem_per_block=232448, capability=(9, 0))
    for n, k in [(12352, 2048), (9216, 2048), (2048, 4096), (1288, 2048), (64, 2048)]:
        for m in (2, 3, 4, 8):
            cfg = triton_rows.pick_config(m, n, k, info, fp8=True)
            assert cfg["block_n"] * k <= triton_rows.FP8_W_PER_THREAD * 32 * cfg["num_warps"]
            assert cfg["block_n"] == 1 or n >= cfg["block_n"] * info.num_sms
            assert cfg["group"] <= min(triton_rows.triton.next_power_of_2(m), triton_rows.FP8_MAX_GROUP)
    assert triton_rows.pick_config(2, 12352, 2048, info, fp8=True) == dict(block_n=8, num_warps=4, group=2)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [2, 3, 4, 8])
@pytest.mark.parametrize(("n", "tail", "k"), [(12288, 64, 2048), (9216, 0, 2048), (2048, 0, 4096), (1024, 264, 2048)])
def test_gpu_rows_gemv_fp8_real_shapes(m, n, tail, k):
    """The model's FP8 projections at 2..8 rows: the few-row GEMV matches the dequantized reference,
    and the linear op takes it up to FP8_FEW_ROWS_MAX rows."""
    q, s = weight(n, k, device="cuda")
    t = rand(tail, k, device="cuda", scale=k**-0.5) if tail else None
    x = rand(m, k, device="cuda")
    out = triton_rows.rows_gemv(x=x, weight=q, weight_scale=s, weight_tail=t)[0]
    if m <= linear_kernels.FP8_FEW_ROWS_MAX:  # the op takes it, bit for bit
        assert torch.equal(out, linear_kernels.linear(x=x, weight=q, weight_scale=s, weight_tail=t))
    assert close(out, naive.linear(x=x, weight=q, weight_scale=s, weight_tail=t))


def test_fp8_dispatch_by_rows(monkeypatch):
    """An FP8 weight on CUDA: one row the one-row GEMV, 2..min(few_rows, FP8_FEW_ROWS_MAX) rows the
    few-row GEMV (scales and tail passed on), more the skinny GEMM; few_rows = 0 keeps 2 rows on the
    skinny GEMM."""
    calls = []
    monkeypatch.setattr(linear_kernels, "_path", lambda x, n, row_gemv, few_rows=0: "rows" if few_rows else "skinny")
    monkeypatch.setattr(triton_rows, "rows_gemv", lambda **kw: calls.append(("rows", kw)) or (kw["x"], None, None))
    monkeypatch.setattr(triton_linear, "linear", lambda **kw: calls.append(("skinny", kw)) or kw["x"])

    class Cuda(torch.Tensor):  # passes _linear_fp8's device test; the kernels are stubbed above
        is_cuda = True

    x = torch.zeros(2, 8).as_subclass(Cuda)
    q, s, t = torch.zeros(16, 8, dtype=torch.float8_e4m3fn), torch.ones(1, 1), torch.zeros(3, 8)
    linear_kernels.linear(x=x, weight=q, weight_scale=s, weight_tail=t)
    linear_kernels.linear(x=x, weight=q, weight_scale=s, weight_tail=t, few_rows=0)
    assert [c[0] for c in calls] == ["rows", "skinny"]
    seen = []  # the rows bound the FP8 path asks for: FP8_FEW_ROWS_MAX at most
    monkeypatch.setattr(linear_kernels, "_path", lambda x, n, row_gemv, few_rows=0: seen.append(few_rows) or "skinny")
    linear_kernels.linear(x=x, weight=q, weight_scale=s, few_rows=8)
    assert seen == [linear_kernels.FP8_FEW_ROWS_MAX]
    assert calls[0][1]["weight_scale"] is s and calls[0][1]["weight_tail"] is t


SKINNY = {
    "default": None,
    "gemv1": dict(block_m=1, block_n=16, block_k=32, split_k=1),
    "gemv2_split3": dict(block_m=2, block_n=8, block_k=16, split_k=3),
    "gemv4_split4_pass": dict(block_m=4, block_n=8, block_k=64, split_k=4, reduce="pass"),
    "mma": dict(block_n=16, block_k=32, split_k=1, dot=True, num_stages=2),
    "mma_split3": dict(block_n=32, block_k=128, split_k=3, dot=True, num_stages=2),
}


@pytest.mark.parametrize("name", list(SKINNY))
@pytest.mark.parametrize(
    ("m", "n", "k", "block", "tail", "dtype"),
    [
        # K over a scale block's tail; 48 FP8 rows and a tail: a 32-wide tile shrinks to 16
        (3, 48, 200, (128, 128), 6, torch.float32),
        # small blocks (several scale rows and columns a tile), row blocks with a partial last one,
        # K split 3 and 4 ways
        (5, 32, 256, (16, 32), 5, torch.float16),
        # whole row blocks (the MMA form's 16), 8-row scale blocks, K's tail past the last scale block
        (16, 16, 264, (8, 128), 0, torch.float16),
    ],
)
def test_skinny_fp8(device, name, m, n, k, block, tail, dtype):
    q, s = weight(n, k, block, device=device)
    t = rand(tail, k, dtype=dtype, device=device, scale=k**-0.5) if tail else None
    x, b = rand(m, k, dtype=dtype, device=device), rand(n + tail, dtype=dtype, device=device)
    out = triton_linear.linear(x=x, weight=q, weight_scale=s, weight_tail=t, bias=b, config=SKINNY[name])
    assert close(out, naive.linear(x=x, weight=q, weight_scale=s, weight_tail=t, bias=b))


@pytest.mark.parametrize(
    ("m", "n", "k", "block", "tail", "dtype"),
    [
        (33, 40, 200, (128, 128), 0, torch.float32),
        (17, 64, 256, (128, 128), 5, torch.bfloat16),
        (20, 48, 96, (16, 32), 3, torch.float32),
    ],
)
def test_block_scaled_gemm(device, m, n, k, block, tail, dtype):
    """x quantized per 1 x 128 group, FP8 dots scaled per K step: the W8A8 reference."""
    q, s = weight(n, k, block, device=device)
    t = rand(tail, k, dtype=dtype, device=device, scale=k**-0.5) if tail else None
    x, b = rand(m, k + 8, dtype=dtype, device=device)[:, :k], rand(n + tail, dtype=dtype, device=device)
    out = triton_fp8.fp8_linear(x=x, weight=q, weight_scale=s, bias=b, weight_tail=t)
    ref = naive.linear(x=x, weight=q, weight_scale=s, weight_tail=t, bias=b, quantize_x=True)
    assert close(out, ref, 8 if dtype != torch.float32 else fp8_dot_roundings(device))


# partial row and column blocks, small blocks, strided rows (a fused projection's slice), an
# output with spare rows (a weight's tail goes there)
@pytest.mark.parametrize(("n", "k", "block", "extra"), [(40, 200, (128, 128), 0), (33, 96, (16, 32), 5)])
def test_dequantize_weight_bit_for_bit(device, n, k, block, extra):
    """The Triton dequantization rounds q * s (float32) to bf16 once, as the reference: bit for bit
    compiled; interpreted, within the one bf16 step of the interpreter's truncating cast."""
    from deltaserve.layers.kernels.fp8.triton_dequant import dequantize_weight

    q, s = weight(n, k, block, device=device)
    wide = torch.zeros(n, k + 16, dtype=q.dtype, device=device)
    wide[:, :k] = q
    out = torch.empty(n + extra, k, dtype=torch.bfloat16, device=device)
    tail = rand(extra, k, dtype=torch.bfloat16, device=device) if extra else None  # copied in the same launch
    dequantize_weight(q=wide[:, :k], scale=s, block=block, out=out, tail=tail)
    ref = fp8_naive.dequantize_weight(q.cpu(), s.cpu(), dtype=torch.bfloat16)
    if device.type == "cuda":
        assert torch.equal(out[:n].cpu(), ref)
    else:
        exact = fp8_naive.dequantize_weight(q.cpu(), s.cpu())
        assert ((out[:n].float() - exact).abs() <= exact.abs() * 2.0**-7).all() and not out[:n].isnan().any()
    if extra:
        assert torch.equal(out[n:], tail)


@pytest.mark.parametrize(("m", "n", "k", "block", "tail"), [(33, 40, 200, (128, 128), 0), (17, 48, 96, (16, 32), 3)])
def test_fp8_linear_dequant_backend(device, m, n, k, block, tail):
    """fp8_gemm="dequant": the weight (and its tail) dequantized to x's dtype, one bf16 GEMM on x as
    it is: the W8A16 reference within a few bf16 roundings (the weight rounded to bf16 once)."""
    q, s = weight(n, k, block, device=device)
    t = rand(tail, k, device=device, scale=k**-0.5) if tail else None
    x, b = rand(m, k + 8, device=device)[:, :k], rand(n + tail, device=device)
    out = triton_fp8.fp8_linear(x=x, weight=q, weight_scale=s, bias=b, weight_tail=t, backend="dequant")
    ref = naive.linear(x=x, weight=q, weight_scale=s, weight_tail=t, bias=b, quantize_x=False)
    assert close(out, ref, 8) and real_close(out, ref)


def test_which_fp8_passes_quantize_x():
    """linear's FP8 paths by rows: the GEMVs (up to 16 rows) and the dequantized weight's GEMM (from
    DEQUANT_MIN_ROWS) take x as it is; the W8A8 GEMMs quantize it, and take dequant's decode batches;
    "w8a16" never does."""
    rule = fp8_naive.gemm_quantizes_x
    assert fp8_naive.GEMV_MAX_ROWS == linear_kernels.MAX_TUNED_TOKENS
    assert [rule(m, "dequant") for m in (1, 16, 17, 127, 128, 2048)] == [False, False, True, True, False, False]
    assert [rule(m, "triton") for m in (16, 17, 128, 2048)] == [False, True, True, True]
    assert rule(2048, "cublas")
    assert not any(rule(m, "w8a16") for m in (1, 16, 17, 127, 128, 2048))  # fp8_activations="unquantized"


@pytest.mark.parametrize("fp8_gemm", ["dequant", "triton", "w8a16"])
@pytest.mark.parametrize("m", [1, 4, 16, 17, 130])
def test_linear_op_fp8_paths(device, m, fp8_gemm):
    """The op: up to 16 rows x as it is (GEMV / skinny on CUDA); above, the GEMM: x quantized for
    the W8A8 one and dequant's decode batches, as it is on the dequantized weight from 128 rows and,
    under w8a16, at every size (the CPU reference alike)."""
    q, s = weight(40, 128, device=device)
    x = rand(m, 128, device=device)
    out = linear_kernels.linear(x=x, weight=q, weight_scale=s, fp8_gemm=fp8_gemm)
    quantize_x = fp8_naive.gemm_quantizes_x(m, fp8_gemm)
    assert close(out, naive.linear(x=x, weight=q, weight_scale=s, quantize_x=quantize_x), 8)


# ---- fused MoE -----------------------------------------------------------------------------------
def moe_case(t, e, h, i, top_k, b13, b2, shared_i, device, dtype=torch.float16):
    q13, s13 = weight(2 * i, h, b13, lead=(e,), device=device)
    q2, s2 = weight(h, i, b2, lead=(e,), seed=3, device=device)
    hidden = rand(t, h, dtype=dtype, device=device)
    logits = rand(t, e, dtype=torch.float32, device=device, seed=4)
    weights, ids = moe_naive.route_topk_softmax(router_logits=logits.cpu(), top_k=top_k, renormalize=True)
    shared = None
    if shared_i:
        qs, ss = weight(h, shared_i, b2, device=device, seed=5)  # w2's block
        gate_up, gate = (
            rand(t, 2 * shared_i, dtype=dtype, device=device, seed=6),
            rand(t, 1, dtype=dtype, device=device),
        )
        shared = SharedExpert(gate_up=gate_up, w2=qs, gate_logit=gate, w2_scale=ss)
    return dict(hidden=hidden, w13=q13, w2=q2, w13_scale=s13, w2_scale=s2, shared=shared), weights, ids, logits


# (tokens, experts, hidden, inter, top_k, w13 block, w2 block (the shared expert's too), shared
# inter): 128 x 128 blocks with tails (hidden 140: a second, 12-row block of w2's rows, K past w13's
# first block, masked K chunks, a partial last row block of the down GEMV), x scaled as a row; and
# blocks of 4 rows (each weight scaled on the GEMVs, whose tiles are 8 rows on CPU) with hidden a
# multiple of the GEMVs' K chunk (unmasked loads), two scale groups a chunk, top-3, and the shared
# expert wider than the down GEMV's chunk (its rows streamed in two, not preloaded)
MOE_CASES = [(3, 6, 140, 40, 2, (128, 128), (128, 128), 0), (3, 4, 128, 32, 3, (4, 64), (4, 16), 48)]


def on_cpu(args: dict) -> dict:
    cpu = {k: (v if not isinstance(v, torch.Tensor) else v.cpu()) for k, v in args.items()}
    if args["shared"] is not None:
        cpu["shared"] = SharedExpert(*(v if v is None else v.cpu() for v in args["shared"]))
    return cpu


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("path", ["pairs", "sorted"])
@pytest.mark.parametrize("case", MOE_CASES)
def test_fused_moe_fp8(device, path, case, dtype):
    """Pairs path: FP8 weights dequantized in registers, x as it is; sorted path: FP8 dots on
    quantized x and act (the reference told which). Float32: to float32 rounding. float16: act is
    stored in float16 before its quantization, so a rounding of act one way on one side and the
    other way on the other (the interpreter's casts truncate) flips its float8 value: 4 roundings."""
    args, weights, ids, _ = moe_case(*case, device=device, dtype=dtype)
    out = triton_moe.fused_moe(**args, topk_weights=weights.to(device), topk_ids=ids.to(device), path=path)
    ref = moe_naive.fused_moe(**on_cpu(args), topk_weights=weights, topk_ids=ids, quantize=path == "sorted")
    assert rows_close(out.cpu(), ref) if dtype == torch.float32 else close(out.cpu(), ref, 4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("case", MOE_CASES)
def test_fused_moe_fp8_sorted_unquantized_activations(device, case, dtype):
    """The sorted path with fp8_quantize_acts=False (W8A16): x and act as they are, the FP8 weights
    converted for the dots and scaled after them: the dequantized reference without the activations'
    quantization (act stored in hidden's dtype between the GEMMs on both sides)."""
    args, weights, ids, _ = moe_case(*case, device=device, dtype=dtype)
    out = triton_moe.fused_moe(
        **args, topk_weights=weights.to(device), topk_ids=ids.to(device), path="sorted", fp8_quantize_acts=False
    )
    ref = moe_naive.fused_moe(
        **on_cpu(args), topk_weights=weights, topk_ids=ids, quantize=True, fp8_quantize_acts=False
    )
    assert rows_close(out.cpu(), ref) if dtype == torch.float32 else close(out.cpu(), ref, 4)
    quantized = moe_naive.fused_moe(**on_cpu(args), topk_weights=weights, topk_ids=ids, quantize=True)
    moved = (quantized.float() - ref.float()).abs().max().item()
    if moe_naive.fp8_dots_fit(args["w13"], args["w13_scale"], args["w2"], args["w2_scale"]):
        # the activations' quantization moves the result by far more: the flag is what the kernels followed
        assert moved > 1e-3 * ref.float().abs().max().item()
    else:  # scale blocks narrower than an FP8 dot's K: the activations stay unquantized either way
        assert moved == 0.0


def test_routed_moe_fp8_sorted_prefill(device):
    """The FP8 MoE block in a prefill pass (float32), routed by the router kernel: 40 tokens top-2
    over 8 experts of width 48 (80 routed pairs: the sorted path, x and act quantized), hidden 160
    (x in two 128-column scale groups and w13 in two scale blocks along K, the second partial; w2's
    rows in two scale blocks), the shared expert (width 48, its down projection on linear's W8A8
    path above 16 rows) and the next norm in the sum kernel."""
    args, _, _, logits = moe_case(40, 8, 160, 48, 2, (128, 128), (128, 128), 48, device=device, dtype=torch.float32)
    residual = rand(40, 160, dtype=torch.float32, device=device, seed=7)
    g = rand(160, dtype=torch.float32, device=device, scale=0.1)
    add_norm = AddNorm(residual, g, EPS)
    normed, summed = triton_moe.routed_moe(**args, router_logits=logits, top_k=2, renormalize=True, add_norm=add_norm)
    ref = moe_naive.routed_moe(
        **on_cpu(args), router_logits=logits.cpu(), top_k=2, renormalize=True,
        add_norm=AddNorm(residual.cpu(), g.cpu(), EPS),
    )  # fmt: skip
    tol = fp8_dot_roundings(device)
    assert rows_close(summed.cpu(), ref.residual, tol) and rows_close(normed.cpu(), ref.normed, tol)
    # the GEMMs as persistent programs (each looping over tiles): the same bits
    add_norm = AddNorm(residual, g, EPS)
    again = triton_moe.routed_moe(
        **args, router_logits=logits, top_k=2, renormalize=True, add_norm=add_norm, sorted_persistent="flat"
    )
    assert torch.equal(again.normed, normed) and torch.equal(again.residual, summed)


def test_routed_moe_fp8_with_next_norm(device):
    """Routing in the up GEMV, the shared expert folded into the down GEMV, the next norm in its
    last program: all with FP8 weights."""
    args, _, _, logits = moe_case(2, 6, 140, 40, 2, (128, 128), (128, 128), 24, device=device)
    residual, g = (
        rand(2, 140, dtype=torch.float16, device=device, seed=7),
        rand(140, dtype=torch.float16, device=device),
    )
    add_norm = AddNorm(residual, g, EPS)
    normed, summed = triton_moe.routed_moe(**args, router_logits=logits, top_k=2, renormalize=True, add_norm=add_norm)
    cpu_norm = AddNorm(residual.cpu(), g.cpu(), EPS)
    ref = moe_naive.routed_moe(**on_cpu(args), router_logits=logits.cpu(), top_k=2, renormalize=True, add_norm=cpu_norm)
    assert close(summed.cpu(), ref.residual, 4) and close(normed.cpu(), ref.normed, 8)


# the pairs path's FP8 up GEMVs with K chunks of 128: four 32-column scale groups a chunk (each
# group summed, then scaled once) or one group of a 128 x 128 block, a 12-column K tail (hidden 140)
FP8_GROUPED_TILES = dict(
    up=dict(block_n=2, block_k=128, num_warps=2),
    up_route=dict(block_n=1, block_k=128, num_warps=1),
    down=dict(block_h=4, block_i=32, num_warps=2),
)


@pytest.mark.parametrize("b13", [(4, 32), (128, 128)])
def test_fused_moe_fp8_pairs_grouped_scales(device, b13):
    """The FP8 up GEMV's per-group scaling, routing first and routing in the up GEMV, against the
    dequantized float32 reference (x as it is)."""
    args, weights, ids, logits = moe_case(3, 6, 140, 40, 2, b13, (4, 16), 0, device=device, dtype=torch.float32)
    out = triton_moe.fused_moe(
        **args, topk_weights=weights.to(device), topk_ids=ids.to(device), path="pairs", config=FP8_GROUPED_TILES
    )
    ref = moe_naive.fused_moe(**on_cpu(args), topk_weights=weights, topk_ids=ids)
    assert rows_close(out.cpu(), ref)
    routed = triton_moe.routed_moe(
        **args, router_logits=logits, top_k=2, renormalize=True, path="pairs", config=FP8_GROUPED_TILES
    )
    assert rows_close(routed.cpu(), ref)


# ---- the model's shapes on the GPU ---------------------------------------------------------------
# (N8, tail, K): GDN in_proj, attention q_gate | k | v, o_proj / out_proj, MoE in_proj, shared down
REAL_LINEAR = [(12288, 64, 2048), (9216, 0, 2048), (2048, 0, 4096), (1024, 264, 2048), (2048, 0, 512)]
# rows of each linear path: the one-row GEMV, skinny GEMMs (up to 16), the W8A8 GEMM's split-K tiles
# (17 .. 256) and its 128 x 128 tiles (a bench prompt's 936 rows: partial tiles; 8k: the largest chunk)
REAL_ROWS = [1, 4, 8, 16, 17, 64, 200, 936, 2048, 8192]


def real_close(out: torch.Tensor, ref: torch.Tensor, rms: float = 2e-2, row: float = 6e-2) -> bool:
    """bf16 outputs at the model's shapes against the float32 reference: written everywhere (the
    outputs are NaN-prefilled), the whole within `rms` relative RMS and every token row within `row`
    of its own norm (a row read from or written to the wrong place moves by its whole norm; another
    block's scale, by the 2^-3 .. 2^3 between blocks). bf16 rounding gives ~3e-3; the interpreter's
    truncating casts 1.8e-2 and 4.5e-2 on the MoE's sorted path (a bf16 act on another float8 value)."""
    assert out.shape == ref.shape and out.dtype == ref.dtype and not out.isnan().any()
    diff, ref32 = out.float() - ref.float(), ref.float()
    whole = (diff.norm() / ref32.norm()).item()
    rows = (diff.norm(dim=1) / ref32.norm(dim=1).clamp_min(1e-30)).max().item()
    return whole <= rms and rows <= row


@pytest.mark.gpu
@pytest.mark.parametrize("m", REAL_ROWS)
@pytest.mark.parametrize(("n", "tail", "k"), REAL_LINEAR)
def test_gpu_linear_fp8_real_shapes(m, n, tail, k):
    q, s = weight(n, k, device="cuda")
    t = rand(tail, k, device="cuda", scale=k**-0.5) if tail else None
    x = rand(m, k, device="cuda")
    out = linear_kernels.linear(x=x, weight=q, weight_scale=s, weight_tail=t, fp8_gemm="triton")
    ref = naive.linear(x=x, weight=q, weight_scale=s, weight_tail=t, quantize_x=m > linear_kernels.MAX_TUNED_TOKENS)
    assert close(out, ref, 8) and real_close(out, ref)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["cublas", "dequant"])
@pytest.mark.parametrize("m", [64, 301, 2048, 2049])  # cuBLAS: rows padded to a multiple of 4; dequant from 128
@pytest.mark.parametrize(("n", "tail", "k"), REAL_LINEAR)
def test_gpu_linear_fp8_other_backends(backend, m, n, tail, k):
    """fp8_gemm="cublas": cuBLAS's block-scaled GEMM (where it takes the weight) against the same
    quantization in float32; "dequant": cuBLAS's bf16 GEMM on the dequantized weight against the
    reference with x as it is; tail rows and all columns written."""
    q, s = weight(n, k, device="cuda")
    t = rand(tail, k, device="cuda", scale=k**-0.5) if tail else None
    x = rand(m, k, device="cuda")
    out = linear_kernels.linear(x=x, weight=q, weight_scale=s, weight_tail=t, fp8_gemm=backend)
    quantize_x = fp8_naive.gemm_quantizes_x(m, backend)
    ref = naive.linear(x=x, weight=q, weight_scale=s, weight_tail=t, quantize_x=quantize_x)
    assert close(out, ref, 8) and real_close(out, ref)


@pytest.mark.gpu
@pytest.mark.parametrize("k", [512, 2048, 4096])
def test_gpu_quantize_act_real_widths(k):
    """The activation quantizer at the projections' input widths and 8k rows, bit for bit."""
    x = rand(8192, k, device="cuda", scale=3.0)
    q, s = quantize_act(x=x, group=128)
    q_ref, s_ref = fp8_naive.quantize_act(x=x.cpu(), group=128)
    assert torch.equal(s.cpu(), s_ref) and torch.equal(q.cpu().view(torch.uint8), q_ref.view(torch.uint8))


@pytest.mark.gpu
def test_gpu_rms_norm_linear_fp8_moe_in_proj():
    """The MoE input projection at batch 1: norm fused into the FP8 row GEMV with its 264-row tail."""
    n, tail, k = 1024, 264, 2048
    q, s = weight(n, k, device="cuda")
    t = rand(tail, k, device="cuda", scale=k**-0.5)
    x, res, g = rand(1, k, device="cuda"), rand(1, k, device="cuda", seed=2), rand(k, device="cuda", scale=0.1)
    out = linear_kernels.rms_norm_linear(
        x=x, residual=res, norm_weight=g, eps=EPS, weight=q, weight_scale=s, weight_tail=t, write_normed=True
    )
    ref_normed = norm_naive.rms_norm(x=(x.float() + res.float()).to(x.dtype), weight=g, eps=EPS)
    assert torch.equal(out.normed, ref_normed)
    assert close(out.out, naive.linear(x=ref_normed, weight=q, weight_scale=s, weight_tail=t))


@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 4, 8, 16, 64, 2048])
def test_gpu_fused_moe_fp8_real_shapes(t):
    """256 experts of width 512 over hidden 2048, top-8, the shared expert (width 512) in FP8."""
    args, weights, ids, logits = moe_case(
        t, 256, 2048, 512, 8, (128, 128), (128, 128), 512, device="cuda", dtype=torch.bfloat16
    )
    out = triton_moe.routed_moe(**args, router_logits=logits, top_k=8, renormalize=True)
    ref = moe_naive.routed_moe(**args, router_logits=logits, top_k=8, renormalize=True)
    assert close(out, ref, 8) and real_close(out, ref)


@pytest.mark.gpu
@pytest.mark.parametrize("t", [64, 2048])
def test_gpu_fused_moe_fp8_unquantized_activations_real_shapes(t):
    """The sorted path's W8A16 form (fp8_quantize_acts=False) at the model's MoE shape, bf16: the
    dequantized reference without the activations' quantization."""
    args, weights, ids, logits = moe_case(
        t, 256, 2048, 512, 8, (128, 128), (128, 128), 512, device="cuda", dtype=torch.bfloat16
    )
    kw = dict(router_logits=logits, top_k=8, renormalize=True, fp8_quantize_acts=False)
    out = triton_moe.routed_moe(**args, **kw)
    ref = moe_naive.routed_moe(**args, **kw)
    assert close(out, ref, 8) and real_close(out, ref)


@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 8, 9, 64, 936, 8192])
def test_gpu_routed_moe_fp8_real_shapes_with_next_norm(t):
    """The model's MoE block as the decoder layer runs it: the next norm applied in the block's last
    kernel (pairs path: routing in the up GEMV up to 8 tokens, the shared expert in the down GEMV;
    sorted path from 9 tokens: 72 pairs, then ~29 and 256 rows per expert at 936 and 8k tokens)."""
    args, _, _, logits = moe_case(
        t, 256, 2048, 512, 8, (128, 128), (128, 128), 512, device="cuda", dtype=torch.bfloat16
    )
    residual = rand(t, 2048, device="cuda", seed=7)
    g = rand(2048, device="cuda", seed=8, scale=0.1)
    normed, summed = triton_moe.routed_moe(
        **args, router_logits=logits, top_k=8, renormalize=True, add_norm=AddNorm(residual.clone(), g, EPS)
    )
    ref = moe_naive.routed_moe(
        **args, router_logits=logits, top_k=8, renormalize=True, add_norm=AddNorm(residual.clone(), g, EPS)
    )
    assert real_close(summed, ref.residual) and real_close(normed, ref.normed)


@pytest.mark.gpu
@pytest.mark.parametrize("how", ["loop", "flat"])
@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("t", [2048, 8192])
def test_gpu_sorted_moe_persistent_equals_one_program_a_tile(t, fp8, how):
    """The sorted path's GEMMs as persistent programs (each looping over tiles; "flat": the tile and K
    loops as one pipelined loop) write the bits of one program a tile, bf16 and FP8 experts at the
    model's shape."""
    args, _, _, logits = moe_case(
        t, 256, 2048, 512, 8, (128, 128), (128, 128), 512, device="cuda", dtype=torch.bfloat16
    )
    if not fp8:  # the same experts in bf16, no shared expert
        bf16 = functools.partial(fp8_naive.dequantize_weight, dtype=torch.bfloat16)
        args = dict(args, w13=bf16(args["w13"], args["w13_scale"]), w2=bf16(args["w2"], args["w2_scale"]))
        args.update(w13_scale=None, w2_scale=None, shared=None)
    kw = dict(router_logits=logits, top_k=8, renormalize=True)
    plain = triton_moe.routed_moe(**args, **kw)
    assert torch.equal(triton_moe.routed_moe(**args, **kw, sorted_persistent=how), plain)


@pytest.mark.gpu
def test_gpu_block_scaled_gemm_uses_wgmma():
    """On sm_90 the prefill GEMM's dots are FP8 wgmma (QGMMA in the SASS's PTX form: wgmma ... e4m3)."""
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("wgmma needs sm_90")
    q, s = weight(2048, 2048, device="cuda")
    x = rand(256, 2048, device="cuda")
    triton_fp8.fp8_linear(x=x, weight=q, weight_scale=s)
    caches = [part for entry in triton_fp8._fp8_gemm_kernel.device_caches.values() for part in entry]
    kernels = [k for part in caches if isinstance(part, dict) for k in part.values() if hasattr(k, "asm")]
    assert kernels and any("wgmma" in k.asm["ptx"] and "e4m3.e4m3" in k.asm["ptx"] for k in kernels)


def test_scale_block_read_off_the_shapes():
    assert fp8_kernels.scale_block(12288, 2048, (96, 16)) == (128, 128)
    assert fp8_kernels.scale_block(48, 40, (1, 1)) == (64, 64)
    assert fp8_kernels.scale_block(64, 512, (1, 4)) == (64, 128)
    assert fp8_kernels.scale_block(100, 256, (2, 16)) == (64, 16)
    with pytest.raises(ValueError, match="no power-of-two block"):
        fp8_kernels.scale_block(1000, 256, (3, 2))


def test_float8_without_scales_is_an_error():
    """A float8 weight handed over without its scales (a weight that lost them) is an error, never
    read as plain values."""
    q, s = weight(16, 128)
    x = rand(2, 128)
    with pytest.raises(ValueError, match="weight_scale"):
        linear_kernels.linear(x=x, weight=q)
    with pytest.raises(ValueError, match="weight_tail"):
        linear_kernels.linear(x=x, weight=x, weight_tail=x)
    args, weights, ids, _ = moe_case(2, 4, 128, 32, 2, (128, 128), (128, 128), 0, device="cpu")
    with pytest.raises(ValueError, match="w13_scale"):
        moe_naive.fused_moe(**{**args, "w13_scale": None, "w2_scale": None}, topk_weights=weights, topk_ids=ids)


@pytest.mark.parametrize("split_k", [2, 3])
def test_block_scaled_gemm_split_k(device, split_k):
    """Decode-batch tiles: K split, the partials summed in split order (bias added once)."""
    q, s = weight(48, 384, device=device)  # two column tiles (the second partial); 3 K steps: 2 + 1, 1 + 1 + 1
    t = rand(5, 384, device=device, scale=384**-0.5)
    x, b = rand(20, 384, device=device), rand(53, device=device)
    cfg = dict(block_m=16, block_n=32, block_k=128, group_m=2, num_warps=4, num_stages=1, split_k=split_k)
    out = triton_fp8.fp8_linear(x=x, weight=q, weight_scale=s, bias=b, weight_tail=t, config=cfg)
    again = triton_fp8.fp8_linear(x=x, weight=q, weight_scale=s, bias=b, weight_tail=t, config=cfg)
    assert torch.equal(out, again)
    assert close(out, naive.linear(x=x, weight=q, weight_scale=s, weight_tail=t, bias=b, quantize_x=True), 8)


def test_block_scaled_gemm_tiles_stream_decode_batches():
    """Up to 256 rows the weight bounds the time: K splits until ~2 programs per SM (o_proj at 64
    rows: 32 column blocks x 16 splits of 256 columns); prefill sizes take whole-K 128 x 128 tiles."""
    info = DeviceInfo(H200, 132, 227 * 1024, (9, 0))
    cfg = triton_fp8.pick_config(64, 2048, 4096, info)
    assert (cfg["block_m"], cfg["block_n"], cfg["split_k"]) == (64, 64, 16)
    assert triton_fp8.pick_config(2048, 2048, 4096, info)["split_k"] == 1


def test_row_gemv_fp8_tiles_from_their_own_table(monkeypatch):
    """An FP8 one-row projection takes TUNED_ROW_FP8's tile for its shape (the FP8 row sweep's
    output), else twice the bf16 entry's rows; bf16 keeps its own entry."""
    from deltaserve.layers.kernels.linear import tuned

    info = DeviceInfo(H200, 132, 227 * 1024, (9, 0))
    bf16 = triton_row.pick_config(12352, 2048, info)
    monkeypatch.setitem(tuned.TUNED_ROW_FP8, H200, {})
    assert triton_row.pick_config(12352, 2048, info, fp8=True) == dict(bf16, block_n=2 * bf16["block_n"])
    monkeypatch.setitem(tuned.TUNED_ROW_FP8, H200, {(12352, 2048): dict(block_n=8, num_warps=8)})
    assert triton_row.pick_config(12352, 2048, info, fp8=True) == dict(block_n=8, num_warps=8)
    assert triton_row.pick_config(12352, 2048, info) == bf16


def test_pairs_path_fp8_tiles_from_their_own_table(monkeypatch):
    """FP8 experts on the pairs path take PAIRS_TILES_FP8's measured kernels, the rest bf16's with the
    up GEMVs' K chunk doubled; bf16 experts keep their own."""
    from deltaserve.layers.kernels.moe import tiles

    info = DeviceInfo(H200, 132, 227 * 1024, (9, 0))
    bf16 = tiles.pairs_config(2048, 512, info)
    monkeypatch.setitem(tiles.PAIRS_TILES_FP8, H200, {})
    fp8 = tiles.pairs_config(2048, 512, info, fp8=True)
    assert fp8["up_route"]["block_k"] == min(2 * bf16["up_route"]["block_k"], 2048) and fp8["down"] == bf16["down"]
    route = dict(block_n=2, block_k=1024, num_warps=2)
    monkeypatch.setitem(tiles.PAIRS_TILES_FP8, H200, {"up_route": route})
    assert tiles.pairs_config(2048, 512, info, fp8=True)["up_route"] == route
    assert tiles.pairs_config(2048, 512, info, fp8=True)["up"] == fp8["up"]
    assert tiles.pairs_config(2048, 512, info) == bf16
