"""The one-row GEMV (triton_row.py) and the input norm fused into it (`rms_norm_linear`) against the
plain-torch composition norm -> linear: odd N and K (K not a power of two: masked columns), with and
without the residual add, bias, the normed row written or not, weights loaded before or after the
wait; interpreted on CPU tensors without CUDA, compiled on the GPU with it; and (marked gpu) bf16 at
the model's shapes, eager and inside a CUDA graph."""

import pytest
import torch

from deltaserve.layers.kernels import device as device_module
from deltaserve.layers.kernels import linear as linear_kernels
from deltaserve.layers.kernels import norm as norm_kernels
from deltaserve.layers.kernels.device import DeviceInfo
from deltaserve.layers.kernels.linear import naive, triton_row
from deltaserve.layers.kernels.linear.tuned import TUNED_ROW
from deltaserve.layers.kernels.norm import naive as norm_naive
from deltaserve.layers.kernels.options import KernelOptions

# conftest: TRITON_INTERPRET without CUDA, the `device` fixture, gpu-marked tests skipped on CPU
pytestmark = pytest.mark.usefixtures("nan_fill")
EPS = 1e-6


def make(n, k, device, dtype=torch.bfloat16, seed=0):
    """x (a block's output), residual, norm weight, projection weight, bias."""
    g = torch.Generator().manual_seed(seed)
    to = dict(device=device, dtype=dtype)
    x = torch.randn(1, k, generator=g).to(**to)
    residual = (torch.randn(1, k, generator=g) * 3).to(**to)
    norm_w = (torch.randn(k, generator=g) * 0.1).to(**to)
    w = (torch.randn(n, k, generator=g) * k**-0.5).to(**to)
    b = torch.randn(n, generator=g).to(**to)
    return x, residual, norm_w, w, b


def reference(x, residual, norm_w, w, b):
    """(out, normed, summed) of the unfused plain-torch ops, float32 accumulate."""
    summed = x if residual is None else x + residual
    normed = norm_naive.rms_norm(x=summed, weight=norm_w, eps=EPS)
    return naive.linear(x=normed, weight=w, bias=b), normed, summed


def same_rounding(out: torch.Tensor, ref: torch.Tensor, device: torch.device) -> bool:
    """Bit-equal on the GPU; the interpreter's float32 -> bf16 cast does not round to nearest, so
    on CPU one bf16 step."""
    if device.type == "cuda":
        return torch.equal(out, ref)
    return (out.float() - ref.float()).abs().max().item() <= torch.finfo(out.dtype).eps * ref.float().abs().max()


def close(out: torch.Tensor, ref: torch.Tensor) -> bool:
    """Within two bf16 roundings of the output's scale (the accumulation orders differ)."""
    assert out.shape == ref.shape and out.dtype == ref.dtype and not out.isnan().any()
    return (out.float() - ref.float()).abs().max().item() <= 4 * torch.finfo(out.dtype).eps * ref.float().abs().max()


# bias x preload x dtype: every pair of their values once (each shape takes all four rows)
PLAIN_OPTIONS = [
    (False, False, torch.bfloat16), (True, True, torch.bfloat16), (True, False, torch.float16),
    (False, True, torch.float16),
]  # fmt: skip


@pytest.mark.parametrize(("n", "k"), [(1, 64), (7, 200), (13, 5)])
@pytest.mark.parametrize(("with_bias", "preload", "dtype"), PLAIN_OPTIONS)
def test_row_gemv_plain(device, n, k, with_bias, preload, dtype):
    x, _, _, w, b = make(n, k, device, dtype=dtype)
    b = b if with_bias else None
    out, normed, summed = triton_row.row_gemv(x=x, weight=w, bias=b, preload=preload)
    assert normed is None and summed is None
    assert close(out, naive.linear(x=x, weight=w, bias=b))


# (N, K, block_n, defer_norm): each shape (K masked / a power of two / masked with several row
# blocks and a partial last one) with a broadcast tile (block_n < 8) and an X_ROW tile (>= 8) of the
# exact norm, and the deferred norm (always broadcast) at block_n 1, 8 and 16 across them
NORM_TILES = [
    (7, 200, 4, False), (7, 200, 16, False), (7, 200, 1, True),
    (20, 64, 1, False), (20, 64, 8, False), (20, 64, 16, True),
    (33, 48, 4, False), (33, 48, 16, False), (33, 48, 8, True),
]  # fmt: skip


