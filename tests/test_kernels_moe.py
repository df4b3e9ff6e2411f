"""Triton fused MoE vs the plain-torch reference at tiny shapes (both paths, expert parallelism,
repeated experts): interpreted on CPU tensors without CUDA, compiled on the GPU with it; and
(marked gpu) bf16 at the real shapes."""

import pytest
import torch

from deltaserve.layers.kernels import moe as moe_kernels
from deltaserve.layers.kernels.moe import align, naive, tiles
from deltaserve.layers.kernels.moe import triton_moe as tm

# conftest: TRITON_INTERPRET without CUDA, the `device` fixture, gpu-marked tests skipped on CPU
pytestmark = pytest.mark.usefixtures("nan_fill")


def tol(device: torch.device) -> float:
    """float32 inputs: exact-ish under the interpreter; tf32 tl.dot on the GPU."""
    return 1e-5 if device.type == "cpu" else 5e-3


def make_inputs(*, tokens, hidden, inter, local, total, top_k, offset, dtype=torch.float32, device="cpu", seed=0):
    """Weights of `local` experts out of `total`; routing over all `total` experts (so some tokens go
    to experts of other ranks), top_k > 1 and, with few experts, repeats across tokens."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g)
    w13 = torch.randn(local, 2 * inter, hidden, generator=g) * hidden**-0.5
    w2 = torch.randn(local, hidden, inter, generator=g) * inter**-0.5
    logits = torch.randn(tokens, total, generator=g)
    weights, ids = naive.route_topk_softmax(router_logits=logits, top_k=top_k, renormalize=True)
    to = dict(dtype=dtype, device=device)
    return dict(
        hidden=x.to(**to),
        w13=w13.to(**to),
        w2=w2.to(**to),
        topk_weights=weights.to(**to),
        topk_ids=ids.to(device),
        expert_offset=offset,
    )


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert not out.isnan().any(), "NaN in the output (an element was never written)"
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


CASES = [
    # tokens, hidden, inter, local experts, total experts, top_k, offset
    (3, 48, 24, 8, 8, 2, 0),  # no EP; hidden / inter not multiples of the 16-wide tiles' K
    (5, 32, 16, 4, 12, 3, 4),  # EP: experts 4..7 of 12 are local
    (22, 40, 40, 6, 6, 4, 0),  # many repeats per expert: several blocks per expert in the sorted path
    (9, 32, 16, 5, 15, 2, 10),  # EP, the last rank
]


# the sorted path on every case; the pairs path (the interpreter runs one program per pair and row
# block) with its default tiles on the first (hidden 48 in one masked K chunk): the EP shapes run
# it in test_fused_moe_pairs_tiles (CASES[1] itself, and the last rank) and with the default tiles
# (an unmasked K chunk) in test_fused_moe_tokens_without_local_experts and _strided_hidden
PATH_CASES = [("pairs", *CASES[0])] + [("sorted", *c) for c in CASES]


@pytest.mark.parametrize("path,tokens,hidden,inter,local,total,top_k,offset", PATH_CASES)
def test_fused_moe(device, path, tokens, hidden, inter, local, total, top_k, offset):
    args = make_inputs(
        tokens=tokens, hidden=hidden, inter=inter, local=local, total=total, top_k=top_k, offset=offset, device=device
    )
    ref = naive.fused_moe(**args)
    out = tm.fused_moe(**args, path=path)
    assert rel_err(out, ref) < tol(device)


@pytest.mark.parametrize("local, offset", [(6, 0), (4, 2)])  # all experts; an EP rank's slice of them
def test_fused_moe_sorted_grid_orders_and_weight_descriptors_agree(device, local, offset):
    """The sorted path's program orders (row blocks major, N slices major, persistent programs each
    looping over tiles), its weights read through TMA descriptors and its activations kept in sorted
    order for the down GEMM's TMA write the same output, bit for bit, and the reference's: several row blocks
    per expert and several N blocks, an expert width and hidden size that are not multiples of the tiles
    (a tile's rows past an expert's width, K tails past the row)."""
    from deltaserve.layers.kernels.device import device_info
    from deltaserve.layers.kernels.moe import sorted as sorted_path

    args = make_inputs(tokens=22, hidden=40, inter=40, local=local, total=6, top_k=4, offset=offset, device=device)
    assert sorted_path._tma_ok(args["w13"]) and sorted_path._tma_ok(args["w2"])
    cfg = tiles.sorted_config(22 * 4, local, 4, device_info(args["hidden"].device))
    assert 40 % cfg["up"]["block_n"] and 40 % cfg["up"]["block_k"]
    rows = tm.fused_moe(**args, path="sorted", config={**cfg, "n_major": False})
    cols = tm.fused_moe(**args, path="sorted", config={**cfg, "n_major": True})
    tma = tm.fused_moe(**args, path="sorted", config={**cfg, "w_tma": True})
    assert torch.equal(rows, cols) and torch.equal(rows, tma)
    # fewer programs than tiles (the interpreter's 4 "SMs"): every program takes several tiles
    for how, tma_on in (("loop", False), ("flat", True)):
        persistent = tm.fused_moe(**args, path="sorted", config={**cfg, "persistent": how, "w_tma": tma_on})
        assert torch.equal(rows, persistent), f"persistent {how}, TMA {tma_on}"
    # the activations in sorted order, read by the down GEMM through TMA (padding rows never stored)
    for extra in ({}, {"w_tma": True}, {"persistent": "flat"}):
        sorted_act = tm.fused_moe(**args, path="sorted", config={**cfg, "a_tma": True, **extra})
        assert torch.equal(rows, sorted_act), f"a_tma with {extra}"
    assert rel_err(tma, naive.fused_moe(**args)) < tol(device)


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("extras", ["", "shared+norm"])
def test_fused_moe_grouped_gemm_path(device, case, extras):
    """prefill_gemm="torch": the pairs gathered into expert order, torch's grouped GEMMs, the sum
    kernel reading each slot's row with its weight (and the shared expert and next norm): bf16 within
    a few roundings of the float32 reference, with expert parallelism (pairs of other ranks' experts
    never gathered) and experts with no pairs."""
    tokens, hidden, inter, local, total, top_k, offset = case
    hidden = 2 * hidden  # rows 16-byte aligned, as torch's grouped GEMM wants
    args = make_inputs(
        tokens=tokens, hidden=hidden, inter=2 * inter, local=local, total=total, top_k=top_k, offset=offset,
        dtype=torch.bfloat16, device=device,
    )  # fmt: skip
    ref_args = {k: v.float() if v.is_floating_point() else v for k, v in args.items() if k != "expert_offset"}
    ref_args["expert_offset"] = offset
    if extras:
        g = torch.Generator().manual_seed(5)
        sw2 = (torch.randn(hidden, 32, generator=g) * 32**-0.5).to(device, torch.bfloat16)
        gate_up = torch.randn(tokens, 64, generator=g).to(device, torch.bfloat16)
        gate = torch.randn(tokens, 1, generator=g).to(device, torch.bfloat16)
        residual = torch.randn(tokens, hidden, generator=g).to(device, torch.bfloat16)
        weight = (torch.randn(hidden, generator=g) * 0.1).to(device, torch.bfloat16)
        args["shared"] = naive.SharedExpert(gate_up=gate_up, w2=sw2, gate_logit=gate)
        args["add_norm"] = naive.AddNorm(residual=residual, weight=weight, eps=1e-6)
        ref_args["shared"] = naive.SharedExpert(gate_up=gate_up.float(), w2=sw2.float(), gate_logit=gate.float())
        ref_args["add_norm"] = naive.AddNorm(residual=residual.float(), weight=weight.float(), eps=1e-6)
    ref = naive.fused_moe(**ref_args)
    out = tm.fused_moe(**args, path="sorted", prefill_gemm="torch")
    if extras:
        assert rel_err(out.residual, ref.residual) < 1e-2 and rel_err(out.normed, ref.normed) < 1e-2
    else:
        assert rel_err(out, ref) < 1e-2
    if device.type == "cuda":  # ours on the same bf16 inputs (the interpreter's bf16 dots are not exact)
        ours = tm.fused_moe(**args, path="sorted")
        assert rel_err(out.residual if extras else out, ours.residual if extras else ours) < 1e-2


def test_fused_moe_tokens_without_local_experts(device):
    """Tokens routed only to other ranks' experts get zeros; the default path choice on both sides
    of PAIRS_PATH_MAX (4 pairs; 2 more than PAIRS_PATH_MAX)."""
    for tokens in (2, tm.PAIRS_PATH_MAX // 2 + 1):
        args = make_inputs(tokens=tokens, hidden=32, inter=16, local=4, total=16, top_k=2, offset=8, device=device)
        args["topk_ids"][0] = torch.tensor([0, 15])
        args["topk_ids"][1] = torch.tensor([9, 9 + 4])
        ref = naive.fused_moe(**args)
        out = tm.fused_moe(**args)
        assert torch.equal(out[0], torch.zeros_like(out[0]))
        assert rel_err(out, ref) < tol(device)


def test_align_pairs_layout(device):
    """Every local pair lands once inside its expert's padded block range; padding rows hold the
    sentinel; block_expert matches; non-local pairs appear nowhere."""
    ids = torch.tensor([[3, 1], [3, 5], [0, 3], [1, 2], [6, 3], [3, 4]], device=device)
    local, offset, block_m = 4, 1, 2  # local experts are global 1..4
    sorted_ids, block_expert, offsets = align.align_pairs(
        topk_ids=ids, num_experts=local, expert_offset=offset, block_m=block_m
    )
    ids, sorted_ids, block_expert, offsets = (t.cpu() for t in (ids, sorted_ids, block_expert, offsets))
    flat = ids.flatten() - offset
    counts = torch.bincount(flat[(flat >= 0) & (flat < local)], minlength=local)
    padded = (counts + block_m - 1) // block_m * block_m
    assert offsets.tolist() == [0, *padded.cumsum(0).tolist()]
    total = int(offsets[-1])
    rows = sorted_ids[:total]
    for e in range(local):
        members = rows[offsets[e] : offsets[e + 1]]
        real = members[members < ids.numel()]
        assert sorted(real.tolist()) == torch.nonzero(flat == e).flatten().tolist()
        assert (members[len(real) :] == ids.numel()).all()
        first, last = int(offsets[e]) // block_m, int(offsets[e + 1]) // block_m
        assert (block_expert[first:last] == e).all()
    assert (block_expert[total // block_m :] == -1).all()


def test_fused_moe_strided_hidden(device):
    args = make_inputs(tokens=4, hidden=32, inter=16, local=4, total=4, top_k=2, offset=0, device=device)
    wide = torch.randn(4, 64, device=device)
    wide[:, :32] = args["hidden"]
    args["hidden"] = wide[:, :32]
    ref = naive.fused_moe(**args)
    for path in ("pairs", "sorted"):
        assert rel_err(tm.fused_moe(**args, path=path), ref) < tol(device)


GEMV_CONFIGS = [
    # tails everywhere: K chunks that do not divide hidden, row blocks that do not divide inter / hidden
    dict(up=dict(block_n=16, block_k=32, num_warps=4), down=dict(block_h=32, block_i=16, num_warps=4)),
    # one chunk over all of K, thin row blocks, one warp
    dict(up=dict(block_n=2, block_k=64, num_warps=1), down=dict(block_h=4, block_i=64, num_warps=1)),
]


# shape (tokens, hidden, inter, local, total, top_k, offset), tiles: the tiled K loop on every shape
# (EP or not); the thin one-chunk tiles (a program per 2 rows: the interpreter's dearest) on a small
# shape whose hidden is that one chunk (the up GEMV's unmasked K loads) and whose odd inter leaves
# a row tail (its masked rows) and a tail in the down GEMV's one chunk over the expert width
PAIRS_TILE_CASES = [
    pytest.param(*CASES[0], GEMV_CONFIGS[0], id="tiled-no-ep"),
    pytest.param(*CASES[1], GEMV_CONFIGS[0], id="tiled-ep"),
    pytest.param(4, 40, 24, 3, 9, 3, 6, GEMV_CONFIGS[0], id="tiled-ep-last-rank"),
    pytest.param(2, 64, 13, 4, 4, 2, 0, GEMV_CONFIGS[1], id="thin-one-chunk"),
]


@pytest.mark.parametrize("tokens,hidden,inter,local,total,top_k,offset,cfg", PAIRS_TILE_CASES)
def test_fused_moe_pairs_tiles(device, cfg, tokens, hidden, inter, local, total, top_k, offset):
    """The GEMV pairs kernels with tiles that leave tails in every dimension, with and without EP."""
    args = make_inputs(
        tokens=tokens, hidden=hidden, inter=inter, local=local, total=total, top_k=top_k, offset=offset, device=device
    )
    ref = naive.fused_moe(**args)
    assert rel_err(tm.fused_moe(**args, path="pairs", config=cfg), ref) < tol(device)


def test_fused_moe_pairs_half_precision_float32_weights(device):
    """float32 top-k weights (what the router returns) with 16-bit activations and weights; float16
    stands in for bf16 under the interpreter. The weights' dtype must not change the result."""
    args = make_inputs(tokens=3, hidden=32, inter=16, local=8, total=8, top_k=4, offset=0, device=device)
    half = {k: (v.half() if torch.is_tensor(v) and v.is_floating_point() else v) for k, v in args.items()}
    as_fp32 = dict(half, topk_weights=half["topk_weights"].float())
    out16 = tm.fused_moe(**half, path="pairs")
    out32 = tm.fused_moe(**as_fp32, path="pairs")
    assert out16.dtype == out32.dtype == torch.float16
    ref = naive.fused_moe(**args)
    assert rel_err(out32, ref) < 2e-3
    assert rel_err(out16, ref) < 2e-3


