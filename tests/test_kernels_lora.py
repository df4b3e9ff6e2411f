"""Segmented LoRA (Triton, grouped by adapter slot on the device) against the plain-torch reference
at tiny shapes: several adapters and base-only rows in one batch, fused projections with several
slices, and the experts' per-pair deltas inside the fused MoE; interpreted on CPU tensors without
CUDA, compiled on the GPU with it. Outputs the kernels allocate are NaN-filled first (nan_fill)."""

import pytest
import torch

from deltaserve.layers.kernels import lora as lora_kernels
from deltaserve.layers.kernels.lora import naive
from deltaserve.layers.kernels.lora import triton_lora as tl_lora
from deltaserve.layers.kernels.moe import naive as moe_naive
from deltaserve.layers.kernels.moe import triton_moe as tm

pytestmark = pytest.mark.usefixtures("nan_fill")


def tol(device: torch.device) -> float:
    return 1e-5 if device.type == "cpu" else 5e-3


def slots_weights(g, slots, rank, k, n, slices, ranks):
    """a [S, J * R, K], b [S, N, R] with each slot's own rank (zero past it), like loaded adapters."""
    a = torch.zeros(slots, slices * rank, k)
    b = torch.zeros(slots, n, rank)
    for s, r in enumerate(ranks):
        for j in range(slices):
            a[s, j * rank : j * rank + r] = torch.randn(r, k, generator=g) * k**-0.5
        b[s, :, :r] = torch.randn(n, r, generator=g)
    return a, b


def explicit(y, x, a, b, bounds, token_slots):
    """Each token's delta written out row by row (the definition the reference must meet)."""
    out = y.clone().double()
    rank = b.shape[2]
    for t, s in enumerate(token_slots.tolist()):
        if s < 0:
            continue
        for j in range(len(bounds) - 1):
            lo, hi = bounds[j], bounds[j + 1]
            v = a[s, j * rank : (j + 1) * rank].double() @ x[t].double()
            out[t, lo:hi] += b[s, lo:hi].double() @ v
    return out


CASES = [
    # tokens, K, slot rows (-1: none), bounds, rank
    (5, 40, [0, -1, 2, 0, 1], (0, 24), 16),
    (9, 48, [1, 1, -1, 0, 2, 2, 2, -1, 0], (0, 20, 28, 36), 16),  # q | k | v: three slices, odd widths
    (4, 24, [-1, -1, -1, -1], (0, 10, 18, 19, 40), 32),  # no adapter in the batch; four slices
    # several row blocks per slot (16 rows a block): slots 0 and 1 take 17 rows each, 6 rows none
    (40, 33, [-1 if i % 7 == 0 else i % 2 for i in range(40)], (0, 17, 70), 16),
]

# each case with the grouped shrink, and with the per-row GEMV shrink where it adds something: the
# GEMV's rows are independent programs, so the 40-row case is the 9-row one again on it
ADD_LORA_CASES = [
    pytest.param(*case, gemv, id=f"{case[0]}-{'gemv' if gemv else 'grouped'}")
    for case in CASES
    for gemv in (False, True)
    if not (gemv and case[0] > 16)
]


