"""The fused GDN decode kernel (layers/kernels/gdn/decode.py: conv1d update -> recurrent gated delta
rule -> gated RMSNorm in one launch) against the naive composition, against the three naive ops
called one after another, and against the three unfused Triton kernels.

Without CUDA the kernels run on CPU tensors under Triton's interpreter (tiny shapes); there the
fused kernel must equal the unfused Triton kernels bit for bit (same roundings, numpy's float32
math on both sides). The interpreter casts float32 to bf16 by truncation, torch rounds to nearest:
against the naive ops, bf16 results then differ by a few bf16 ulps. With CUDA the same tests run on
the GPU, and the `gpu`-marked tests compare the kernels at the model's shapes.
"""

import pytest
import torch
from passes import Sequences
from tiny_models import VOCAB_SIZE

# conftest.py sets TRITON_INTERPRET (no CUDA) before anything imports triton
from deltaserve.layers.kernels import gdn as gdn_kernels
from deltaserve.layers.kernels.conv1d import naive as conv_naive
from deltaserve.layers.kernels.conv1d import triton_conv1d
from deltaserve.layers.kernels.device import ticket_buffers
from deltaserve.layers.kernels.gdn import decode as decode_module
from deltaserve.layers.kernels.gdn import naive
from deltaserve.layers.kernels.gdn import recurrent as recurrent_module
from deltaserve.layers.kernels.norm import naive as norm_naive
from deltaserve.layers.kernels.norm import triton_norm
from deltaserve.layers.kernels.options import KernelOptions
from deltaserve.layers.loader import load_model

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
EPS = 1e-6


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """max |out - ref| over max(1, max |ref|); NaN anywhere fails."""
    if torch.isnan(out).any():
        return float("inf")
    return ((out.float() - ref.float()).abs().max() / ref.float().abs().max().clamp(min=1)).item()


def make_step(num_seqs, num_k_heads, group, key_dim, value_dim, width, dtype, num_slots, seed=0):
    """One decode step's inputs as the layer passes them: mixed_qkv, z, b, a as column views of one
    [N, in_proj rows + padding] projection ([q | k | v | z | b | a], a row stride wider than any of
    them), the conv weight [C, W], pools with more slots than sequences, distinct slots out of order."""
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    num_v_heads = num_k_heads * group
    channels = 2 * num_k_heads * key_dim + num_v_heads * value_dim
    vdim = num_v_heads * value_dim
    rows = channels + vdim + 2 * num_v_heads
    proj = torch.randn(num_seqs, rows + 11, device=DEVICE, generator=gen)
    proj[:, 5 + rows - num_v_heads : 5 + rows] *= 2.0  # a: a spread of decays
    proj = proj.to(dtype)[:, 5 : 5 + rows]
    z = proj[:, channels : channels + vdim].view(num_seqs, num_v_heads, value_dim)
    b = proj[:, channels + vdim : channels + vdim + num_v_heads]
    a = proj[:, channels + vdim + num_v_heads :]
    slots = torch.randperm(num_slots, device=DEVICE, generator=gen)[:num_seqs].to(torch.int32)
    return dict(
        mixed_qkv=proj[:, :channels],
        z=z,
        a=a,
        b=b,
        conv_weight=(torch.randn(channels, width, device=DEVICE, generator=gen) * 0.5).to(dtype),
        conv_state_pool=torch.randn(num_slots, channels, width - 1, device=DEVICE, generator=gen).to(dtype),
        A_log=torch.linspace(-2.0, 2.0, num_v_heads, device=DEVICE),
        dt_bias=torch.randn(num_v_heads, device=DEVICE, generator=gen),
        state_pool=torch.randn(num_slots, num_v_heads, key_dim, value_dim, device=DEVICE, generator=gen) * 0.5,
        state_slots=slots,
        norm_weight=(1.0 + 0.1 * torch.randn(value_dim, device=DEVICE, generator=gen)).to(dtype),
        eps=EPS,
    )


def run(impl, step, **kw):
    """impl on copies of the pools: (out, conv pool, state pool)."""
    step = dict(step, conv_state_pool=step["conv_state_pool"].clone(), state_pool=step["state_pool"].clone())
    out = impl(**step, **kw)
    return out, step["conv_state_pool"], step["state_pool"]


