"""Triton gated delta rule kernels against the plain-torch reference (layers/kernels/gdn/naive.py).

Without CUDA the kernels run on CPU float32 tensors under Triton's interpreter (tiny shapes); with
CUDA the same tests run on the GPU, and the `gpu`-marked tests compare bf16 kernels at real shapes.
"""

import dataclasses

import pytest
import torch
import torch.nn.functional as F

# conftest.py sets TRITON_INTERPRET (no CUDA) before anything imports triton
from deltaserve.bench.kernels_gdn import CHUNK_VARIANTS as ALL_CHUNK_VARIANTS
from deltaserve.bench.kernels_gdn import RECURRENT_VARIANTS
from deltaserve.layers.kernels.gdn import chunk as chunk_module
from deltaserve.layers.kernels.gdn import gating as gating_module
from deltaserve.layers.kernels.gdn import naive
from deltaserve.layers.kernels.gdn import recurrent as recurrent_module

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# float32 matmuls run as tf32 on the GPU
TOL = 2e-2 if DEVICE == "cuda" else 1e-4


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """max |out - ref| over max(1, max |ref|); NaN anywhere fails."""
    if torch.isnan(out).any():
        return float("inf")
    return ((out.float() - ref.float()).abs().max() / ref.float().abs().max().clamp(min=1)).item()


def make_inputs(num_tokens, num_k_heads, num_v_heads, key_dim, value_dim, dtype=torch.float32, lead=()):
    shape = (*lead, num_tokens)
    q = torch.randn(*shape, num_k_heads, key_dim, device=DEVICE).to(dtype)
    k = torch.randn(*shape, num_k_heads, key_dim, device=DEVICE).to(dtype)
    v = torch.randn(*shape, num_v_heads, value_dim, device=DEVICE).to(dtype)
    g = F.logsigmoid(torch.randn(*shape, num_v_heads, device=DEVICE))  # log decay, < 0
    beta = torch.rand(*shape, num_v_heads, device=DEVICE)
    return q, k, v, g, beta


def run_chunk(impl, q, k, v, g, beta, cu_seqlens, pool, slots, has_init, **kw):
    pool = pool.clone()
    states = []
    out = impl(
        q=q,
        k=k,
        v=v,
        g=g,
        beta=beta,
        cu_seqlens=cu_seqlens,
        state_pool=pool,
        state_slots=slots,
        has_initial_state=has_init,
        chunk_states_out=states,
        **kw,
    )
    return out, pool, states


# the designs the picker chooses: the first (fused), the fused one with its loads pipelined, the
# split one; on the CPU the variants the benchmark compares differ from these only in block sizes.
# A ChunkVariant instance also stands for a named variant: the fused design at block_v 16 (with the
# V = 40 cases below, several V-blocks and a partial one; the named fused designs take V = 40 in one
# block of 64 except when the grid is small, split32 in two of 32)
CHUNK_VARIANTS = [
    *chunk_module.VARIANTS,
    chunk_module.ChunkVariant(split=False, block_v=16),
    chunk_module.ChunkVariant(split=True, block_v=16, solve_stages=3),  # the interpreter runs it as one stage
]

# The interpreter's cost is about one program of the solve kernel per (chunk, value head), whatever
# the shape: the cases keep the chunk count small and still cover every branch of the kernels
# (chunks of 64 tokens, cut into 4 blocks of 16 rows by the solve). has_init: per sequence; the slots
# of the sequences without an initial state hold NaN, as do the slots of no sequence.
CHUNK_CASES = {
    # a 1-token sequence, an empty one in the middle and one at the end, a 64-token sequence (an end
    # on a chunk boundary), a chunk boundary crossed (101 = 64 + 37: the last chunk's third 16-row
    # block partial, its fourth empty; the last tokens of the pass, so that a store past the
    # sequence end leaves the buffers); GQA with 3 value heads a key head; K = 12 (masked key
    # columns), V = 40; q, k, v as strided views of one projection, as the layer passes them
    "varlen": dict(
        bounds=[0, 1, 1, 65, 166, 166], heads=(1, 3), dims=(12, 40), l2norm=True, scale=None,
        has_init=[True, False, False, True, True], packed=True,
    ),
    # no l2norm, an explicit scale, Hk == Hv == 2 (key-head offsets), contiguous q, k, v; one
    # sequence of 94 = 64 + 30 tokens (the last chunk's second block partial) without an initial
    # state: the slot holds NaN and must not be read; one sequence of 2 value heads: the fused designs
    # halve their V-block to 32 (fewer programs than the interpreter's 4 "SMs"), two V-blocks
    "no_l2norm": dict(
        bounds=[0, 94], heads=(2, 2), dims=(16, 40), l2norm=False, scale=0.3, has_init=[False], packed=False,
    ),
    # slow decays (g a hundredth of the others: ~0.6 of the state left after a chunk) so that the state
    # and the keys of one chunk shape the next ones' outputs: 3 chunks from an initial state, after a
    # 64-token sequence without one
    "slow_decay": dict(
        bounds=[0, 64, 230], heads=(1, 2), dims=(16, 24), l2norm=True, scale=None, has_init=[False, True],
        packed=False, decay=0.01,
    ),
}  # fmt: skip


@pytest.mark.parametrize("variant", CHUNK_VARIANTS)
@pytest.mark.parametrize("case", list(CHUNK_CASES))
def test_chunk_matches_naive(nan_fill, case, variant):
    """Against the reference: the outputs, the final states in the slots of the non-empty sequences,
    the per-chunk states; the slots of the empty sequences and of no sequence stay as they were
    (NaN included), and a slot without an initial state is never read (it holds NaN)."""
    check_chunk_case(case, variant)