# --- router ---------------------------------------------------------------------------------------


def check_topk(logits: torch.Tensor, top_k: int, renormalize: bool, weights: torch.Tensor, ids: torch.Tensor):
    """The router's output against naive.route_topk_softmax, allowing for tied logits: the weights
    match, every row's ids are distinct and point at experts of exactly those weights (so a valid
    top-k), picked in descending logit order with equal logits in ascending expert order (the
    kernel selects on the logits: two logits a few ulps apart may still round to one weight, and
    then the larger logit comes first). Returns how many rows' ids differ from torch.topk's."""
    ref_w, ref_ids = naive.route_topk_softmax(router_logits=logits, top_k=top_k, renormalize=renormalize)
    assert weights.shape == ids.shape == (logits.shape[0], top_k)
    assert weights.dtype == torch.float32 and ids.dtype == torch.int64
    assert not weights.isnan().any()
    torch.testing.assert_close(weights, ref_w, rtol=1e-5, atol=1e-7)
    probs = torch.softmax(logits.float(), dim=-1)
    assert ((ids >= 0) & (ids < logits.shape[1])).all()
    picked = probs.gather(1, ids)
    if renormalize:
        picked = picked / picked.sum(dim=-1, keepdim=True)
    torch.testing.assert_close(picked, weights, rtol=1e-5, atol=1e-7)
    assert (ids.sort(dim=-1).values.diff(dim=-1) > 0).all(), "an expert picked twice"
    chosen = logits.gather(1, ids)
    assert (chosen[:, 1:] <= chosen[:, :-1]).all(), "not in descending logit order"
    tied = chosen[:, 1:] == chosen[:, :-1]
    assert (ids[:, 1:] > ids[:, :-1])[tied].all(), "equal logits out of expert order"
    return int((ids != ref_ids).any(dim=-1).sum())