def three_ops(conv_update, recurrent, gated_norm, step):
    """The layer's unfused decode path: conv1d update, the recurrent kernel on raw gates, the gated
    norm, each a separate call. Returns (out, conv pool, state pool) on copies of the pools."""
    conv_pool, state_pool = step["conv_state_pool"].clone(), step["state_pool"].clone()
    num_seqs = step["mixed_qkv"].shape[0]
    num_v_heads, key_dim, value_dim = state_pool.shape[1:]
    key_channels = (step["mixed_qkv"].shape[1] - num_v_heads * value_dim) // 2
    num_k_heads = key_channels // key_dim
    conv_out = conv_update(
        x=step["mixed_qkv"],
        weight=step["conv_weight"],
        bias=None,
        conv_state_pool=conv_pool,
        state_slots=step["state_slots"],
        activation="silu",
    )
    q, k, v = conv_out.split([key_channels, key_channels, num_v_heads * value_dim], dim=1)
    core = recurrent(
        q=q.reshape(num_seqs, 1, num_k_heads, key_dim),
        k=k.reshape(num_seqs, 1, num_k_heads, key_dim),
        v=v.reshape(num_seqs, 1, num_v_heads, value_dim),
        a=step["a"].unsqueeze(1),
        b=step["b"].unsqueeze(1),
        A_log=step["A_log"],
        dt_bias=step["dt_bias"],
        state_pool=state_pool,
        state_slots=step["state_slots"],
        use_qk_l2norm=True,
    )
    out = gated_norm(x=core[:, 0], gate=step["z"], weight=step["norm_weight"], eps=step["eps"])
    return out, conv_pool, state_pool


def assert_untouched(step, conv_pool, state_pool):
    """The slots of no sequence keep their bytes."""
    others = torch.ones(step["state_pool"].shape[0], dtype=torch.bool, device=DEVICE)
    others[step["state_slots"].long()] = False
    assert others.any()
    assert torch.equal(conv_pool[others], step["conv_state_pool"][others])
    assert torch.equal(state_pool[others], step["state_pool"][others])


# (N, Hk, GROUP, K, V, conv width, block_v): odd head counts, K != V, GROUP 3 (the norm's tile of
# value heads padded to 4), several V blocks per value head (block_v 16: the last program of a key
# head norms what the others wrote), a V that is not a power of two (a partial V block). Two
# sequences each (a ticket per sequence and key head): under the interpreter the kernel's
# two-operand reduction runs element by element, so the cost is N * Hv * K * V
SHAPES = [
    (2, 3, 2, 16, 32, 4, None),  # three key heads, K < V, one V block
    (2, 1, 3, 32, 16, 4, None),  # GROUP 3 (padded to 4), K > V
    (2, 2, 3, 16, 32, 4, 16),  # GROUP 3 over two key heads, two V blocks a value head
    (2, 2, 1, 16, 24, 3, 16),  # a partial V block, conv width 3
]
# bf16 (the roundings of the unfused path, bit for bit on the interpreter) on the shapes whose
# outputs are normed across programs, float32 on all
CASES = [
    pytest.param(shape, dtype, id="-".join(map(str, shape)) + f"-{str(dtype).removeprefix('torch.')}")
    for shape, dtype in [(s, torch.float32) for s in SHAPES] + [(s, torch.bfloat16) for s in SHAPES[2:]]
]


def assert_tickets_reset(device):
    """Every launch leaves the shared ticket counters at zero for the next."""
    for tickets in ticket_buffers("fused_gdn_decode", torch.device(device)):
        assert not tickets.any()