# windows of 1 / 2 chunks (the minimum lowered for the tiny cases): varlen's 101-token sequence cut
# between its chunks (and a window holding chunks of two sequences), no_l2norm's one sequence without
# an initial state cut (the second window resumes from the slot the first wrote, not its NaN),
# slow_decay's 3-chunk sequence with an initial state cut after its second chunk
@pytest.mark.parametrize("windows", [2, 4, 0])
@pytest.mark.parametrize("case", list(CHUNK_CASES))
def test_chunk_windows_match_one_walk(nan_fill, monkeypatch, case, windows):
    """The split design over chunk windows (ChunkVariant.windows: one walk launch a window, resuming
    from the slot): the reference's checks, and the outputs, slots and per-chunk states of one walk
    bit for bit. Under the interpreter the windows run one after another, each prepared only just
    before its walk: a kernel reading another window's rows reads NaN."""
    monkeypatch.setattr(chunk_module, "WINDOW_MIN_CHUNKS", 1)
    split = chunk_module.VARIANTS["split32"]
    got = check_chunk_case(case, dataclasses.replace(split, windows=windows))
    want = check_chunk_case(case, split)
    count = len(chunk_module.chunk_windows(got.max_chunks, windows, got.num_seqs))
    if windows:
        assert count == min(windows, got.max_chunks) > 1
    else:  # by size: two windows of one sequence, one walk for several
        assert count == (1 if got.num_seqs > 1 else 2)
    assert torch.equal(got.out, want.out)
    assert torch.equal(got.pool.nan_to_num(), want.pool.nan_to_num())
    assert all(torch.equal(a, b) for a, b in zip(got.states, want.states, strict=True))


def test_chunk_windows_cover_the_chunks():
    """Near-equal windows, none under WINDOW_MIN_CHUNKS unless one covers everything."""
    assert chunk_module.WINDOW_MIN_CHUNKS == 64 and chunk_module.WINDOW_CHUNKS == 128
    assert chunk_module.chunk_windows(513, 4) == [(0, 128), (128, 256), (256, 384), (384, 513)]
    assert chunk_module.chunk_windows(513, 1) == [(0, 513)]
    assert chunk_module.chunk_windows(130, 4) == [(0, 65), (65, 130)]  # at least 64 chunks a window
    assert chunk_module.chunk_windows(256, 8) == [(0, 64), (64, 128), (128, 192), (192, 256)]
    assert chunk_module.chunk_windows(127, 4) == [(0, 127)]
    assert chunk_module.chunk_windows(1, 4) == [(0, 1)]
    # by size (0): about 128 chunks a window, two from 128 chunks, none under 64
    assert chunk_module.chunk_windows(129, 0) == [(0, 64), (64, 129)]
    assert chunk_module.chunk_windows(300, 0) == [(0, 150), (150, 300)]
    assert [chunk_module.window_count(n, 0) for n in (1, 127, 128, 383, 384, 1024, 5000)] == [1, 1, 2, 2, 3, 8, 8]
    # several sequences: one walk by size (windows of the global chunks would walk them in turn); a
    # named count stays as named
    assert chunk_module.window_count(1024, 0, num_seqs=2) == 1 and chunk_module.window_count(1024, 4, 2) == 4


@dataclasses.dataclass
class ChunkRun:
    out: torch.Tensor
    pool: torch.Tensor
    states: list
    max_chunks: int
    num_seqs: int


