"""GDN state at other positions (layers/kernels/gdn/state.py): prefill captures for prefix caching, and
verify tables with write-on-accept for speculative decoding, against plain recomputation.

The reference for a capture is the state a sequence's own prefix leaves (the chunked rule run on just
those tokens); for an accept, the state the recurrent rule leaves after the accepted tokens. Without
CUDA the Triton kernels run under the interpreter at tiny shapes."""

import dataclasses
from functools import partial

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from deltaserve.bench.kernels_gdn import RECURRENT_VARIANTS
from deltaserve.layers.kernels import conv1d
from deltaserve.layers.kernels.gdn import chunk as chunk_module
from deltaserve.layers.kernels.gdn import naive
from deltaserve.layers.kernels.gdn import recurrent as recurrent_module
from deltaserve.layers.kernels.gdn import state as gdn_state
from deltaserve.layers.kernels.gdn.state import StateCapture, StateCaptures, VerifyTable

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = 2e-2 if DEVICE == "cuda" else 1e-4


def rel_err(out, ref):
    if torch.isnan(out).any():
        return float("inf")
    return ((out.float() - ref.float()).abs().max() / ref.float().abs().max().clamp(min=1)).item()


def inputs(num_tokens, hk=1, hv=2, kd=8, vd=12, lead=()):
    shape = (*lead, num_tokens)
    q = torch.randn(*shape, hk, kd, device=DEVICE)
    k = torch.randn(*shape, hk, kd, device=DEVICE)
    v = torch.randn(*shape, hv, vd, device=DEVICE)
    g = F.logsigmoid(torch.randn(*shape, hv, device=DEVICE))
    beta = torch.rand(*shape, hv, device=DEVICE)
    return q, k, v, g, beta


def prefix_state(q, k, v, g, beta, start, offset, init, l2norm=True):
    """The state after `offset` tokens of a sequence starting at row `start`, from `init` (or zeros)."""
    hv, kd, vd = v.shape[1], q.shape[2], v.shape[2]
    pool = torch.zeros(1, hv, kd, vd, device=DEVICE) if init is None else init[None].clone()
    rows = slice(start, start + offset)
    naive.chunk_gated_delta_rule(
        q=q[rows], k=k[rows], v=v[rows], g=g[rows], beta=beta[rows],
        cu_seqlens=torch.tensor([0, offset], device=DEVICE), state_pool=pool,
        state_slots=torch.zeros(1, dtype=torch.int32, device=DEVICE),
        has_initial_state=torch.tensor([init is not None], device=DEVICE), use_qk_l2norm=l2norm,
    )  # fmt: skip
    return pool[0]


# A 1-token sequence without an initial state: captures at its start (zeros) and end. Then, a later
# sequence (its chunks and rows past the first one's) with an initial state: at its start and one
# token on (an initial-state store, then a copy of it and a replay), on the first chunk boundary, two
# past it in one chunk (copies of the boundary's stored state, then replays), the sequence end (a
# last chunk that is not full). The kernels replay on the chunked op's own WY rows (advance.py).
BOUNDS = [0, 1, 71]
CAPTURES = [(0, 0), (0, 1), (1, 0), (1, 1), (1, 64), (1, 66), (1, 69), (1, 70)]


