"""Triton causal conv1d kernels against the plain-torch reference (layers/kernels/conv1d/naive.py).

Without CUDA the kernels run on CPU float32 tensors under Triton's interpreter (tiny shapes); with
CUDA the same tests run on the GPU, and the `gpu`-marked tests compare bf16 kernels at real shapes.
"""

import pytest
import torch

# conftest.py sets TRITON_INTERPRET (no CUDA) before anything imports triton
from deltaserve.layers.kernels.conv1d import naive, triton_conv1d

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def max_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    if torch.isnan(out).any():
        return float("inf")
    return (out.float() - ref.float()).abs().max().item()


@pytest.mark.parametrize("width", [4, 2])
@pytest.mark.parametrize(
    "activation, with_bias, tiles",
    [
        ("silu", False, triton_conv1d.VARLEN_TILES),
        (None, True, triton_conv1d.VARLEN_TILES),
        ("silu", False, (16, 64, 2)),
    ],
)  # the tiles bench.kernels_conv1d --sweep times: chunks of 16 tokens, 64 channels (four blocks, one partial)
def test_varlen_matches_naive(nan_fill, width, activation, with_bias, tiles):
    torch.manual_seed(0)
    bounds = [0, 1, 70, 72, 203, 203, 260]  # a 1-token and a 2-token sequence (shorter than the window), an empty one
    num_seqs, channels = len(bounds) - 1, 200  # two channel blocks, the second partial
    x = torch.randn(bounds[-1], 2 * channels, device=DEVICE)[:, 3 : 3 + channels]  # strided rows, as the layer's
    weight = torch.randn(channels, width, device=DEVICE)
    bias = torch.randn(channels, device=DEVICE) if with_bias else None
    pool = torch.randn(num_seqs + 2, channels, width - 1, device=DEVICE)
    slots = torch.randperm(num_seqs + 2, device=DEVICE)[:num_seqs]
    has_init = torch.tensor([True, False, True, False, True, True], device=DEVICE)
    cu_seqlens = torch.tensor(bounds, dtype=torch.int32, device=DEVICE)
    outs = []
    for impl, kw in ((naive.causal_conv1d_varlen, {}), (triton_conv1d.causal_conv1d_varlen, {"tiles": tiles})):
        p = pool.clone()
        y = impl(
            x=x,
            weight=weight,
            bias=bias,
            cu_seqlens=cu_seqlens,
            conv_state_pool=p,
            state_slots=slots,
            has_initial_state=has_init,
            activation=activation,
            **kw,
        )
        outs.append((y, p))
    (ref, ref_pool), (out, out_pool) = outs
    assert out.shape == ref.shape and out.dtype == ref.dtype
    assert max_err(out, ref) < 1e-5
    assert torch.equal(out_pool, ref_pool)  # the window is copied, not computed
    empty_slot = slots[4]
    assert torch.equal(out_pool[empty_slot], pool[empty_slot])


def test_varlen_without_state_update_leaves_the_slots(nan_fill):
    """update_state=False (a speculative verify): the same outputs, every slot as it was; with
    save_inputs, a copy of x (more rows than one chunk of the kernel's)."""
    torch.manual_seed(4)
    rows, length, channels = 3, 70, 40
    x = torch.randn(rows * length, channels, device=DEVICE)
    weight = torch.randn(channels, 4, device=DEVICE)
    pool = torch.randn(rows + 1, channels, 3, device=DEVICE)
    kw = dict(
        x=x,
        weight=weight,
        bias=None,
        cu_seqlens=torch.arange(0, rows * length + 1, length, dtype=torch.int32, device=DEVICE),
        state_slots=torch.tensor([2, 0, 3], dtype=torch.int32, device=DEVICE),
        has_initial_state=torch.ones(rows, dtype=torch.bool, device=DEVICE),
    )
    ref = naive.causal_conv1d_varlen(conv_state_pool=pool.clone(), **kw)
    for impl in (naive.causal_conv1d_varlen, triton_conv1d.causal_conv1d_varlen):
        kept = pool.clone()
        saved = torch.empty(rows * length, channels, device=DEVICE)
        out = impl(conv_state_pool=kept, update_state=False, save_inputs=saved, **kw)
        assert max_err(out, ref) < 1e-5
        assert torch.equal(kept, pool) and torch.equal(saved, x)  # the inputs copied from the same launch


def test_varlen_ignores_slot_without_initial_state(nan_fill):
    torch.manual_seed(1)
    x = torch.randn(10, 16, device=DEVICE)
    weight = torch.randn(16, 4, device=DEVICE)
    pool = torch.full((1, 16, 3), float("nan"), device=DEVICE)
    kw = dict(
        x=x,
        weight=weight,
        bias=None,
        cu_seqlens=torch.tensor([0, 10], device=DEVICE),
        state_slots=torch.tensor([0], device=DEVICE),
        has_initial_state=torch.tensor([False], device=DEVICE),
    )
    ref_pool, out_pool = pool.clone(), pool.clone()
    ref = naive.causal_conv1d_varlen(conv_state_pool=ref_pool, **kw)
    out = triton_conv1d.causal_conv1d_varlen(conv_state_pool=out_pool, **kw)
    assert max_err(out, ref) < 1e-5
    assert torch.equal(out_pool, ref_pool)