@pytest.mark.parametrize(
    "tokens,experts,top_k,renormalize",
    [(1, 256, 8, True), (5, 60, 3, False), (33, 512, 16, True), (7, 8, 8, True), (3, 16, 1, False), (20, 128, 4, True)],
)
def test_route_topk_softmax(device, tokens, experts, top_k, renormalize):
    """Random float32 logits (no ties): the same ids in the same order as softmax + torch.topk."""
    g = torch.Generator().manual_seed(tokens * experts)
    logits = (3 * torch.randn(tokens, experts, generator=g)).to(device)
    weights, ids = tm.route_topk_softmax(router_logits=logits, top_k=top_k, renormalize=renormalize)
    assert check_topk(logits, top_k, renormalize, weights, ids) == 0


def test_route_topk_softmax_ties_and_layout(device):
    """Small-integer logits tie everywhere; a strided view of 16-bit logits (the model's dtype,
    float16 standing in for bf16); no tokens."""
    g = torch.Generator().manual_seed(7)
    logits = torch.randint(-3, 4, (9, 40), generator=g).float().to(device)
    weights, ids = tm.route_topk_softmax(router_logits=logits, top_k=6, renormalize=True)
    check_topk(logits, 6, True, weights, ids)
    wide = torch.randn(6, 2 * 96, generator=g).half().to(device)
    logits = wide[:, 5 : 5 + 96]
    weights, ids = tm.route_topk_softmax(router_logits=logits, top_k=8, renormalize=False)
    check_topk(logits, 8, False, weights, ids)
    weights, ids = tm.route_topk_softmax(router_logits=logits[:0], top_k=8, renormalize=True)
    assert weights.shape == ids.shape == (0, 8)