@pytest.mark.parametrize("tokens,k,slot_rows,bounds,rank,gemv", ADD_LORA_CASES)
def test_add_lora(device, tokens, k, slot_rows, bounds, rank, gemv):
    """Grouped shrink, or (gemv: given the rows' keys, at decode sizes) the per-row GEMV shrink."""
    g = torch.Generator().manual_seed(tokens)
    slices, n = len(bounds) - 1, bounds[-1]
    a, b = slots_weights(g, 3, rank, k, n, slices, ranks=(rank, 3, 8))
    x = torch.randn(tokens, k, generator=g)
    wide = torch.randn(tokens, n + 6, generator=g)  # the projection's output, with rows past the LoRA's
    slots = torch.tensor(slot_rows, dtype=torch.int32)
    want = explicit(wide[:, :n], x, a, b, bounds, slots)
    ref = naive.add_lora(y=wide.clone(), x=x, a=a, b=b, bounds=bounds, token_slots=slots)
    assert torch.allclose(ref[:, :n].double(), want, atol=1e-5)
    assert torch.equal(ref[:, n:], wide[:, n:])

    to = dict(device=device)
    y = wide.clone().to(**to)
    rows = lora_kernels.LoraRows(slots.to(**to), 3, tl_lora.group_rows(slots.to(**to)[:, None], 3))
    keys = rows.keys if gemv else None
    tl_lora.add_lora(y=y, x=x.to(**to), a=a.to(**to), b=b.to(**to), bounds=bounds, groups=rows.groups, keys=keys)
    y = y.cpu()
    assert torch.allclose(y, ref, atol=tol(device), rtol=tol(device))
    base_rows = slots < 0
    assert torch.equal(y[base_rows], wide[base_rows]), "rows without an adapter are not touched"
    assert torch.equal(y[:, n:], wide[:, n:]), "columns past the LoRA's rows are not touched"


@pytest.mark.parametrize("gemv", [False, True], ids=["grouped", "gemv"])
def test_add_lora_glu_gated(device, gemv):
    """A gated MLP's down adapter: x = [gate | up] read as silu(gate) * up, the delta under
    sigmoid(row_gate) (one launch each for shrink and expand, no activation or gate launches)."""
    g = torch.Generator().manual_seed(2)
    k, n = 24, 40
    a, b = slots_weights(g, 2, 16, k, n, 1, ranks=(16, 5))
    gate_up = torch.randn(7, 2 * k + 3, generator=g)[:, : 2 * k]  # a column slice of a wider projection
    row_gate = torch.randn(7, 9, generator=g)[:, 4:5]
    y = torch.randn(7, n, generator=g)
    slots = torch.tensor([1, -1, 0, 0, 1, -1, 1], dtype=torch.int32)
    act = torch.nn.functional.silu(gate_up[:, :k]) * gate_up[:, k:]
    want = y.clone().double()
    for t, s in enumerate(slots.tolist()):
        if s >= 0:
            want[t] += torch.sigmoid(row_gate[t].double()) * (b[s].double() @ (a[s].double() @ act[t].double()))
    ref = naive.add_lora(
        y=y.clone(), x=gate_up, a=a, b=b, bounds=(0, n), token_slots=slots, glu=True, row_gate=row_gate
    )
    assert torch.allclose(ref.double(), want, atol=1e-5)
    to = dict(device=device)
    out = y.clone().to(**to)
    d = slots.to(**to)
    tl_lora.add_lora(
        y=out, x=gate_up.to(**to), a=a.to(**to), b=b.to(**to), bounds=(0, n), groups=tl_lora.group_rows(d[:, None], 2),
        glu=True, row_gate=row_gate.to(**to), keys=d if gemv else None,
    )  # fmt: skip
    assert torch.allclose(out.cpu(), ref, atol=tol(device), rtol=tol(device))
    assert torch.equal(out.cpu()[slots < 0], y[slots < 0])


@pytest.mark.parametrize("gemv", [False, True], ids=["grouped", "gemv"])
def test_add_lora_half_precision(device, gemv):
    """float16 activations and slots (bf16 stands in): one rounding of the float32 sum."""
    g = torch.Generator().manual_seed(1)
    bounds = (0, 32, 48)
    a, b = slots_weights(g, 2, 16, 64, 48, 2, ranks=(16, 4))
    x = torch.randn(6, 64, generator=g)
    y = torch.randn(6, 48, generator=g)
    slots = torch.tensor([1, 0, -1, 1, 1, 0], dtype=torch.int32)
    ref = naive.add_lora(y=y.clone(), x=x, a=a, b=b, bounds=bounds, token_slots=slots)
    half = dict(device=device, dtype=torch.float16)
    out = y.to(**half)
    d = slots.to(device)
    tl_lora.add_lora(y=out, x=x.to(**half), a=a.to(**half), b=b.to(**half), bounds=bounds,
                     groups=tl_lora.group_rows(d[:, None], 2), keys=d if gemv else None)  # fmt: skip
    assert (out.float().cpu() - ref).abs().max() < 2e-2