@pytest.mark.parametrize("shape, dtype", CASES)
def test_fused_decode_matches_unfused(nan_fill, shape, dtype):
    num_seqs, num_k_heads, group, key_dim, value_dim, width, block_v = shape
    step = make_step(num_seqs, num_k_heads, group, key_dim, value_dim, width, dtype, num_slots=num_seqs + 3)
    assert step["mixed_qkv"].stride(0) > step["mixed_qkv"].shape[1]  # strided rows, as the layer's
    out, conv_pool, state_pool = run(decode_module.fused_gdn_decode, step, block_v=block_v)
    assert out.shape == step["z"].shape and out.dtype == dtype
    assert_tickets_reset(DEVICE)
    assert_untouched(step, conv_pool, state_pool)

    # the naive composition is the three naive ops, exactly
    ref, ref_conv, ref_state = run(naive.fused_gdn_decode, step)
    ops, ops_conv, ops_state = three_ops(
        conv_naive.causal_conv1d_update, naive.fused_recurrent_gated_delta_rule, norm_naive.gated_rms_norm, step
    )
    assert torch.equal(ref, ops) and torch.equal(ref_conv, ops_conv) and torch.equal(ref_state, ops_state)

    assert torch.equal(conv_pool, ref_conv)  # the window is copied, not computed
    if dtype == torch.float32:
        assert rel_err(out, ref) < 1e-5
        assert rel_err(state_pool, ref_state) < 1e-5
    else:  # a bf16 ulp is 2^-8 relative: q, k, v, the core output and the result are each rounded
        assert rel_err(out, ref) < 3e-2
        assert rel_err(state_pool, ref_state) < 1.5e-2

    # against the three unfused Triton kernels: the same roundings, so the same bits on the interpreter
    tri, tri_conv, tri_state = three_ops(
        triton_conv1d.causal_conv1d_update,
        recurrent_module.fused_recurrent_gated_delta_rule,
        triton_norm.gated_rms_norm,
        step,
    )
    assert torch.equal(conv_pool, tri_conv)
    if DEVICE == "cpu":
        assert torch.equal(out, tri) and torch.equal(state_pool, tri_state)
    else:
        assert rel_err(out, tri) < 2e-2 and rel_err(state_pool, tri_state) < 1e-3


def test_fused_decode_strided_pools(nan_fill):
    """Pools that are views of wider buffers: the state's [K, V] tiles not contiguous (the kernel's
    general addressing) and the conv windows with a channel stride wider than the window; the bytes
    outside the views stay as they were."""
    step = make_step(2, 1, 2, 16, 16, 4, torch.float32, num_slots=4, seed=1)
    wide_state = torch.randn(4, 2, 16, 20, device=DEVICE)
    wide_conv = torch.randn(4, step["mixed_qkv"].shape[1], 5, device=DEVICE)
    results = []
    for impl in (naive.fused_gdn_decode, decode_module.fused_gdn_decode):
        ws, wc = wide_state.clone(), wide_conv.clone()
        out = impl(**dict(step, state_pool=ws[..., :16], conv_state_pool=wc[..., 1:4]))
        results.append((out, ws, wc))
    (ref, ref_ws, ref_wc), (out, out_ws, out_wc) = results
    assert rel_err(out, ref) < 1e-5
    assert rel_err(out_ws, ref_ws) < 1e-5
    assert torch.equal(out_wc, ref_wc)
    assert torch.equal(out_ws[..., 16:], wide_state[..., 16:])
    assert torch.equal(out_wc[..., [0, 4]], wide_conv[..., [0, 4]])


@pytest.mark.parametrize("impl", [naive.fused_gdn_decode, decode_module.fused_gdn_decode])
def test_fused_decode_no_sequences(impl):
    step = make_step(0, 2, 2, 16, 16, 4, torch.float32, num_slots=2)
    out, conv_pool, state_pool = run(impl, step)
    assert out.shape == (0, 4, 16)
    assert torch.equal(conv_pool, step["conv_state_pool"]) and torch.equal(state_pool, step["state_pool"])


def test_dispatch_by_device():
    """gdn_kernels.fused_gdn_decode: the Triton kernel for CUDA tensors, the naive composition else."""
    step = make_step(2, 1, 2, 16, 16, 4, torch.float32, num_slots=3, seed=2)
    out, _, _ = run(gdn_kernels.fused_gdn_decode, step)
    want = decode_module.fused_gdn_decode if DEVICE == "cuda" else naive.fused_gdn_decode
    ref, _, _ = run(want, step)
    assert torch.equal(out, ref)