def check_chunk_case(case: str, variant) -> ChunkRun:
    torch.manual_seed(0)
    c = CHUNK_CASES[case]
    bounds, (num_k_heads, num_v_heads), (key_dim, value_dim) = c["bounds"], c["heads"], c["dims"]
    num_seqs = len(bounds) - 1
    q, k, v, g, beta = make_inputs(bounds[-1], num_k_heads, num_v_heads, key_dim, value_dim)
    g = g * c.get("decay", 1.0)
    if not c["l2norm"]:  # keep |k| near 1, as the delta rule needs
        q, k = q * key_dim**-0.5, k * key_dim**-0.5
    if c["packed"]:  # q, k, v as strided views of one projection, as the layer passes them
        packed = torch.cat([t.flatten(1) for t in (q, k, v)], dim=1)
        q, k, v = (
            packed[:, a : a + t.shape[1] * t.shape[2]].view(t.shape)
            for a, t in zip((0, q[0].numel(), 2 * q[0].numel()), (q, k, v), strict=True)
        )
        assert not v.is_contiguous() and v.stride(0) == q.stride(0)
    cu_seqlens = torch.tensor(bounds, dtype=torch.int32, device=DEVICE)
    pool = torch.full((num_seqs + 2, num_v_heads, key_dim, value_dim), float("nan"), device=DEVICE)
    slots = torch.randperm(num_seqs + 2, device=DEVICE)[:num_seqs]
    has_init = torch.tensor(c["has_init"], device=DEVICE)
    pool[slots[has_init].long()] = torch.randn(int(has_init.sum()), num_v_heads, key_dim, value_dim, device=DEVICE)
    args = (q, k, v, g, beta, cu_seqlens, pool, slots, has_init)
    kw = dict(scale=c["scale"], use_qk_l2norm=c["l2norm"])
    ref, ref_pool, ref_states = run_chunk(naive.chunk_gated_delta_rule, *args, **kw)
    out, out_pool, out_states = run_chunk(chunk_module.chunk_gated_delta_rule, *args, **kw, variant=variant)

    assert out.shape == ref.shape and out.dtype == ref.dtype
    assert rel_err(out, ref) < TOL
    lens = [b - a for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
    written = slots[torch.tensor(lens, device=DEVICE) > 0].long()
    assert not ref_pool[written].isnan().any()
    assert rel_err(out_pool[written], ref_pool[written]) < TOL
    untouched = torch.ones(pool.shape[0], dtype=torch.bool, device=DEVICE)
    untouched[written] = False
    assert untouched.sum() >= 2 and pool[untouched].isnan().any()
    assert torch.equal(out_pool[untouched].isnan(), pool[untouched].isnan())
    assert torch.equal(out_pool[untouched].nan_to_num(), pool[untouched].nan_to_num())
    assert [s.shape[0] for s in out_states] == [-(-n // 64) for n in lens]
    for got, want in zip(out_states, ref_states, strict=True):
        assert got.shape == want.shape
        if want.numel():
            assert rel_err(got, want) < TOL
    return ChunkRun(out, out_pool, out_states, bounds[-1] // 64 + num_seqs, num_seqs)


@pytest.mark.parametrize("variant", ["split32", "fused"])
def test_chunk_solve_near_equal_keys(nan_fill, variant):
    """Keys that nearly repeat, beta near 1 and almost no decay: A's entries near 1, so the high powers
    of each 16 x 16 diagonal block (up to A^15) shape Y = (I + A)^-1 (two chunks, the second partial)."""
    torch.manual_seed(5)
    num_tokens, key_dim, value_dim = 64 + 29, 16, 16
    q, k, v, g, beta = make_inputs(num_tokens, 1, 2, key_dim, value_dim)
    k = torch.randn(1, 1, key_dim, device=DEVICE) + 0.05 * k
    beta, g = 0.9 + 0.1 * beta, g * 1e-3
    cu_seqlens = torch.tensor([0, num_tokens], dtype=torch.int32, device=DEVICE)
    pool = torch.randn(1, 2, key_dim, value_dim, device=DEVICE)
    slots = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    has_init = torch.ones(1, dtype=torch.bool, device=DEVICE)
    args = (q, k, v, g, beta, cu_seqlens, pool, slots, has_init)
    ref, ref_pool, _ = run_chunk(naive.chunk_gated_delta_rule, *args)
    out, out_pool, _ = run_chunk(chunk_module.chunk_gated_delta_rule, *args, variant=variant)
    assert rel_err(out, ref) < TOL
    assert rel_err(out_pool, ref_pool) < TOL


@pytest.mark.parametrize("variant", ["fused", "split32", chunk_module.ChunkVariant(block_v=16, num_warps=8)])
def test_chunk_half_precision(nan_fill, variant):
    """The 16-bit path (matmul operands and scratch in the inputs' dtype). float16 stands in for
    bf16, whose matmuls the interpreter cannot run. Two key heads of two value heads each (hv //
    GROUP against hv % Hk); 65 tokens (a 1-token chunk after a full one), then 50 (the fourth 16-row
    block partial, at the end of the pass)."""
    torch.manual_seed(5)
    bounds = [0, 65, 115]
    q, k, v, g, beta = make_inputs(bounds[-1], 2, 4, 16, 16, dtype=torch.float16)
    cu_seqlens = torch.tensor(bounds, device=DEVICE)
    pool = torch.randn(3, 4, 16, 16, device=DEVICE)
    slots = torch.tensor([2, 0], device=DEVICE)
    has_init = torch.tensor([True, False], device=DEVICE)
    args = (q, k, v, g, beta, cu_seqlens, pool, slots, has_init)
    ref, ref_pool, ref_states = run_chunk(naive.chunk_gated_delta_rule, *args)
    out, out_pool, out_states = run_chunk(chunk_module.chunk_gated_delta_rule, *args, variant=variant)
    assert out.dtype == torch.float16
    assert rel_err(out, ref) < 5e-3
    assert rel_err(out_pool, ref_pool) < 5e-3
    assert [s.shape[0] for s in out_states] == [2, 1]
    for got, want in zip(out_states, ref_states, strict=True):
        assert rel_err(got, want) < 5e-3


@pytest.mark.parametrize("variant", ["fused", "split32"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_chunk_with_output_norm(nan_fill, variant, dtype):
    """norm_gate / norm_weight: the op's output is the GDN output norm of its o (the split design runs
    it inside its output kernel, over V in blocks; the fused ones run the norm kernel after), against
    the reference op followed by the reference norm. The gate is a strided [T, Hv, V] view of a wider
    projection, as the layer passes z; V = 80 takes two 64-column blocks of the output kernel, the second partial; 101
    tokens: the second chunk partial, rows past a sequence's end never stored."""
    from deltaserve.layers.kernels import norm as norm_ops
    from deltaserve.layers.kernels.gdn import chunk_gated_delta_rule

    torch.manual_seed(7)
    bounds = [0, 37, 101]
    q, k, v, g, beta = make_inputs(bounds[-1], 1, 3, 12, 80, dtype=dtype)
    proj = torch.randn(bounds[-1], 3 * 80 + 7, device=DEVICE).to(dtype)
    z = proj[:, 5 : 5 + 3 * 80].view(bounds[-1], 3, 80)
    assert not z.is_contiguous()
    weight = (1 + 0.3 * torch.randn(80, device=DEVICE)).to(dtype)
    cu_seqlens = torch.tensor(bounds, dtype=torch.int32, device=DEVICE)
    pool = torch.randn(3, 3, 12, 80, device=DEVICE)
    slots = torch.tensor([2, 0], dtype=torch.int32, device=DEVICE)
    has_init = torch.tensor([True, False], device=DEVICE)
    args = (q, k, v, g, beta, cu_seqlens, pool, slots, has_init)
    raw, ref_pool, _ = run_chunk(naive.chunk_gated_delta_rule, *args)
    ref = norm_ops.naive.gated_rms_norm(x=raw, gate=z, weight=weight, eps=1e-6)
    norm = dict(norm_gate=z, norm_weight=weight, norm_eps=1e-6)
    out, out_pool, _ = run_chunk(chunk_module.chunk_gated_delta_rule, *args, variant=variant, **norm)
    assert out.dtype == dtype and out.shape == ref.shape
    tol = TOL if dtype == torch.float32 else 1e-2
    assert rel_err(out, ref) < tol
    assert rel_err(out_pool, ref_pool) < tol
    # the public op on the CPU: the reference and the reference norm; a gate without weight is refused
    if DEVICE == "cpu":
        got, _, _ = run_chunk(chunk_gated_delta_rule, *args, **norm)
        assert torch.equal(got, ref)
    with pytest.raises(ValueError, match="norm_weight"):
        run_chunk(chunk_gated_delta_rule, *args, norm_gate=z)


# the recurrent variants' code paths: bv32 the two-pass update with strided addressing, bv32_1p the
# one-pass update with row strides, bv64w8_1p the same at 64 columns a program (warps: GPU only).
# Under the interpreter the one-pass update's two-operand reduction runs element by element, so the
# cases keep N * Hv * K * V small; (sequence, head, V-block) programs of each kind are still several.
@pytest.mark.parametrize("variant", ["bv32", "bv32_1p", "bv64w8_1p"])
@pytest.mark.parametrize(
    "length, heads, dims, update_state",
    [
        (1, (2, 4), (8, 12), True),  # decode: one token, two key heads of two value heads
        (3, (1, 2), (16, 10), False),  # a verify: several tokens, the slots left as they were
        (2, (1, 1), (8, 70), True),  # V-blocks: bv32 three (the last partial), bv64 two (the second partial)
    ],
)
def test_recurrent_matches_naive(nan_fill, length, heads, dims, update_state, variant):
    torch.manual_seed(2)
    (num_k_heads, num_v_heads), (key_dim, value_dim) = heads, dims
    num_seqs = 2
    q, k, v, g, beta = make_inputs(length, num_k_heads, num_v_heads, key_dim, value_dim, lead=(num_seqs,))
    pool = torch.randn(num_seqs + 3, num_v_heads, key_dim, value_dim, device=DEVICE)
    slots = torch.randperm(num_seqs + 3, device=DEVICE)[:num_seqs]
    results = []
    impls = (naive.fused_recurrent_gated_delta_rule, recurrent_module.fused_recurrent_gated_delta_rule)
    for impl, kw in zip(impls, ({}, {"variant": RECURRENT_VARIANTS[variant]}), strict=True):
        p = pool.clone()
        inter = torch.full((num_seqs, length, num_v_heads, key_dim, value_dim), float("nan"), device=DEVICE)
        o = impl(
            q=q,
            k=k,
            v=v,
            g=g,
            beta=beta,
            state_pool=p,
            state_slots=slots,
            intermediate_states_out=inter,
            update_state=update_state,
            **kw,
        )
        results.append((o, p, inter))
    (ref, ref_pool, ref_inter), (out, out_pool, out_inter) = results
    assert rel_err(out, ref) < TOL
    assert rel_err(out_inter, ref_inter) < TOL
    assert rel_err(out_pool, ref_pool) < TOL
    untouched = torch.ones(pool.shape[0], dtype=torch.bool, device=DEVICE)
    if update_state:
        untouched[slots.long()] = False
    assert torch.equal(out_pool[untouched], pool[untouched])


@pytest.mark.parametrize("variant", ["bv32_1p", "bv64_1p"])
def test_recurrent_strided_pool(nan_fill, variant):
    """A pool whose [K, V] tiles are not contiguous (a view of a wider buffer) takes the strided
    addressing; the columns outside the view stay as they were."""
    torch.manual_seed(7)
    q, k, v, g, beta = make_inputs(2, 1, 2, 16, 40, lead=(2,))
    wide = torch.randn(4, 2, 16, 48, device=DEVICE)
    slots = torch.tensor([3, 1], device=DEVICE)
    outs = []
    impls = (naive.fused_recurrent_gated_delta_rule, recurrent_module.fused_recurrent_gated_delta_rule)
    for impl, kw in zip(impls, ({}, {"variant": RECURRENT_VARIANTS[variant]}), strict=True):
        w = wide.clone()
        inter = torch.full((2, 2, 2, 16, 40), float("nan"), device=DEVICE)
        args = dict(q=q, k=k, v=v, g=g, beta=beta, state_slots=slots, intermediate_states_out=inter)
        o = impl(state_pool=w[..., :40], **args, **kw)
        outs.append((o, w, inter))
    (ref, ref_wide, ref_inter), (out, out_wide, out_inter) = outs
    assert rel_err(out, ref) < TOL
    assert rel_err(out_wide, ref_wide) < TOL
    assert rel_err(out_inter, ref_inter) < TOL
    assert torch.equal(out_wide[..., 40:], wide[..., 40:])
    assert torch.equal(out_wide[[0, 2]], wide[[0, 2]])  # the slots of no sequence


def test_recurrent_without_intermediate_states(nan_fill):
    torch.manual_seed(3)
    q, k, v, g, beta = make_inputs(1, 1, 2, 8, 12, lead=(2,))
    pool = torch.randn(3, 2, 8, 12, device=DEVICE)
    slots = torch.tensor([2, 0], device=DEVICE)
    outs = []
    for impl in (naive.fused_recurrent_gated_delta_rule, recurrent_module.fused_recurrent_gated_delta_rule):
        p = pool.clone()
        outs.append((impl(q=q, k=k, v=v, g=g, beta=beta, state_pool=p, state_slots=slots, scale=0.5), p))
    assert rel_err(outs[1][0], outs[0][0]) < TOL
    assert rel_err(outs[1][1], outs[0][1]) < TOL
    assert torch.equal(outs[1][1][1], pool[1])  # the slot of no sequence


@pytest.mark.parametrize("impl", ["naive", "triton"])
def test_recurrent_lengths_run_each_rows_first_tokens(nan_fill, impl):
    """lengths: row n runs only its first lengths[n] tokens, as a call on those tokens alone would
    (outputs, state); a row of none leaves its slot bit for bit as it was."""
    torch.manual_seed(5)
    q, k, v, g, beta = make_inputs(4, 1, 2, 8, 40, lead=(3,))
    pool = torch.randn(5, 2, 8, 40, device=DEVICE)
    slots = torch.tensor([4, 0, 2], device=DEVICE)
    lengths = torch.tensor([0, 2, 4], dtype=torch.int64, device=DEVICE)
    fn = (
        naive.fused_recurrent_gated_delta_rule if impl == "naive" else recurrent_module.fused_recurrent_gated_delta_rule
    )
    got_pool = pool.clone()
    out = fn(q=q, k=k, v=v, g=g, beta=beta, state_pool=got_pool, state_slots=slots, lengths=lengths)
    want_pool = pool.clone()
    for n, length in enumerate(lengths.tolist()):
        if length == 0:
            continue
        rows = (slice(n, n + 1), slice(0, length))
        want = naive.fused_recurrent_gated_delta_rule(
            q=q[rows], k=k[rows], v=v[rows], g=g[rows], beta=beta[rows], state_pool=want_pool,
            state_slots=slots[n : n + 1],
        )  # fmt: skip
        assert rel_err(out[n, :length], want[0]) < TOL
    assert rel_err(got_pool, want_pool) < TOL
    assert torch.equal(got_pool[[1, 3, 4]], pool[[1, 3, 4]])  # the length-0 row's slot and the free ones


def make_raw_gates(lead, num_v_heads, dtype=torch.float32, param_dtype=torch.float32, spread=12.0):
    """a, b: [*lead, Hv] column slices of one wider projection (as the layer passes them, a row
    stride of the projection's width), A_log, dt_bias: [Hv]. a spans |a + dt_bias| > 20 (softplus's
    threshold: above it softplus(x) = x) as well as the curved part; the first few sit at the
    threshold or far past it (exp overflows float32 above 88: without the threshold, g would be -inf)."""
    width = 3 * num_v_heads + 7
    proj = torch.randn(*lead, width, device=DEVICE) * spread
    edge_values = torch.tensor([20.0, 19.99, 20.01, -20.0, 95.0, -95.0, 300.0, -300.0], device=DEVICE)
    edge = torch.arange(min(len(edge_values), proj.numel() // width * num_v_heads), device=DEVICE)
    edge_values = edge_values[: len(edge)]
    proj.view(-1, width)[edge // num_v_heads, 2 + edge % num_v_heads] = edge_values
    proj = proj.to(dtype)
    a = proj[..., 2 : 2 + num_v_heads]
    b = proj[..., 5 + num_v_heads : 5 + 2 * num_v_heads]
    a_log = torch.linspace(-2.0, 2.5, num_v_heads, device=DEVICE).to(param_dtype)
    dt_bias = torch.zeros(num_v_heads, device=DEVICE).to(param_dtype)  # a at 20 stays at 20
    dt_bias[num_v_heads // 2 :] = torch.randn(num_v_heads - num_v_heads // 2, device=DEVICE).to(param_dtype)
    return a, b, a_log, dt_bias


@pytest.mark.parametrize(
    "lead, num_v_heads, dtype, param_dtype",
    [
        ((1,), 3, torch.float32, torch.float32),  # decode at one token
        ((37,), 5, torch.float32, torch.float32),  # odd T and Hv: masked tokens and heads
        ((70,), 12, torch.bfloat16, torch.float32),  # bf16 projection, float32 parameters; several programs
        ((3, 3), 7, torch.float16, torch.bfloat16),  # [N, L, Hv], as the decode path views them
    ],
)
def test_gating_matches_naive(nan_fill, lead, num_v_heads, dtype, param_dtype):
    torch.manual_seed(8)
    a, b, a_log, dt_bias = make_raw_gates(lead, num_v_heads, dtype, param_dtype)
    assert a.stride(-2) > num_v_heads  # rows of a wider projection
    ref_g, ref_beta = naive.gdn_gating(a=a, b=b, A_log=a_log, dt_bias=dt_bias)
    g, beta = gating_module.gdn_gating(a=a, b=b, A_log=a_log, dt_bias=dt_bias)
    assert g.shape == beta.shape == (*lead, num_v_heads)
    assert g.dtype == beta.dtype == torch.float32 and g.is_contiguous() and beta.is_contiguous()
    x = a.float() + dt_bias.float()
    if x.numel() > 100:  # softplus's threshold: both sides and the curved part covered
        assert (x > 20).any() and (x < -20).any() and (x.abs() < 5).any()
    assert (g <= 0).all()  # a log decay
    assert rel_err(g, ref_g) < TOL * 1e-1
    assert rel_err(beta, ref_beta) < TOL * 1e-1
    large = (a.float() + dt_bias.float()).abs() > 20  # softplus(x) is x, or ~0: no rounding beyond g's own
    assert torch.allclose(g[large], ref_g[large], rtol=1e-5, atol=1e-6)


def test_gating_no_tokens():
    a, b, a_log, dt_bias = make_raw_gates((0,), 4)
    g, beta = gating_module.gdn_gating(a=a, b=b, A_log=a_log, dt_bias=dt_bias)
    assert g.shape == beta.shape == (0, 4)


@pytest.mark.parametrize("variant", ["bv32", "bv64_1p"])
@pytest.mark.parametrize(
    "length, heads, dims, dtype", [(1, (2, 4), (8, 12), torch.float32), (2, (1, 3), (16, 24), torch.float16)]
)
def test_recurrent_raw_gates_matches_naive(nan_fill, length, heads, dims, dtype, variant):
    """The recurrent kernel given the raw a, b (strided, as in_proj wrote them) with A_log, dt_bias
    against the naive recurrent with g, beta from the naive gating; other slots untouched."""
    torch.manual_seed(9)
    (num_k_heads, num_v_heads), (key_dim, value_dim) = heads, dims
    num_seqs = 2
    q, k, v, _, _ = make_inputs(length, num_k_heads, num_v_heads, key_dim, value_dim, lead=(num_seqs,))
    a, b, a_log, dt_bias = make_raw_gates((num_seqs * length,), num_v_heads, dtype, spread=4.0)
    a, b = a.view(num_seqs, length, -1), b.view(num_seqs, length, -1)  # the layer's [N, L, Hv] views
    g, beta = naive.gdn_gating(a=a, b=b, A_log=a_log, dt_bias=dt_bias)
    pool = torch.randn(num_seqs + 3, num_v_heads, key_dim, value_dim, device=DEVICE)
    slots = torch.randperm(num_seqs + 3, device=DEVICE)[:num_seqs]
    inter_shape = (num_seqs, length, num_v_heads, key_dim, value_dim)

    ref_pool, ref_inter = pool.clone(), torch.full(inter_shape, float("nan"), device=DEVICE)
    ref = naive.fused_recurrent_gated_delta_rule(
        q=q, k=k, v=v, g=g, beta=beta, state_pool=ref_pool, state_slots=slots, intermediate_states_out=ref_inter
    )
    out_pool, out_inter = pool.clone(), torch.full(inter_shape, float("nan"), device=DEVICE)
    raw = dict(a=a, b=b, A_log=a_log, dt_bias=dt_bias)
    out = recurrent_module.fused_recurrent_gated_delta_rule(
        q=q,
        k=k,
        v=v,
        state_pool=out_pool,
        state_slots=slots,
        intermediate_states_out=out_inter,
        variant=RECURRENT_VARIANTS[variant],
        **raw,
    )
    assert rel_err(out, ref) < TOL
    assert rel_err(out_inter, ref_inter) < TOL
    assert rel_err(out_pool, ref_pool) < TOL
    untouched = torch.ones(pool.shape[0], dtype=torch.bool, device=DEVICE)
    untouched[slots.long()] = False
    assert torch.equal(out_pool[untouched], pool[untouched])
    # the naive recurrent takes the raw form too (the CPU path of the layer)
    naive_pool = pool.clone()
    naive_out = naive.fused_recurrent_gated_delta_rule(q=q, k=k, v=v, state_pool=naive_pool, state_slots=slots, **raw)
    assert torch.equal(naive_out, ref) and torch.equal(naive_pool, ref_pool)


@pytest.mark.parametrize(
    "impl", [naive.fused_recurrent_gated_delta_rule, recurrent_module.fused_recurrent_gated_delta_rule]
)
def test_recurrent_gate_forms_exclusive(impl):
    q, k, v, g, beta = make_inputs(1, 1, 2, 8, 8, lead=(1,))
    a, b, a_log, dt_bias = make_raw_gates((1, 1), 2)
    pool, slots = torch.zeros(1, 2, 8, 8, device=DEVICE), torch.zeros(1, dtype=torch.int32, device=DEVICE)
    for gates in (dict(g=g, beta=beta, a=a, b=b, A_log=a_log, dt_bias=dt_bias), dict(g=g), dict(a=a, b=b)):
        with pytest.raises(ValueError, match="raw gates"):
            impl(q=q, k=k, v=v, state_pool=pool, state_slots=slots, **gates)


# ---- GPU: bf16 kernels at the model's shapes (Hk=16, Hv=32, K=V=128) -------------------------------

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
BF16_TOL = 2e-2  # bf16 operands: the reference runs in float32 on the same bf16 inputs


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("decay", [1.0, 0.01], ids=["fast", "slow"])  # slow: the state carried across chunks
@pytest.mark.parametrize("variant", [None, *ALL_CHUNK_VARIANTS.values()], ids=["default", *ALL_CHUNK_VARIANTS])
def test_chunk_bf16_real_shapes(nan_fill, variant, decay):
    torch.manual_seed(4)
    bounds = [0, 777, 2048, 2048, 2049, 3000]  # odd lengths, an empty and a 1-token sequence
    q, k, v, g, beta = make_inputs(bounds[-1], 16, 32, 128, 128, dtype=torch.bfloat16)
    g = g * decay
    cu_seqlens = torch.tensor(bounds, dtype=torch.int32, device=DEVICE)
    pool = torch.randn(6, 32, 128, 128, device=DEVICE) * 0.1
    pool[0] = float("nan")  # the slot of the sequence without an initial state: never read
    slots = torch.tensor([5, 0, 2, 3, 1], dtype=torch.int32, device=DEVICE)
    has_init = torch.tensor([True, False, True, True, True], device=DEVICE)
    args = (q, k, v, g, beta, cu_seqlens, pool, slots, has_init)
    ref, ref_pool, ref_states = run_chunk(naive.chunk_gated_delta_rule, *args)
    out, out_pool, out_states = run_chunk(chunk_module.chunk_gated_delta_rule, *args, variant=variant)
    assert out.dtype == torch.bfloat16
    assert rel_err(out, ref) < BF16_TOL
    assert rel_err(out_pool, ref_pool) < BF16_TOL
    assert torch.equal(out_pool[[2, 4]], pool[[2, 4]])  # the empty sequence's slot and no sequence's
    for got, want in zip(out_states, ref_states, strict=True):
        assert got.shape == want.shape
        if want.numel():
            assert rel_err(got, want) < BF16_TOL


@pytest.mark.gpu
@gpu
def test_chunk_windows_on_two_streams_match_one_walk_bitwise(nan_fill, monkeypatch):
    """Four windows at the model's shapes: the walks on the caller's stream, the windows' solve, matmuls
    and outputs on a second stream, eagerly (five calls) and from a CUDA graph (the side stream a fork
    of the capture): outputs and slots bit for bit those of split32's one walk. Two sequences, one
    without an initial state, a window boundary inside each."""
    torch.manual_seed(5)
    bounds = [0, 4100, 8192]
    q, k, v, g, beta = make_inputs(bounds[-1], 16, 32, 128, 128, dtype=torch.bfloat16)
    g = g * 0.05  # slow decays: the state a window hands the next shapes its outputs
    cu_seqlens = torch.tensor(bounds, dtype=torch.int32, device=DEVICE)
    pool = torch.randn(3, 32, 128, 128, device=DEVICE) * 0.1
    slots = torch.tensor([2, 0], dtype=torch.int32, device=DEVICE)
    has_init = torch.tensor([True, False], device=DEVICE)
    kw = dict(q=q, k=k, v=v, g=g, beta=beta, cu_seqlens=cu_seqlens, state_slots=slots, has_initial_state=has_init)
    monkeypatch.setattr(chunk_module, "WINDOW_MIN_CHUNKS", 8)  # four windows of this pass, two short ones
    four = dataclasses.replace(chunk_module.VARIANTS["split32_win"], windows=4)
    assert len(chunk_module.chunk_windows(bounds[-1] // 64 + 2, 4)) == 4
    want_pool = pool.clone()
    want = chunk_module.chunk_gated_delta_rule(state_pool=want_pool, variant="split32", **kw)
    for _ in range(5):
        got_pool = pool.clone()
        got = chunk_module.chunk_gated_delta_rule(state_pool=got_pool, variant=four, **kw)
        assert torch.equal(got, want) and torch.equal(got_pool, want_pool)
    graph_pool = pool.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = chunk_module.chunk_gated_delta_rule(state_pool=graph_pool, variant=four, **kw)
    for _ in range(3):
        graph_pool.copy_(pool)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(got, want) and torch.equal(graph_pool, want_pool)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("variant", [None, "fused", "split32"])
def test_chunk_output_norm_bf16_real_shapes(nan_fill, variant):
    """The output norm fused into the op at the 35B shape (128-column V: two output blocks), z a
    strided view as in the layer: against the reference op and norm."""
    from deltaserve.layers.kernels.norm import naive as norm_naive

    torch.manual_seed(6)
    bounds = [0, 1000, 2049]
    q, k, v, g, beta = make_inputs(bounds[-1], 16, 32, 128, 128, dtype=torch.bfloat16)
    proj = torch.randn(bounds[-1], 32 * 128 + 64, device=DEVICE, dtype=torch.bfloat16)
    z = proj[:, : 32 * 128].view(bounds[-1], 32, 128)
    weight = (1 + 0.2 * torch.randn(128, device=DEVICE)).to(torch.bfloat16)
    cu_seqlens = torch.tensor(bounds, dtype=torch.int32, device=DEVICE)
    pool = torch.randn(2, 32, 128, 128, device=DEVICE) * 0.1
    slots = torch.tensor([1, 0], dtype=torch.int32, device=DEVICE)
    has_init = torch.tensor([True, True], device=DEVICE)
    args = (q, k, v, g, beta, cu_seqlens, pool, slots, has_init)
    raw, _, _ = run_chunk(naive.chunk_gated_delta_rule, *args)
    ref = norm_naive.gated_rms_norm(x=raw, gate=z, weight=weight, eps=1e-6)
    norm = dict(norm_gate=z, norm_weight=weight, norm_eps=1e-6)
    out, _, _ = run_chunk(chunk_module.chunk_gated_delta_rule, *args, variant=variant, **norm)
    assert rel_err(out, ref) < BF16_TOL


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("variant", ["fused", "fused_pf", "split32"])
def test_chunk_captures_bf16_real_shapes(nan_fill, variant):
    """Prefix-cache captures at the model's shapes in bf16: stores after chunks (the sequential walks'
    one-offset-tensor stores) and replays inside them (advance.py's wgmma dots at K = V = 128), two
    sequences, each capture against the float32 reference run on just its prefix; the pass's own
    outputs and final states unchanged by them, bit for bit."""
    from deltaserve.layers.kernels.gdn.state import StateCapture, StateCaptures

    torch.manual_seed(12)
    bounds = [0, 300, 700]
    q, k, v, g, beta = make_inputs(bounds[-1], 16, 32, 128, 128, dtype=torch.bfloat16)
    caps = [(0, 0), (0, 1), (0, 64), (0, 127), (0, 250), (0, 300), (1, 5), (1, 192), (1, 333), (1, 400)]
    pool = torch.randn(2 + len(caps), 32, 128, 128, device=DEVICE) * 0.1
    init = pool[:2].clone()
    cu = torch.tensor(bounds, dtype=torch.int32, device=DEVICE)
    slots = torch.tensor([0, 1], dtype=torch.int32, device=DEVICE)
    has_init = torch.tensor([True, False], device=DEVICE)
    captures = StateCaptures(tuple(StateCapture(n, off, 2 + i) for i, (n, off) in enumerate(caps)), (300, 400))
    kw = dict(q=q, k=k, v=v, g=g, beta=beta, cu_seqlens=cu, state_slots=slots, has_initial_state=has_init)
    plain = pool.clone()
    want_out = chunk_module.chunk_gated_delta_rule(state_pool=plain, variant=variant, **kw)
    out = chunk_module.chunk_gated_delta_rule(state_pool=pool, captures=captures, variant=variant, **kw)
    assert torch.equal(out, want_out) and torch.equal(pool[:2], plain[:2])
    for i, (n, off) in enumerate(caps):
        ref = torch.zeros(1, 32, 128, 128, device=DEVICE) if n == 1 else init[:1].clone()
        rows = slice(bounds[n], bounds[n] + off)
        naive.chunk_gated_delta_rule(
            q=q[rows], k=k[rows], v=v[rows], g=g[rows], beta=beta[rows], state_pool=ref,
            cu_seqlens=torch.tensor([0, off], dtype=torch.int32, device=DEVICE),
            state_slots=torch.zeros(1, dtype=torch.int32, device=DEVICE),
            has_initial_state=torch.tensor([n == 0], device=DEVICE),
        )  # fmt: skip
        assert rel_err(pool[2 + i], ref[0]) < BF16_TOL, (n, off)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("length", [1, 4])
@pytest.mark.parametrize("variant", [None, *RECURRENT_VARIANTS.values()])
def test_recurrent_bf16_real_shapes(nan_fill, length, variant):
    torch.manual_seed(5)
    num_seqs = 64
    q, k, v, g, beta = make_inputs(length, 16, 32, 128, 128, dtype=torch.bfloat16, lead=(num_seqs,))
    pool = torch.randn(num_seqs + 8, 32, 128, 128, device=DEVICE) * 0.1
    slots = torch.randperm(num_seqs + 8, device=DEVICE)[:num_seqs].int()
    results = []
    impls = (naive.fused_recurrent_gated_delta_rule, recurrent_module.fused_recurrent_gated_delta_rule)
    for impl, kw in zip(impls, ({}, {"variant": RECURRENT_VARIANTS.get(variant, variant)}), strict=True):
        p = pool.clone()
        inter = torch.full((num_seqs, length, 32, 128, 128), float("nan"), device=DEVICE)
        o = impl(q=q, k=k, v=v, g=g, beta=beta, state_pool=p, state_slots=slots, intermediate_states_out=inter, **kw)
        results.append((o, p, inter))
    (ref, ref_pool, ref_inter), (out, out_pool, out_inter) = results
    assert rel_err(out, ref) < BF16_TOL
    assert rel_err(out_pool, ref_pool) < 1e-4  # the state math is float32 on both sides
    assert rel_err(out_inter, ref_inter) < 1e-4


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("param_dtype", [torch.float32, torch.bfloat16])
def test_gating_bf16_real_shapes(nan_fill, param_dtype):
    torch.manual_seed(10)
    a, b, a_log, dt_bias = make_raw_gates((8195,), 32, torch.bfloat16, param_dtype)
    ref_g, ref_beta = naive.gdn_gating(a=a, b=b, A_log=a_log, dt_bias=dt_bias)
    g, beta = gating_module.gdn_gating(a=a, b=b, A_log=a_log, dt_bias=dt_bias)
    assert rel_err(g, ref_g) < 1e-5
    assert rel_err(beta, ref_beta) < 1e-5


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("length", [1, 4])
@pytest.mark.parametrize("variant", [None, *RECURRENT_VARIANTS.values()])
def test_recurrent_raw_gates_bf16_real_shapes(nan_fill, length, variant):
    torch.manual_seed(11)
    num_seqs = 64
    q, k, v, _, _ = make_inputs(length, 16, 32, 128, 128, dtype=torch.bfloat16, lead=(num_seqs,))
    a, b, a_log, dt_bias = make_raw_gates((num_seqs * length,), 32, torch.bfloat16, spread=4.0)
    a, b = a.view(num_seqs, length, -1), b.view(num_seqs, length, -1)
    g, beta = naive.gdn_gating(a=a, b=b, A_log=a_log, dt_bias=dt_bias)
    pool = torch.randn(num_seqs + 8, 32, 128, 128, device=DEVICE) * 0.1
    slots = torch.randperm(num_seqs + 8, device=DEVICE)[:num_seqs].int()
    ref_pool, out_pool = pool.clone(), pool.clone()
    ref = naive.fused_recurrent_gated_delta_rule(q=q, k=k, v=v, g=g, beta=beta, state_pool=ref_pool, state_slots=slots)
    out = recurrent_module.fused_recurrent_gated_delta_rule(
        q=q, k=k, v=v, a=a, b=b, A_log=a_log, dt_bias=dt_bias, state_pool=out_pool, state_slots=slots, variant=variant
    )
    assert rel_err(out, ref) < BF16_TOL
    assert rel_err(out_pool, ref_pool) < 1e-4
    untouched = torch.ones(pool.shape[0], dtype=torch.bool, device=DEVICE)
    untouched[slots.long()] = False
    assert torch.equal(out_pool[untouched], pool[untouched])


def test_chunk_variant_picker():
    """pick_variant on an H200 (132 SMs) at the 35B shape (32 value heads of 128): the split design for
    one or two sequences of 512 tokens or more (the sequential grid fits one wave; its walk in windows
    once the pass has 128 chunks), fused below that and for many sequences up to 2,048 tokens each,
    fused_pf for many longer ones."""
    from deltaserve.layers.kernels.gdn.chunk import pick_variant

    def pick(seqs: int, tokens: int | None) -> str:
        return pick_variant(seqs, 32, 128, 132, tokens)

    assert pick(1, 512) == pick(1, 8192) == pick(2, 2048) == pick(1, None) == "split32_win"
    split, windowed = chunk_module.VARIANTS["split32"], chunk_module.VARIANTS["split32_win"]
    assert dataclasses.replace(windowed, windows=1) == split  # the same kernels and tiles
    lengths = (2048, 8064, 8192, 16384, 32768, 65536, 262144)
    counts = [len(chunk_module.chunk_windows(t // 64 + 1, windowed.windows)) for t in lengths]
    assert counts == [1, 1, 2, 2, 4, 8, 8]  # chunk_gated_delta_rule's max_chunks for one sequence
    assert pick(1, 511) == pick(2, 1000) == pick(64, 64 * 1024) == "fused"
    assert pick(64, 64 * 4096) == pick(3, 3 * 4096) == "fused_pf"