def expert_case(device, *, tokens, hidden, inter, local, total, top_k, offset, slots, rank, slot_rows, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g)
    w13 = torch.randn(local, 2 * inter, hidden, generator=g) * hidden**-0.5
    w2 = torch.randn(local, hidden, inter, generator=g) * inter**-0.5
    logits = torch.randn(tokens, total, generator=g)
    weights, ids = moe_naive.route_topk_softmax(router_logits=logits, top_k=top_k, renormalize=True)
    lora = lora_kernels.ExpertLoraWeights(
        a13=torch.randn(slots, local, 2 * rank, hidden, generator=g) * hidden**-0.5,
        b13=torch.randn(slots, local, 2 * inter, rank, generator=g),
        a2=torch.randn(slots, local, rank, inter, generator=g) * inter**-0.5,
        b2=torch.randn(slots, local, hidden, rank, generator=g),
    )
    to = dict(device=device)
    args = dict(
        hidden=x.to(**to), w13=w13.to(**to), w2=w2.to(**to), topk_weights=weights.to(**to), topk_ids=ids.to(**to),
        expert_offset=offset,
    )  # fmt: skip
    lora = lora_kernels.ExpertLoraWeights(*(t.to(**to) for t in lora))
    return args, lora, torch.tensor(slot_rows, dtype=torch.int32, device=device)


EXPERT_CASES = [
    # tokens, hidden, inter, local, total, top_k, offset, slots, slot rows (a few pairs on local
    # experts only: test_routed_moe_with_expert_deltas_on_pairs_path, and the 20-token case's shapes)
    (6, 24, 24, 3, 9, 3, 3, 3, [2, -1, 0, 0, 1, 2]),  # expert parallel: experts 3..5 of 9 are local
    (20, 32, 16, 4, 4, 2, 0, 2, [i % 3 - 1 for i in range(20)]),  # several pairs per (slot, expert)
    (17, 24, 20, 2, 2, 2, 0, 16, [i - 1 for i in range(17)]),  # a sorted block of 16 keys, one row past it
]

# Which case on which path: the pairs path's GEMVs run a program per pair (or token), so only the
# expert-parallel case (local and other ranks' experts, top-3) runs there; several pairs per key and
# many keys per sorted block matter to the sorted path's blocks; the grouped shrinks group the pairs
# by key, so they take the case with several pairs per key and the expert-parallel one (keys of
# other ranks' experts skipped), the many-keys case being the sorted path's again past its shrinks.
EXPERT_PATHS = {
    6: ("pairs", "sorted", "sorted-grouped-shrinks"),
    20: ("sorted", "sorted-grouped-shrinks"),
    17: ("sorted",),
}
EXPERT_PATH_CASES = [
    pytest.param(*case, path, id=f"{case[0]}-{path}") for case in EXPERT_CASES for path in EXPERT_PATHS[case[0]]
]