def test_route_topk_softmax_configs(device):
    """Several tokens per program, with the last program half empty."""
    logits = torch.randn(11, 64, device=device)
    for cfg in (dict(block_t=4, num_warps=4), dict(block_t=1, num_warps=1), dict(block_t=16, num_warps=2)):
        weights, ids = tm.route_topk_softmax(router_logits=logits, top_k=5, renormalize=True, config=cfg)
        assert check_topk(logits, 5, True, weights, ids) == 0


# --- GPU, bf16, the real shapes (hidden 2048, 256 experts, top-8, expert width 512) ---------------


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 3, 64, 256, 2048, 4096, 8192])
def test_gpu_fused_moe_bf16(tokens):
    args = make_inputs(
        tokens=tokens,
        hidden=2048,
        inter=512,
        local=256,
        total=256,
        top_k=8,
        offset=0,
        dtype=torch.bfloat16,
        device="cuda",
        seed=tokens,
    )
    assert rel_err(tm.fused_moe(**args), naive.fused_moe(**args)) < 2e-2


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [8192, 24576, 32768])
def test_gpu_align_pairs_every_pair_once(tokens):
    """The two-launch grouping at a long prompt's pairs, ten calls on memory left dirty: every pair in
    exactly one row, every padding row the sentinel, the counters back at zero. Before the place
    kernel's barrier a thread could zero an expert's counter before another thread read it, and that
    thread's padding overwrote placed pairs (H100 / H200: 1-10 of every 10 calls from 24k tokens)."""
    from deltaserve.layers.kernels.device import ticket_buffers

    experts, top_k, block_m = 256, 8, 128
    g = torch.Generator(device="cuda").manual_seed(tokens)
    for call in range(10):
        logits = torch.randn(tokens, experts, device="cuda", generator=g)
        ids = logits.topk(top_k, dim=1).indices
        junk = torch.full((tokens * top_k * 16,), -7, dtype=torch.int32, device="cuda")
        del junk  # the next allocations start dirty
        sorted_ids, block_expert, offsets = align.align_pairs(
            topk_ids=ids, num_experts=experts, expert_offset=0, block_m=block_m
        )
        counts = torch.bincount(ids.flatten(), minlength=experts)
        ends = torch.cumsum((counts + block_m - 1) // block_m * block_m, 0)
        assert torch.equal(offsets[1:].long(), ends), call
        rows = sorted_ids[: int(ends[-1])].long()
        real = rows[rows < ids.numel()]
        assert real.numel() == ids.numel() and torch.equal(real.sort().values, torch.arange(ids.numel(), device="cuda"))
        assert int((rows > ids.numel()).sum()) + int((rows < 0).sum()) == 0, call  # the rest: the sentinel
        assert int(ticket_buffers("moe_align", ids.device)[-1][: experts + 1].count_nonzero()) == 0, call


@pytest.mark.gpu
def test_gpu_fused_moe_bf16_long_prompt():
    """A 32k-token pass (262,144 pairs, one prompt's prefill) against the reference, twice on dirty
    memory: the path a one-pass 32k prompt runs."""
    args = make_inputs(
        tokens=32768, hidden=2048, inter=512, local=256, total=256, top_k=8, offset=0, dtype=torch.bfloat16,
        device="cuda", seed=7,
    )  # fmt: skip
    ref = naive.fused_moe(**args)
    for _ in range(2):
        junk = torch.full((32768 * 8 * 2048,), float("nan"), dtype=torch.bfloat16, device="cuda")
        del junk
        assert rel_err(tm.fused_moe(**args), ref) < 2e-2


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [16, 2048, 8192])
def test_gpu_sorted_activations_through_tma_bf16(tokens):
    """The activations in sorted order, read by the down GEMM through TMA (tile key a_tma), alone and
    with the persistent GEMMs (flattened or not): the bits of the default tiles at the model's shape.
    16 tokens: a few tiles for a grid sized by the most any routing needs, so most persistent programs
    have none (where a flattened loop's hoisted loads faulted in the engine)."""
    from deltaserve.layers.kernels.device import device_info

    args = make_inputs(
        tokens=tokens, hidden=2048, inter=512, local=256, total=256, top_k=8, offset=0, dtype=torch.bfloat16,
        device="cuda", seed=tokens,
    )  # fmt: skip
    cfg = tiles.sorted_config(tokens * 8, 256, 2, device_info(torch.device("cuda")))
    plain = tm.fused_moe(**args, path="sorted", config=cfg)
    forms = ({"a_tma": True}, {"a_tma": True, "persistent": "flat"}, {"persistent": "flat"}, {"persistent": "loop"})
    for extra in forms:
        assert torch.equal(tm.fused_moe(**args, path="sorted", config={**cfg, **extra}), plain), extra


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 256])
def test_gpu_fused_moe_expert_parallel_bf16(tokens):
    args = make_inputs(
        tokens=tokens,
        hidden=2048,
        inter=512,
        local=64,
        total=256,
        top_k=8,
        offset=128,
        dtype=torch.bfloat16,
        device="cuda",
        seed=tokens + 1,
    )
    ref = naive.fused_moe(**args)
    out = tm.fused_moe(**args)
    if ref.abs().max() == 0:  # no token reached this rank
        assert torch.equal(out, ref)
    else:
        assert rel_err(out, ref) < 2e-2


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 2, 4, 16])
@pytest.mark.parametrize("path", ["pairs", "sorted"])
def test_gpu_fused_moe_small_batches_bf16(tokens, path):
    """Decode batches on every path (the default choice moves with PAIRS_PATH_MAX)."""
    args = make_inputs(
        tokens=tokens,
        hidden=2048,
        inter=512,
        local=256,
        total=256,
        top_k=8,
        offset=0,
        dtype=torch.bfloat16,
        device="cuda",
        seed=100 + tokens,
    )
    args["topk_weights"] = args["topk_weights"].float()  # what the router hands over
    assert rel_err(tm.fused_moe(**args, path=path), naive.fused_moe(**args)) < 2e-2


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 64, 256, 8192])
@pytest.mark.parametrize("experts,top_k", [(256, 8), (512, 10), (128, 16)])
def test_gpu_route_topk_softmax_bf16(tokens, experts, top_k):
    """bf16 logits (the router GEMV's output dtype) tie now and then: check_topk allows for that."""
    g = torch.Generator(device="cuda").manual_seed(tokens * experts + top_k)
    logits = torch.randn(tokens, experts, device="cuda", dtype=torch.bfloat16, generator=g)
    for renormalize in (True, False):
        weights, ids = moe_kernels.route_topk_softmax(router_logits=logits, top_k=top_k, renormalize=renormalize)
        check_topk(logits, top_k, renormalize, weights, ids)
    # float32 logits: torch's order, except where two logits a few ulps apart round to one probability
    logits32 = torch.randn(tokens, experts, device="cuda", generator=g)
    weights, ids = moe_kernels.route_topk_softmax(router_logits=logits32, top_k=top_k, renormalize=True)
    assert check_topk(logits32, top_k, True, weights, ids) <= tokens // 1000