# split32_w3: the split design over three windows of one chunk (a walk launch each, the second sequence
# cut at its chunk boundary, where a capture is stored)
@pytest.mark.parametrize(
    "impl, l2norm", [("naive", True), ("fused", True), ("split32", True), ("split32", False), ("split32_w3", True)]
)
def test_chunk_captures_match_the_prefix_state(nan_fill, monkeypatch, impl, l2norm):
    torch.manual_seed(0)
    variant = impl
    if impl == "split32_w3":
        monkeypatch.setattr(chunk_module, "WINDOW_MIN_CHUNKS", 1)
        variant = dataclasses.replace(chunk_module.VARIANTS["split32"], windows=3)
    q, k, v, g, beta = inputs(BOUNDS[-1])
    num_seqs = len(BOUNDS) - 1
    cu = torch.tensor(BOUNDS, dtype=torch.int32, device=DEVICE)
    slots = torch.arange(num_seqs, dtype=torch.int32, device=DEVICE)
    has_init = torch.tensor([False, True], device=DEVICE)
    pool = torch.randn(num_seqs + len(CAPTURES), 2, 8, 12, device=DEVICE)
    init = pool[:num_seqs].clone()
    lens = tuple(b - a for a, b in zip(BOUNDS[:-1], BOUNDS[1:], strict=True))
    captures = StateCaptures(tuple(StateCapture(n, off, num_seqs + i) for i, (n, off) in enumerate(CAPTURES)), lens)
    plan = gdn_state.plan_captures(captures, 64)  # every way of serving a capture is taken
    assert plan.chunk_stores and plan.initial_stores and plan.copies and plan.replays
    args = dict(q=q, k=k, v=v, g=g, beta=beta, cu_seqlens=cu, state_slots=slots, has_initial_state=has_init)
    args["use_qk_l2norm"] = l2norm
    plain_pool = pool.clone()
    if impl == "naive":
        plain = naive.chunk_gated_delta_rule(state_pool=plain_pool, **args)
        out = naive.chunk_gated_delta_rule(state_pool=pool, captures=captures, **args)
    else:
        plain = chunk_module.chunk_gated_delta_rule(state_pool=plain_pool, variant=variant, **args)
        out = chunk_module.chunk_gated_delta_rule(state_pool=pool, captures=captures, variant=variant, **args)
    # captures change nothing else: the same outputs and final states, bit for bit
    assert torch.equal(out, plain)
    assert torch.equal(pool[:num_seqs], plain_pool[:num_seqs])
    for i, (n, off) in enumerate(CAPTURES):
        want = prefix_state(q, k, v, g, beta, BOUNDS[n], off, init[n] if bool(has_init[n]) else None, l2norm)
        assert rel_err(pool[num_seqs + i], want) < TOL, (n, off)


@pytest.mark.parametrize("impl", ["fused", "split32"])
def test_replays_over_value_blocks_and_head_groups(nan_fill, impl):
    """Replays of 1, 17 and 63 tokens (the longest a chunk leaves) from boundary states, on value
    heads sharing key heads and over two value blocks of the replay kernel (V = 40), and captures
    sharing one boundary (copies before the replays): each the state its own prefix leaves."""
    torch.manual_seed(6)
    bounds = [0, 130, 200]
    q, k, v, g, beta = inputs(bounds[-1], hk=2, hv=4, kd=8, vd=40)
    caps = [(0, 1), (0, 81), (0, 127), (1, 64), (1, 65), (1, 69)]
    pool = torch.randn(2 + len(caps), 4, 8, 40, device=DEVICE)
    init = pool[:2].clone()
    captures = StateCaptures(tuple(StateCapture(n, off, 2 + i) for i, (n, off) in enumerate(caps)), (130, 70))
    chunk_module.chunk_gated_delta_rule(
        q=q, k=k, v=v, g=g, beta=beta, cu_seqlens=torch.tensor(bounds, dtype=torch.int32, device=DEVICE),
        state_pool=pool, state_slots=torch.arange(2, dtype=torch.int32, device=DEVICE),
        has_initial_state=torch.tensor([True, False], device=DEVICE), captures=captures, variant=impl,
    )  # fmt: skip
    for i, (n, off) in enumerate(caps):
        want = prefix_state(q, k, v, g, beta, bounds[n], off, init[n] if n == 0 else None)
        assert rel_err(pool[2 + i], want) < TOL, (n, off)