@pytest.mark.parametrize("tokens,hidden,inter,local,total,top_k,offset,slots,slot_rows,path", EXPERT_PATH_CASES)
def test_fused_moe_with_expert_deltas(
    device, tokens, hidden, inter, local, total, top_k, offset, slots, slot_rows, path, monkeypatch
):
    """The experts' deltas in low-rank form, expanded by the pairs path's GEMVs and the sorted path's
    GEMMs: equal to the reference, and tokens without an adapter get exactly the base experts'
    output (of the same path). sorted-grouped-shrinks: the prefill form of the shrinks (the pairs
    grouped by key first), forced here at a small size."""
    if path == "sorted-grouped-shrinks":
        monkeypatch.setattr(tl_lora, "PAIR_GEMV_MAX_PAIRS", 0)
        path = "sorted"
    args, lora, token_slots = expert_case(
        "cpu", tokens=tokens, hidden=hidden, inter=inter, local=local, total=total, top_k=top_k, offset=offset,
        slots=slots, rank=16, slot_rows=slot_rows,
    )  # fmt: skip
    base = moe_naive.fused_moe(**args)
    deltas = lora_kernels.ExpertDeltas(
        hidden=args["hidden"], token_slots=token_slots, weights=lora, expert_offset=offset
    )
    ref = moe_naive.fused_moe(**args, deltas=deltas)
    # the reference against a direct per-pair computation
    want = _per_pair(args, lora, token_slots)
    assert torch.allclose(ref, want, atol=1e-5)
    assert not torch.allclose(ref, base, atol=1e-3), "the adapters change the output"

    dev = {k: v.to(device) if torch.is_tensor(v) else v for k, v in args.items()}
    dev_lora = lora_kernels.ExpertLoraWeights(*(t.to(device) for t in lora))
    deltas = lora_kernels.ExpertDeltas(
        hidden=dev["hidden"], token_slots=token_slots.to(device), weights=dev_lora, expert_offset=offset, triton=True
    )
    out = tm.fused_moe(**dev, deltas=deltas, path=path).cpu()
    assert not out.isnan().any()
    assert ((out - ref).norm() / ref.norm()).item() < tol(device)
    plain = (token_slots < 0).cpu()
    base_out = tm.fused_moe(**dev, path=path).cpu()
    assert torch.equal(out[plain], base_out[plain])


def test_routed_moe_with_expert_deltas_on_pairs_path(device):
    """A decode-sized batch with adapters keeps the pairs path: routed there, then the GEMVs with the
    deltas; the shared expert and the next norm still fold into the down GEMV."""
    tokens, hidden, inter, local, top_k = 3, 32, 16, 4, 2
    args, lora, token_slots = expert_case(
        "cpu", tokens=tokens, hidden=hidden, inter=inter, local=local, total=local, top_k=top_k, offset=0, slots=2,
        rank=16, slot_rows=[1, -1, 0],
    )  # fmt: skip
    g = torch.Generator().manual_seed(9)
    logits = torch.randn(tokens, local, generator=g)
    shared = moe_naive.SharedExpert(
        gate_up=torch.randn(tokens, 2 * 8, generator=g), w2=torch.randn(hidden, 8, generator=g) * 8**-0.5,
        gate_logit=torch.randn(tokens, 1, generator=g),
    )  # fmt: skip
    add_norm = moe_naive.AddNorm(torch.randn(tokens, hidden, generator=g), torch.randn(hidden, generator=g), 1e-6)
    base = {k: v for k, v in args.items() if k not in ("topk_weights", "topk_ids")}
    ref_deltas = lora_kernels.ExpertDeltas(
        hidden=args["hidden"], token_slots=token_slots, weights=lora, expert_offset=0
    )
    ref = moe_naive.routed_moe(
        **base, router_logits=logits, top_k=top_k, renormalize=True, shared=shared, add_norm=add_norm,
        deltas=ref_deltas,
    )  # fmt: skip

    def on(t):
        if t is None or isinstance(t, float):
            return t
        return t.to(device) if torch.is_tensor(t) else type(t)(*(on(x) for x in t))

    dev = {k: on(v) for k, v in base.items() if torch.is_tensor(v)}
    deltas = lora_kernels.ExpertDeltas(
        hidden=dev["hidden"], token_slots=token_slots.to(device), weights=on(lora), expert_offset=0, triton=True
    )
    out = tm.routed_moe(
        **dev, router_logits=logits.to(device), top_k=top_k, renormalize=True, shared=on(shared),
        add_norm=on(add_norm), deltas=deltas,
    )  # fmt: skip
    for got, want in zip(out, ref, strict=True):
        assert ((got.cpu() - want).norm() / want.norm()).item() < tol(device)