@pytest.mark.parametrize("width", [4, 2])
@pytest.mark.parametrize("activation, with_bias", [("silu", False), (None, True)])
def test_update_matches_naive(nan_fill, width, activation, with_bias):
    torch.manual_seed(2)
    num_seqs, channels = 5, 300
    x = torch.randn(num_seqs, channels + 7, device=DEVICE)[:, :channels]
    weight = torch.randn(channels, width, device=DEVICE)
    bias = torch.randn(channels, device=DEVICE) if with_bias else None
    pool = torch.randn(num_seqs + 3, channels, width - 1, device=DEVICE)
    slots = torch.randperm(num_seqs + 3, device=DEVICE)[:num_seqs]
    outs = []
    for impl in (naive.causal_conv1d_update, triton_conv1d.causal_conv1d_update):
        p = pool.clone()
        y = impl(x=x, weight=weight, bias=bias, conv_state_pool=p, state_slots=slots, activation=activation)
        outs.append((y, p))
    (ref, ref_pool), (out, out_pool) = outs
    assert max_err(out, ref) < 1e-5
    assert torch.equal(out_pool, ref_pool)


def test_rejects_unknown_activation():
    x = torch.randn(2, 8, device=DEVICE)
    with pytest.raises(ValueError):
        triton_conv1d.causal_conv1d_update(
            x=x,
            weight=torch.randn(8, 4, device=DEVICE),
            bias=None,
            conv_state_pool=torch.zeros(2, 8, 3, device=DEVICE),
            state_slots=torch.tensor([0, 1], device=DEVICE),
            activation="gelu",
        )


# ---- GPU: bf16 at the model's conv width (C = 2 * 16 * 128 + 32 * 128) ------------------------------

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.gpu
@gpu
def test_varlen_and_update_bf16_real_shapes(nan_fill):
    torch.manual_seed(3)
    channels, bounds = 8192, [0, 2, 1000, 3001]
    x = torch.randn(bounds[-1], channels, device=DEVICE, dtype=torch.bfloat16)
    weight = torch.randn(channels, 4, device=DEVICE, dtype=torch.bfloat16)
    pool = torch.randn(5, channels, 3, device=DEVICE, dtype=torch.bfloat16)
    slots = torch.tensor([4, 0, 2], dtype=torch.int32, device=DEVICE)
    has_init = torch.tensor([True, False, True], device=DEVICE)
    cu_seqlens = torch.tensor(bounds, dtype=torch.int32, device=DEVICE)
    x_next = torch.randn(3, channels, device=DEVICE, dtype=torch.bfloat16)
    outs = []
    for module in (naive, triton_conv1d):
        p = pool.clone()
        y = module.causal_conv1d_varlen(
            x=x,
            weight=weight,
            bias=None,
            cu_seqlens=cu_seqlens,
            conv_state_pool=p,
            state_slots=slots,
            has_initial_state=has_init,
        )
        y_next = module.causal_conv1d_update(x=x_next, weight=weight, bias=None, conv_state_pool=p, state_slots=slots)
        outs.append((y, y_next, p))
    (ref, ref_next, ref_pool), (out, out_next, out_pool) = outs
    for got, want in ((out, ref), (out_next, ref_next)):  # at most one bf16 ulp apart (2^-7 relative)
        err = (got.float() - want.float()).abs()
        assert bool((err <= 2**-7 * want.float().abs() + 1e-3).all()), err.max()
    assert torch.equal(out_pool, ref_pool)


@pytest.mark.gpu
@gpu
def test_varlen_rows_past_2_31_elements_of_the_projection():
    """One 180,000-token sequence read from the 35B GDN in_proj's output (rows of 12,352, the conv's 8,192
    channels first): a position times the row stride passes 2^31 from row 173,857, so 32-bit offsets
    read another row there. Rows around and past it against the direct sum of their taps (and the
    updated window against the last inputs)."""
    tokens, width, channels = 180_000, 12_352, 8192
    proj = torch.randn(tokens, width, device=DEVICE, dtype=torch.bfloat16)
    x = proj[:, :channels]
    weight = 0.3 * torch.randn(channels, 4, device=DEVICE, dtype=torch.bfloat16)
    pool = torch.zeros(2, channels, 3, device=DEVICE, dtype=torch.bfloat16)
    y = triton_conv1d.causal_conv1d_varlen(
        x=x, weight=weight, bias=None, cu_seqlens=torch.tensor([0, tokens], dtype=torch.int32, device=DEVICE),
        conv_state_pool=pool, state_slots=torch.zeros(1, dtype=torch.int32, device=DEVICE),
        has_initial_state=torch.zeros(1, dtype=torch.bool, device=DEVICE),
    )  # fmt: skip
    for row in (100, 173_856, 173_857, 173_860, 179_999):
        taps = x[row - 3 : row + 1].float()
        want = torch.nn.functional.silu((taps.t() * weight.float()).sum(1))
        assert (y[row].float() - want).abs().max() < 0.05, row
    assert torch.equal(pool[0], x[-3:].t())