def test_layer_fused_decode_equals_separate_ops(tiny_checkpoints, monkeypatch):
    """The GDN layer (CPU: the naive ops) gives the same logits whether its one-token decode rows
    take fused_gdn_decode (batches up to KernelOptions.fused_gdn_max_seqs) or the three separate
    ops (fused_gdn_max_seqs = 0: the fused op is never called), including a pass that mixes decode
    rows with a prefill chunk."""
    path, _ = tiny_checkpoints["qwen3_5"]
    gen = torch.Generator().manual_seed(3)
    ids = {s: torch.randint(3, VOCAB_SIZE, (10,), generator=gen).tolist() for s in "abc"}
    plan = [
        [("a", ids["a"][:6]), ("b", ids["b"][:4])],
        [("a", ids["a"][6:7]), ("c", ids["c"][:5])],  # a decode row beside a prefill chunk
        [("a", ids["a"][7:8]), ("b", ids["b"][4:5]), ("c", ids["c"][5:6])],
        [("b", ids["b"][5:6]), ("c", ids["c"][6:7])],
    ]
    calls = []
    fused = gdn_kernels.fused_gdn_decode
    monkeypatch.setattr(gdn_kernels, "fused_gdn_decode", lambda **kw: calls.append(1) or fused(**kw))

    def logits(max_seqs: int) -> list[torch.Tensor]:
        seqs = Sequences(load_model(path), kernels=KernelOptions(fused_gdn_max_seqs=max_seqs))
        for s in ids:
            seqs.add(s)
        return [out for rows in plan for out in seqs.run(rows)]

    separate = logits(0)
    assert not calls
    together = logits(KernelOptions().fused_gdn_max_seqs)
    assert len(calls) == 3 * sum(not layer.is_attention for layer in load_model(path).layers)  # 3 decode passes
    for got, want in zip(together, separate, strict=True):
        assert torch.equal(got, want)


# ---- GPU: bf16 at the model's shapes (Hk=16, Hv=32, K=V=128, conv width 4) ------------------------

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("block_v", [None, 32, 64, 128])
@pytest.mark.parametrize("num_seqs", [1, 3, 64])
def test_fused_decode_bf16_real_shapes(nan_fill, num_seqs, block_v):
    """Against the three unfused Triton kernels the layer ran before: the conv windows bit for bit;
    the result and the state within bf16 rounding (the fused kernel sums in other orders, so a q,
    k or v element can round to the neighbouring bf16 value, and so can the output)."""
    step = make_step(num_seqs, 16, 2, 128, 128, 4, torch.bfloat16, num_slots=num_seqs + 8, seed=3)
    step["state_pool"] *= 0.2
    out, conv_pool, state_pool = run(decode_module.fused_gdn_decode, step, block_v=block_v)
    assert_tickets_reset(DEVICE)
    tri, tri_conv, tri_state = three_ops(
        triton_conv1d.causal_conv1d_update,
        recurrent_module.fused_recurrent_gated_delta_rule,
        triton_norm.gated_rms_norm,
        step,
    )
    assert torch.equal(conv_pool, tri_conv)
    assert_untouched(step, conv_pool, state_pool)
    err = (out.float() - tri.float()).abs()
    assert bool((err <= 2**-6 * tri.float().abs() + 2e-2).all()), (err.max(), (out == tri).float().mean())
    assert rel_err(state_pool, tri_state) < 1e-3
    ref, _, ref_state = run(naive.fused_gdn_decode, step)
    assert rel_err(out, ref) < 2e-2 and rel_err(state_pool, ref_state) < 1e-3


@pytest.mark.gpu
@gpu
def test_fused_decode_cuda_graph(nan_fill):
    """Captured in a CUDA graph (as the decode graphs run it), a replay equals an eager call."""
    step = make_step(4, 16, 2, 128, 128, 4, torch.bfloat16, num_slots=12, seed=4)
    eager, eager_conv, eager_state = run(decode_module.fused_gdn_decode, step)
    conv_pool, state_pool = step["conv_state_pool"].clone(), step["state_pool"].clone()
    args = dict(step, conv_state_pool=conv_pool, state_pool=state_pool)
    decode_module.fused_gdn_decode(**dict(args, conv_state_pool=conv_pool.clone(), state_pool=state_pool.clone()))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = decode_module.fused_gdn_decode(**args)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager) and torch.equal(conv_pool, eager_conv) and torch.equal(state_pool, eager_state)