# path x where the shared adapter's shrink runs (its own launch, or folded into the experts' down
# shrink). The grouped (prefill) expert shrinks move only the folded one (into a launch of its own,
# first); with its own shrink that path is the sorted one again (the grouped expert shrinks
# themselves: test_fused_moe_with_expert_deltas)
SHARED_ADAPTER_CASES = [
    ("pairs", False), ("pairs", True), ("sorted", False), ("sorted", True), ("sorted-grouped-shrinks", True),
]  # fmt: skip


@pytest.mark.parametrize(
    ("path", "folded"), SHARED_ADAPTER_CASES,
    ids=lambda v: ("folded-shrink" if v else "own-shrink") if isinstance(v, bool) else v,
)  # fmt: skip
def test_shared_expert_adapter_in_the_last_kernel(device, path, folded, monkeypatch):
    """The shared expert's down adapter (SharedExpert.lora: the glu shrink's v, expanded by the block's
    last kernel: the pairs path's down GEMV, the sorted path's sum kernel) under its sigmoid gate,
    beside the experts' adapters, with the next norm still in that kernel; v's rows of tokens without
    an adapter stay NaN (nan_fill) and are never read. Odd widths, a slot of smaller rank. folded:
    the shrink runs inside the experts' down shrink launch (ExpertDeltas.fold_shrink); with the
    grouped (prefill) expert shrinks it runs in its own launch first."""
    if path == "sorted-grouped-shrinks":
        monkeypatch.setattr(tl_lora, "PAIR_GEMV_MAX_PAIRS", 0)
        path = "sorted"
    tokens, hidden, inter, local, top_k, shared_inter, rank = 5, 24, 24, 4, 2, 12, 16
    slot_rows = [2, -1, 0, 1, 2]
    args, lora, token_slots = expert_case(
        "cpu", tokens=tokens, hidden=hidden, inter=inter, local=local, total=local, top_k=top_k, offset=0, slots=3,
        rank=rank, slot_rows=slot_rows, seed=4,
    )  # fmt: skip
    g = torch.Generator().manual_seed(5)
    a, b = slots_weights(g, 3, rank, shared_inter, hidden, 1, ranks=(16, 5, 16))
    gate_up = torch.randn(tokens, 2 * shared_inter + 3, generator=g)[:, : 2 * shared_inter]
    gate_logit = torch.randn(tokens, 1, generator=g)
    w2 = torch.randn(hidden, shared_inter, generator=g) * shared_inter**-0.5
    add_norm = moe_naive.AddNorm(torch.randn(tokens, hidden, generator=g), torch.randn(hidden, generator=g), 1e-6)
    v = naive.shrink(x=gate_up, a=a, keys=token_slots, glu=True)
    shared = moe_naive.SharedExpert(gate_up, w2, gate_logit, lora=moe_naive.PairLowRank(token_slots, v, b))

    def ref_deltas():
        return lora_kernels.ExpertDeltas(hidden=args["hidden"], token_slots=token_slots, weights=lora, expert_offset=0)

    ref = moe_naive.fused_moe(**args, shared=shared, deltas=ref_deltas())
    base = moe_naive.fused_moe(**args, shared=shared._replace(lora=None), deltas=ref_deltas())
    act = torch.nn.functional.silu(gate_up[:, :shared_inter]) * gate_up[:, shared_inter:]
    for t, s in enumerate(slot_rows):  # the reference against the adapter written out per token
        want = 0 if s < 0 else torch.sigmoid(gate_logit[t]) * (b[s] @ (a[s] @ act[t]))
        assert torch.allclose(ref[t] - base[t], torch.as_tensor(want, dtype=ref.dtype), atol=1e-5)
    ref_normed = moe_naive.fused_moe(**args, shared=shared, add_norm=add_norm, deltas=ref_deltas())

    to = dict(device=device)
    dev = {k: v.to(**to) if torch.is_tensor(v) else v for k, v in args.items()}
    slots_dev = token_slots.to(**to)
    lora_dev = lora_kernels.ExpertLoraWeights(*(t.to(**to) for t in lora))
    deltas = lora_kernels.ExpertDeltas(
        hidden=dev["hidden"], token_slots=slots_dev, weights=lora_dev, expert_offset=0, triton=True
    )
    if folded:
        v_dev = deltas.fold_shrink(x=gate_up.to(**to), a=a.to(**to), keys=slots_dev, glu=True)
        assert v_dev.isnan().all(), "written by the experts' down shrink launch, not before"
    else:
        v_dev = tl_lora.shrink(gate_up.to(**to), a.to(**to), tl_lora.group_rows(slots_dev[:, None], 3), glu=True)
    low = moe_naive.PairLowRank(slots_dev, v_dev, b.to(**to))
    shared_dev = moe_naive.SharedExpert(gate_up.to(**to), w2.to(**to), gate_logit.to(**to), lora=low)
    norm_dev = moe_naive.AddNorm(*(t.to(**to) for t in add_norm[:2]), add_norm.eps)
    normed, residual = tm.fused_moe(**dev, shared=shared_dev, add_norm=norm_dev, deltas=deltas, path=path)
    assert not normed.isnan().any() and not residual.isnan().any()
    for got, want in zip((normed, residual), ref_normed, strict=True):
        assert ((got.cpu() - want).norm() / want.norm()).item() < tol(device)
    # relative to the norm, as above: the sorted path's GPU dots round float32 inputs to TF32, a few
    # hundredths on single sums of ~40 (the pairs path's FMA GEMVs do not)
    block = residual.cpu() - add_norm.residual
    assert ((block - ref).norm() / ref.norm()).item() < tol(device)
    has = token_slots >= 0
    assert torch.allclose(v_dev.cpu()[has], v[has], atol=tol(device), rtol=tol(device))