@pytest.mark.parametrize(("n", "k", "block_n", "defer_norm"), NORM_TILES)
@pytest.mark.parametrize("with_residual", [False, True])
def test_row_gemv_norm(device, n, k, with_residual, block_n, defer_norm):
    """The new residual is the exact sum; the normed row is what the unfused norm writes, to one
    rounding; the projection matches the composition (deferred: 1 / rms applied after the dot).
    block_n >= 8 without defer_norm reads x once as a row (X_ROW); with it, broadcast."""
    x, residual, norm_w, w, b = make(n, k, device, seed=n + k)
    residual = residual if with_residual else None
    out, normed, summed = triton_row.row_gemv(
        x=x,
        weight=w,
        residual=residual,
        norm_weight=norm_w,
        eps=EPS,
        write_normed=True,
        defer_norm=defer_norm,
        config=dict(block_n=block_n, num_warps=4),
    )
    ref_out, ref_normed, ref_summed = reference(x, residual, norm_w, w, None)
    if with_residual:
        assert same_rounding(summed, ref_summed, device)
    else:
        assert summed is None
    assert close(normed, ref_normed)
    assert close(out, ref_out)


@pytest.mark.parametrize(("n", "block_n", "per_sm"), [(37, 2, 1), (50, 4, 2), (64, 8, 1)])
@pytest.mark.parametrize("mode", ["plain", "norm", "deferred"])
def test_row_gemv_persistent(device, n, block_n, per_sm, mode):
    """Fewer programs than row blocks (interpreter: 4 "SMs"): every block of every program written,
    the last one partial, with the activations and the norm computed once per program."""
    x, residual, norm_w, w, b = make(n, 48, device, seed=n)
    cfg = dict(block_n=block_n, num_warps=4, persistent=per_sm)
    if mode == "plain":
        out, _, _ = triton_row.row_gemv(x=x, weight=w, bias=b, config=cfg)
        assert close(out, naive.linear(x=x, weight=w, bias=b))
        return
    out, normed, summed = triton_row.row_gemv(
        x=x, weight=w, bias=b, residual=residual, norm_weight=norm_w, eps=EPS, write_normed=True,
        defer_norm=mode == "deferred", config=cfg,
    )  # fmt: skip
    ref_out, ref_normed, ref_summed = reference(x, residual, norm_w, w, b)
    assert same_rounding(summed, ref_summed, device) and close(normed, ref_normed)
    assert close(out, ref_out)