@pytest.mark.gpu
def test_gpu_router_same_bits_at_every_pass_size():
    """A token's routing is the same bits whether it is routed alone, in a decode-sized batch or in an
    8k prefill (router_config: one token a one-warp program at every size), on logits strided as the
    model's (the router's columns of the router + shared expert projection)."""
    wide = torch.randn(8192, 1281, device="cuda", dtype=torch.bfloat16)
    logits = wide[:, :256]
    weights, ids = moe_kernels.route_topk_softmax(router_logits=logits, top_k=8, renormalize=True)
    for lo, hi in ((0, 1), (100, 116), (4000, 5024), (7000, 8192)):
        w, i = moe_kernels.route_topk_softmax(router_logits=logits[lo:hi], top_k=8, renormalize=True)
        assert torch.equal(w, weights[lo:hi]) and torch.equal(i, ids[lo:hi]), (lo, hi)


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 16])
def test_gpu_router_and_moe_in_cuda_graph(tokens):
    """Router + fused MoE captured in a CUDA graph (no host syncs) and replayed on new inputs."""
    args = make_inputs(
        tokens=tokens,
        hidden=2048,
        inter=512,
        local=256,
        total=256,
        top_k=8,
        offset=0,
        dtype=torch.bfloat16,
        device="cuda",
        seed=7,
    )
    logits = torch.randn(tokens, 256, device="cuda", dtype=torch.bfloat16)

    def step():
        weights, ids = moe_kernels.route_topk_softmax(router_logits=logits, top_k=8, renormalize=True)
        out = moe_kernels.fused_moe(
            hidden=args["hidden"], w13=args["w13"], w2=args["w2"], topk_weights=weights, topk_ids=ids
        )
        return weights, ids, out

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # compile outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        weights, ids, out = step()
    for seed in range(3):
        logits.copy_(torch.randn(tokens, 256, generator=torch.Generator().manual_seed(seed)))
        args["hidden"].copy_(torch.randn(tokens, 2048, generator=torch.Generator().manual_seed(seed + 10)))
        graph.replay()
        # bf16 logits can tie at the k-th place, where torch may pick the other expert: the router is
        # checked as a valid top-k, and the MoE against the reference on the router's own choice
        check_topk(logits, 8, True, weights, ids)
        ref = naive.fused_moe(hidden=args["hidden"], w13=args["w13"], w2=args["w2"], topk_weights=weights, topk_ids=ids)
        assert rel_err(out, ref) < 2e-2