@pytest.mark.parametrize("tokens", [1, 6])
def test_norm_adds_the_output_projections_adapters(device, tokens):
    """The residual add + norm after an output projection adds the projection's adapters (low_rank:
    its shrink's v, b [S, D, R]) in float32 before the add: equal to the reference, which equals
    add_lora's output then the plain add + norm; rows without an adapter NaN in v, never read."""
    from deltaserve.layers.kernels.norm import naive as norm_naive
    from deltaserve.layers.kernels.norm import triton_norm

    g = torch.Generator().manual_seed(tokens)
    d, k = 40, 24
    a, b = slots_weights(g, 3, 16, k, d, 1, ranks=(16, 7, 16))
    x_in = torch.randn(tokens, k, generator=g)
    y = torch.randn(tokens, d, generator=g)
    residual = torch.randn(tokens, d, generator=g)
    weight = torch.randn(d, generator=g)
    slots = torch.tensor([2, -1, 0, 1, -1, 2][:tokens], dtype=torch.int32)
    v = naive.shrink(x=x_in, a=a, keys=slots)
    low = moe_naive.PairLowRank(slots, v, b)
    ref_normed, ref_sum = norm_naive.fused_add_rms_norm(x=y, residual=residual, weight=weight, eps=1e-6, low_rank=low)
    added = naive.add_lora(y=y.clone(), x=x_in, a=a, b=b, bounds=(0, d), token_slots=slots)
    want_normed, want_sum = norm_naive.fused_add_rms_norm(x=added, residual=residual, weight=weight, eps=1e-6)
    assert torch.allclose(ref_sum, want_sum, atol=1e-5) and torch.allclose(ref_normed, want_normed, atol=1e-5)
    to = dict(device=device)
    v_dev = torch.where((slots >= 0)[:, None], v, torch.full_like(v, float("nan"))).to(**to)
    low_dev = moe_naive.PairLowRank(slots.to(**to), v_dev, b.to(**to))
    normed, summed = triton_norm.fused_add_rms_norm(
        x=y.to(**to), residual=residual.to(**to), weight=weight.to(**to), eps=1e-6, low_rank=low_dev
    )
    assert torch.allclose(summed.cpu(), ref_sum, atol=tol(device), rtol=tol(device))
    assert torch.allclose(normed.cpu(), ref_normed, atol=tol(device), rtol=tol(device))