# the Triton verify also over two value blocks (bv32 at V = 40): only the first block of a head
# writes the table's k and g
@pytest.mark.parametrize("impl, vd, variant", [("naive", 12, None), ("triton", 12, None), ("triton", 40, "bv32")])
@pytest.mark.parametrize("raw_gate", [False, True])
def test_verify_table_then_accept_gives_the_intermediate_state(nan_fill, impl, vd, variant, raw_gate):
    torch.manual_seed(1)
    rows, length = 3, 3
    q, k, v, g, beta = inputs(length, hk=1, hv=2, vd=vd, lead=(rows,))
    pool = torch.randn(6, 2, 8, vd, device=DEVICE)
    slots = torch.tensor([4, 0, 2], dtype=torch.int32, device=DEVICE)
    gates = dict(g=g, beta=beta)
    if raw_gate:
        a, b = torch.randn(rows, length, 2, device=DEVICE), torch.randn(rows, length, 2, device=DEVICE)
        A_log, dt_bias = torch.randn(2, device=DEVICE), torch.randn(2, device=DEVICE)
        gates = dict(a=a, b=b, A_log=A_log, dt_bias=dt_bias)
    fn = naive.fused_recurrent_gated_delta_rule
    if impl == "triton":
        fn = partial(recurrent_module.fused_recurrent_gated_delta_rule, variant=RECURRENT_VARIANTS.get(variant))
    # the reference: the naive recurrent's intermediate states (each token's state)
    inter = torch.empty(rows, length, 2, 8, vd, device=DEVICE)
    ref_out = naive.fused_recurrent_gated_delta_rule(
        q=q, k=k, v=v, state_pool=pool.clone(), state_slots=slots, intermediate_states_out=inter, **gates
    )
    table = VerifyTable.empty(rows, length, 2, 8, vd, DEVICE)
    before = pool.clone()
    out = fn(q=q, k=k, v=v, state_pool=pool, state_slots=slots, update_state=False, verify_table=table, **gates)
    assert torch.equal(pool, before)  # a verify leaves the slots alone
    assert rel_err(out, ref_out) < TOL
    last = torch.tensor([1, -1, 2], device=DEVICE)  # some, none, all of the verify's tokens accepted
    accept = gdn_state.accept_states_naive if impl == "naive" else gdn_state.accept_states
    accept(state_pool=pool, state_slots=slots, table=table, last_accepted=last)
    assert rel_err(pool[4], inter[0, 1]) < TOL
    assert torch.equal(pool[0], before[0])  # -1: nothing accepted, the slot keeps its state
    assert rel_err(pool[2], inter[2, 2]) < TOL
    untouched = [1, 3, 5]
    assert torch.equal(pool[untouched], before[untouched])


def test_conv_windows_at_offsets():
    torch.manual_seed(2)
    width, channels = 4, 6
    x = torch.randn(40, channels, device=DEVICE)
    lens = (30, 2, 8)
    pool = torch.randn(8, channels, width - 1, device=DEVICE)
    slots = torch.tensor([0, 1, 2], device=DEVICE)
    has_init = torch.tensor([True, True, False], device=DEVICE)
    old = pool.clone()
    caps = StateCaptures((StateCapture(0, 10, 3), StateCapture(0, 1, 4), StateCapture(1, 2, 5),
                          StateCapture(2, 2, 6), StateCapture(0, 0, 7)), lens)  # fmt: skip
    weight = torch.randn(channels, width, device=DEVICE)
    conv1d.causal_conv1d_varlen(
        x=x, weight=weight, bias=None, cu_seqlens=torch.tensor([0, 30, 32, 40], device=DEVICE),
        conv_state_pool=pool, state_slots=slots, has_initial_state=has_init, captures=caps,
    )  # fmt: skip

    def window(n, off):
        start = (0, 30, 32)[n]
        prev = old[n] if bool(has_init[n]) else torch.zeros(channels, width - 1, device=DEVICE)
        return torch.cat([prev, x[start : start + off].t()], dim=1)[:, -(width - 1) :]

    for c in caps.items:
        assert torch.equal(pool[c.slot], window(c.seq, c.offset)), c


def test_fixed_capture_windows_kernel_matches_the_torch_path(device):
    """triton_conv1d.capture_windows (one launch) against FixedCaptures.conv_windows (torch ops), bit for
    bit: windows inside a stream, ones reaching into the slot's old window (with and without initial
    state), at a stream's first token, and the unused entries (the scratch slot only); strided x rows
    and channels over two programs."""
    from deltaserve.layers.kernels.conv1d.triton_conv1d import capture_windows
    from deltaserve.layers.kernels.gdn.fixed_captures import NUM_FIELDS, FixedCaptures

    g = torch.Generator().manual_seed(4)
    w1, channels, lens = 3, 300, (30, 2, 8)
    x = torch.randn(40, channels + 5, generator=g).to(device)[:, :channels]
    slots = torch.tensor([0, 1, 2, 9], device=device, dtype=torch.int32)  # the idle stream on scratch 9
    has_init = torch.tensor([True, True, False, False], device=device)
    pool = torch.randn(10, channels, w1, generator=g).to(device)
    caps = StateCaptures((StateCapture(0, 10, 3), StateCapture(0, 1, 4), StateCapture(1, 2, 5),
                          StateCapture(2, 2, 6), StateCapture(0, 0, 7)), lens + (0,))  # fmt: skip
    fields, chunk_slots = np.zeros((NUM_FIELDS, 8), np.int64), np.zeros(8, np.int64)
    assert FixedCaptures.stage(fields, chunk_slots, caps, scratch_slot=9, idle_seq=3)
    fixed = FixedCaptures(torch.from_numpy(chunk_slots).to(device), torch.from_numpy(fields).to(device))
    want = pool.clone()
    fixed.conv_windows(x, want, slots, has_init)
    got = pool.clone()
    capture_windows(x=x, conv_state_pool=got, state_slots=slots, has_initial_state=has_init, **fixed.window_fields())
    assert torch.equal(got[:9], want[:9])
    assert not torch.equal(want[3:8], pool[3:8])  # the captures' slots were written