@pytest.mark.parametrize(("n", "k", "block_n"), [(37, 96, 8), (40, 200, 16), (5, 64, 16)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_row_gemv_tall_tiles_read_x_as_a_row(device, n, k, block_n, with_bias):
    """Tall tiles (x read once as a row), rows past N unwritten, as the broadcast form."""
    x, _, _, w, b = make(n, k, device, seed=block_n)
    b = b if with_bias else None
    cfg = dict(block_n=block_n, num_warps=4)
    out, _, _ = triton_row.row_gemv(x=x, weight=w, bias=b, config=cfg)
    assert out.shape == (1, n) and close(out, naive.linear(x=x, weight=w, bias=b))
    broadcast, _, _ = triton_row.row_gemv(x=x, weight=w, bias=b, config={**cfg, "x_row": False})
    assert close(out, broadcast)


H200 = DeviceInfo(device_module.H200, num_sms=132, smem_per_block=232448, capability=(9, 0))


def test_row_tile_overrides():
    """KernelOptions.row_tiles (DELTASERVE_ROW_TILES) replace the device's measured tile for the
    shapes they name; a malformed entry is an error naming the variable."""
    tiles = KernelOptions.from_env({"DELTASERVE_ROW_TILES": "2048x4096:16x8+1288x2048:8x4"}).row_tiles
    assert triton_row.pick_config(2048, 4096, H200, tiles) == dict(block_n=16, num_warps=8)
    assert triton_row.pick_config(1288, 2048, H200, tiles) == dict(block_n=8, num_warps=4)
    tuned = TUNED_ROW[device_module.H200]
    assert triton_row.pick_config(12352, 2048, H200, tiles) == tuned[(12352, 2048)]
    # another GPU: the heuristic, not the H200's measured tile
    other = DeviceInfo("NVIDIA H100 80GB HBM3", num_sms=132, smem_per_block=232448, capability=(9, 0))
    assert triton_row.pick_config(2048, 4096, other) != tuned[(2048, 4096)]
    for bad in ("2048x4096", "2048x4096:3x8", "2048:16x8", "2048x4096:16x3"):
        with pytest.raises(ValueError, match="DELTASERVE_ROW_TILES"):
            KernelOptions.from_env({"DELTASERVE_ROW_TILES": bad})


def test_row_gemv_rows_past_n_not_written(device):
    """N not a multiple of block_n: the last program's extra rows re-read row N - 1 and are never
    stored (the output has exactly N columns, all written)."""
    x, residual, norm_w, w, _ = make(5, 64, device)
    out, _, _ = triton_row.row_gemv(
        x=x, weight=w, residual=residual, norm_weight=norm_w, eps=EPS, config=dict(block_n=4, num_warps=4)
    )
    assert out.shape == (1, 5)
    assert close(out, reference(x, residual, norm_w, w, None)[0])


@pytest.mark.parametrize("m", [1, 3])
def test_rms_norm_linear_op(device, m):
    """The op: one kernel for a CUDA row, else norm then linear. On CPU (and for several rows) it is
    exactly the unfused ops."""
    g = torch.Generator().manual_seed(m)
    to = dict(device=device, dtype=torch.bfloat16)
    x, residual = torch.randn(m, 64, generator=g).to(**to), torch.randn(m, 64, generator=g).to(**to)
    norm_w, w = (torch.randn(64, generator=g) * 0.1).to(**to), (torch.randn(24, 64, generator=g) / 8).to(**to)
    res = linear_kernels.rms_norm_linear(
        x=x, residual=residual, norm_weight=norm_w, eps=EPS, weight=w, write_normed=True
    )
    normed, summed = norm_kernels.fused_add_rms_norm(x=x, residual=residual, weight=norm_w, eps=EPS)
    unfused = linear_kernels.linear(x=normed, weight=w)
    if device.type == "cpu" or m > 1:
        assert torch.equal(res.out, unfused) and torch.equal(res.normed, normed)
    else:
        assert close(res.out, unfused) and close(res.normed, normed)
    assert torch.equal(res.residual, summed)
    no_res = linear_kernels.rms_norm_linear(x=x, residual=None, norm_weight=norm_w, eps=EPS, weight=w)
    assert no_res.normed is None and no_res.residual is x
    assert close(no_res.out, linear_kernels.linear(x=norm_kernels.rms_norm(x=x, weight=norm_w, eps=EPS), weight=w))


def test_fused_norm_only_where_measured_to_pay():
    """The MoE input (1,288 rows) fuses its norm; the 12K-row GDN in_proj keeps the norm kernel."""
    assert triton_row.fuses_norm(1288) and not triton_row.fuses_norm(12352)


def test_pick_config_bounds_registers():
    """The whole-row tile stays within MAX_ELEMS_PER_THREAD elements per thread at the model's shapes."""
    for n, k in [(12352, 2048), (9216, 2048), (2048, 4096), (1288, 2048), (2048, 512), (5, 8192)]:
        cfg = triton_row.pick_config(n, k, device_module.INTERPRETER)
        assert cfg["block_n"] * k <= triton_row.MAX_ELEMS_PER_THREAD * 32 * cfg["num_warps"]


# --- GPU, bf16, the model's shapes ----------------------------------------------------------------

SHAPES = [(12352, 2048), (8192 + 1024, 2048), (1288, 2048), (2048, 4096)]


@pytest.mark.gpu
@pytest.mark.parametrize(("n", "k"), SHAPES)
@pytest.mark.parametrize(("preload", "defer_norm"), [(False, False), (True, False), (True, True)])
def test_gpu_real_shapes(n, k, preload, defer_norm):
    x, residual, norm_w, w, _ = make(n, k, "cuda")
    out, normed, summed = triton_row.row_gemv(
        x=x,
        weight=w,
        residual=residual,
        norm_weight=norm_w,
        eps=EPS,
        write_normed=True,
        preload=preload,
        defer_norm=defer_norm,
    )
    ref_normed, ref_summed = norm_kernels.fused_add_rms_norm(x=x, residual=residual, weight=norm_w, eps=EPS)
    assert torch.equal(summed, ref_summed)
    assert close(normed, ref_normed)
    assert close(out, naive.linear(x=ref_normed, weight=w))
    plain, _, _ = triton_row.row_gemv(x=x, weight=w, preload=preload)
    assert close(plain, naive.linear(x=x, weight=w))


@pytest.mark.gpu
def test_gpu_cuda_graph_pdl_chain():
    """A chain norm-GEMV -> GEMV -> norm-GEMV captured in a graph (PDL edges between them) replays
    to the eager results, repeatedly."""
    x, residual, norm_w, w_in, _ = make(12352, 2048, "cuda")
    w_out = make(2048, 12352 // 2, "cuda", seed=1)[3][:, :4096].contiguous()

    def chain():
        proj, _, summed = triton_row.row_gemv(x=x, weight=w_in, residual=residual, norm_weight=norm_w, eps=EPS)
        y, _, _ = triton_row.row_gemv(x=proj[:, :4096], weight=w_out)
        return triton_row.row_gemv(x=y, weight=w_in, residual=summed, norm_weight=norm_w, eps=EPS, write_normed=True)

    eager = chain()
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        chain()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = chain()
    for _ in range(3):
        for o in outs:
            o.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        for o, e in zip(outs, eager, strict=True):
            assert torch.equal(o, e)