def test_pair_keys_and_shrink_kernels(device):
    """The gate / up shrink's one launch (the pairs' keys written by it too) and the down shrink
    against naive.pair_keys and naive.pair_shrink; keys and v NaN-filled first (nan_fill)."""
    g = torch.Generator().manual_seed(3)
    ids = torch.tensor([[0, 5], [3, 4], [4, 1], [5, 3]])
    token_slots = torch.tensor([1, -1, 0, 2], dtype=torch.int32)
    want = naive.pair_keys(token_slots, ids, num_local=3, expert_offset=3)
    x = torch.randn(4, 40, generator=g)
    a = torch.randn(9, 32, 40, generator=g)
    ref = naive.pair_shrink(x, a, want, row_div=2)
    to = dict(device=device)
    keys, v = tl_lora.pair_shrink_keys(x.to(**to), a.to(**to), token_slots.to(**to), ids.to(**to), 3, 3)
    assert torch.equal(keys.cpu(), want.reshape(-1))
    has = want.reshape(-1) >= 0
    assert torch.allclose(v.cpu()[has], ref[has], atol=tol(device), rtol=tol(device))
    # the reference by hand: pair 1 (token 0, expert 5 -> local 2, slot 1) reads key 5
    assert torch.allclose(ref[1], a[5] @ x[0], atol=1e-5)
    act = torch.randn(8, 24, generator=g)[:, :20]  # strided rows
    a2 = torch.randn(9, 16, 20, generator=g)
    v2 = tl_lora.pair_shrink(act.to(**to), a2.to(**to), keys, row_div=1).cpu()
    assert torch.allclose(v2[has], naive.pair_shrink(act, a2, want, row_div=1)[has], atol=tol(device), rtol=tol(device))


def _per_pair(args, lora, token_slots):
    x, w13, w2 = args["hidden"].double(), args["w13"].double(), args["w2"].double()
    inter, rank = w2.shape[2], lora.a2.shape[2]
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        s = int(token_slots[t])
        for k in range(args["topk_ids"].shape[1]):
            e = int(args["topk_ids"][t, k]) - args["expert_offset"]
            if not 0 <= e < w13.shape[0]:
                continue
            gu = w13[e] @ x[t]
            if s >= 0:
                a13, b13 = lora.a13[s, e].double(), lora.b13[s, e].double()
                gu[:inter] += b13[:inter] @ (a13[:rank] @ x[t])
                gu[inter:] += b13[inter:] @ (a13[rank:] @ x[t])
            act = torch.nn.functional.silu(gu[:inter]) * gu[inter:]
            y = w2[e] @ act
            if s >= 0:
                y += lora.b2[s, e].double() @ (lora.a2[s, e].double() @ act)
            out[t] += float(args["topk_weights"][t, k]) * y
    return out.float()


def test_pair_keys():
    ids = torch.tensor([[0, 5], [3, 4], [4, 1]])
    keys = naive.pair_keys(torch.tensor([1, -1, 0], dtype=torch.int32), ids, num_local=3, expert_offset=3)
    # slot 1: expert 0 is another rank's, expert 5 is local 2 -> 1 * 3 + 2; row 1: no adapter
    assert keys.tolist() == [[-1, 5], [-1, -1], [1, -1]]