def test_eager_capture_windows_kernel_matches_the_torch_path(device):
    """An eager pass's captures (StateCaptures, their entries uploaded once with the pass's plan)
    through triton_conv1d.capture_windows, as the CUDA path takes them, bit for bit against
    conv_windows_at's torch ops: inside a stream, reaching into the slot's old window with and without
    initial state, at a stream's first token."""
    from deltaserve.layers.kernels.conv1d.triton_conv1d import capture_windows

    g = torch.Generator().manual_seed(7)
    w1, channels, lens = 3, 300, (30, 2, 8)
    x = torch.randn(40, channels + 5, generator=g).to(device)[:, :channels]
    slots = torch.tensor([0, 1, 2], device=device, dtype=torch.int32)
    has_init = torch.tensor([True, True, False], device=device)
    pool = torch.randn(8, channels, w1, generator=g).to(device)
    caps = StateCaptures((StateCapture(0, 10, 3), StateCapture(0, 1, 4), StateCapture(1, 2, 5),
                          StateCapture(2, 2, 6), StateCapture(0, 0, 7)), lens)  # fmt: skip
    want = pool.clone()
    gdn_state.conv_windows_at(x=x, conv_state_pool=want, state_slots=slots, has_initial_state=has_init, captures=caps)
    got = pool.clone()
    fields = caps.prepared(64, torch.device(device)).window_fields()
    capture_windows(x=x, conv_state_pool=got, state_slots=slots, has_initial_state=has_init, **fields)
    assert torch.equal(got, want) and not torch.equal(want[3:8], pool[3:8])


@pytest.mark.parametrize("impl", ["op", "naive", "triton"])
@pytest.mark.parametrize(("length", "w1"), [(4, 3), (2, 3), (5, 1)])
def test_conv_accept_picks_the_window_after_the_last_accepted_input(impl, length, w1):
    """Each slot becomes the last W - 1 of (its window, the verify's inputs up to the last accepted
    one); -1 keeps the window; other slots untouched. The Triton kernel runs interpreted on CPU
    tensors; x a strided view (rows of a longer buffer), the slots int32 as the plans give them."""
    from deltaserve.layers.kernels.gdn import accept

    fn = {"op": gdn_state.conv_accept, "naive": gdn_state.conv_accept_naive, "triton": accept.conv_accept}[impl]
    device = DEVICE if impl != "naive" else torch.device("cpu")
    torch.manual_seed(3)
    rows, channels = 3, 300  # channels over one Triton block
    x = torch.randn(rows, length + 1, channels, device=device).to(torch.bfloat16)[:, 1:]
    pool = torch.randn(5, channels, w1, device=device).to(torch.bfloat16)
    before = pool.clone()
    slots = torch.tensor([3, 0, 1], dtype=torch.int32, device=device)
    last = torch.tensor([0, -1, length - 1], device=device)
    fn(conv_state_pool=pool, state_slots=slots, x=x, last_accepted=last)
    for n in range(rows):
        seq = torch.cat([before[int(slots[n])], x[n, : int(last[n]) + 1].t()], dim=1)
        assert torch.equal(pool[int(slots[n])], seq[:, -w1:])
    for s in (2, 4):
        assert torch.equal(pool[s], before[s])


def test_captures_validate_offsets():
    with pytest.raises(ValueError, match="offset"):
        StateCaptures((StateCapture(0, 9, 1),), (8,))
    with pytest.raises(ValueError, match="sequence"):
        StateCaptures((StateCapture(2, 0, 1),), (8, 3))
    with pytest.raises(ValueError, match="slots must be distinct"):
        StateCaptures((StateCapture(0, 4, 1), StateCapture(1, 2, 1)), (8, 3))


@pytest.mark.parametrize("impl", ["accept_all", "triton_layers"])
def test_write_on_accept_of_every_layer_at_once(impl):
    """A VerifyStack over 3 layers' pools: every layer's recurrent state and conv window become what
    the per-layer reference gives (rows past the verified ones and other slots untouched); the
    Triton layered kernels run interpreted on CPU tensors (compiled on the GPU)."""
    from deltaserve.layers.kernels.gdn import accept

    device = DEVICE if impl == "triton_layers" else "cpu"
    g = torch.Generator().manual_seed(7)
    layers, slots_n, hv, kd, vd, channels, w1, rows, length = 3, 6, 2, 8, 12, 20, 3, 4, 4
    recurrent = torch.randn(layers, slots_n, hv, kd, vd, generator=g).to(device)
    conv = torch.randn(layers, slots_n, channels, w1, generator=g).to(device)
    stack = gdn_state.VerifyStack.empty(recurrent, conv, rows, length)
    for t in (stack.table.k, stack.table.delta, stack.conv_inputs):
        t.copy_(torch.randn(t.shape, generator=g) * 0.3)
    stack.table.g.copy_(-torch.rand(stack.table.g.shape, generator=g))
    slots = torch.tensor([4, 1, 5], dtype=torch.int32, device=device)  # 3 of the 4 rows verified
    last = torch.tensor([0, -1, 3], device=device)
    want_rec, want_conv = recurrent.clone(), conv.clone()
    for i in range(layers):
        layer = stack.layer(i)
        table = VerifyTable(layer["verify"].k[:3], layer["verify"].delta[:3], layer["verify"].g[:3])
        gdn_state.accept_states_naive(state_pool=want_rec[i], state_slots=slots, table=table, last_accepted=last)
        gdn_state.conv_accept_naive(
            conv_state_pool=want_conv[i], state_slots=slots, x=layer["verify_conv_inputs"][:3], last_accepted=last
        )
    if impl == "accept_all":
        gdn_state.accept_all(stack=stack, state_slots=slots, last_accepted=last)
    else:
        t = stack.table
        table = VerifyTable(t.k[:, :3], t.delta[:, :3], t.g[:, :3])
        accept.accept_states_layers(state_pools=recurrent, state_slots=slots, table=table, last_accepted=last)
        accept.conv_accept_layers(
            conv_state_pools=conv, state_slots=slots, x=stack.conv_inputs[:, :3], last_accepted=last
        )
    assert torch.allclose(recurrent, want_rec, atol=1e-5, rtol=1e-5)
    assert torch.equal(conv, want_conv)


@pytest.mark.parametrize("from_seq", [False, True])
def test_slot_copies_skip_unused_entries(device, from_seq):
    """copy_state_slots (Triton) against the reference: used entries copy a whole slot (from a
    stream's slot, zeros where it has no initial state), unused ones touch nothing, even when they
    name a slot a used entry writes; the state spans several programs' tiles (and an odd tail)."""
    from deltaserve.layers.kernels.gdn import slot_copy

    g = torch.Generator().manual_seed(3)
    pool = torch.randn(7, 3, 41, 37, generator=g).to(device)  # 4,551 elements a slot: two tiles
    dst = torch.tensor([4, 6, 4, 5], device=device)
    used = torch.tensor([1, 1, 0, 0], device=device)
    if from_seq:
        src = torch.tensor([1, 0, 1, 2], device=device)
        slots = torch.tensor([2, 3, 0], device=device, dtype=torch.int32)
        keep = torch.tensor([True, False, True], device=device)
        kw = dict(src=src, slots=slots, keep=keep)
        want_rows = {4: torch.zeros_like(pool[0]), 6: pool[2].clone()}  # stream 1 (slot 3) has no initial state
    else:
        kw = dict(src=torch.tensor([1, 2, 3, 0], device=device))
        want_rows = {4: pool[1].clone(), 6: pool[2].clone()}
    want = pool.clone()
    for slot, row in want_rows.items():
        want[slot] = row
    ref = pool.clone()
    naive.copy_state_slots(pool=ref, dst=dst, used=used, **kw)
    got = pool.clone()
    slot_copy.copy_state_slots(pool=got, dst=dst, used=used, **kw)
    assert torch.equal(ref, want) and torch.equal(got, want)
