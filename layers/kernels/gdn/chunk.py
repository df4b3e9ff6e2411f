"""Chunked gated delta rule (varlen prefill) in Triton; same contract as naive.chunk_gated_delta_rule.

Per sequence, tokens are cut into chunks of BT = 64. With gamma the in-chunk cumulative sum of g,
A = strictly-lower(beta_i * k_i.k_j * exp(gamma_i - gamma_j)) (l2-normalised keys) and
Y = (I + A)^-1 (the WY / UT transform of the chunk):

1. `_solve_kernel` (chunk_prepare.py), one 1-warp program per (chunk, value head): cumsum of g and the key norms
   (both stored), A in 16 x 16 blocks from raw k k^T, the four diagonal blocks of Y by forward
   substitution, the six below them by block merges; Y stored in the input dtype.
2. `_intra_kernel` (chunk_prepare.py), per (chunk, value head), whole-chunk matmuls: w = Y (beta exp(gamma) k),
   u = Y (beta v), and what the sequential kernel of the chosen design needs besides.
3. The sequential part (chunk_state.py), one program per (sequence, value head, V-block) walking the sequence's
   chunks with the float32 state S in registers; it reads the initial state from the pool slot and
   writes the final one back. Two designs (ChunkVariant.split):
   - fused, `_state_kernel`: per chunk v_new = u - w S, o = qscale (q S) + scores v_new,
     S = exp(gamma_last) S + kd^T v_new, with kd = k exp(gamma_last - gamma) and the masked, decayed
     q k^T (scores) and the q factor (qscale) from the intra kernel. Four dependent matmuls a chunk.
   - split, `_recur_kernel` then `_output_kernel`: the sequential kernel keeps only the recurrence
     (v_new = u - w S stored over u, S = exp(gamma_last) S + k^T (kscale v_new), two matmuls a
     chunk) and stores the state entering each chunk (h, input dtype); the output kernel, parallel
     over (chunk, value head), computes o = qscale (q h) + scores v_new.
   Each chunk's tiles are software-pipelined (num_stages); the small per-chunk vectors are fetched
   a chunk ahead by hand, since the pipeliner leaves them as plain loads in the middle of the chain.

Matmuls take the inputs' dtype (bf16) with float32 accumulation; the 16 x 16 solve merges run in
tf32. Varlen chunks are located inside the kernels (varlen.py), so there is no host sync unless
chunk_states_out is asked for. pick_variant chooses the design when the caller names none;
bench/kernels_gdn.py times others. NOTES.md has the resources and the measurements.
"""

from __future__ import annotations

import dataclasses

import torch
import triton

from ..device import DeviceInfo, device_info, side_stream, stages_that_fit
from ..norm.triton_norm import gated_rms_norm
from .advance import advance_within_chunks
from .chunk_prepare import _intra_kernel, _solve_kernel
from .chunk_state import _output_kernel, _recur_kernel, _state_kernel
from .fixed_captures import FixedCaptures
from .slot_copy import copy_state_slots
from .state import StateCaptures

CHUNK = 64  # tokens per chunk (BT)
SUB = 16  # rows per block of the triangular solve (BC); CHUNK == 4 * SUB
BLOCK_N = 64  # sequences scanned per step when locating chunks


def _contiguous_last(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


@dataclasses.dataclass(frozen=True)
class ChunkVariant:
    """How the sequential part runs; `chunk_gated_delta_rule(variant=...)` takes one of these or a name
    from VARIANTS (those pick_variant chooses); bench/kernels_gdn.py times others
    beside them.

    split: True for _recur_kernel + _output_kernel, False for the fused _state_kernel.
    block_v: V columns per sequential program; 0 picks 64, halved to 32 while the grid has fewer
        programs than the GPU has SMs.
    num_warps: of the sequential kernel; 0 picks 4 at block_v 32 and 8 above (the fused kernel's
        [K, 64] tiles spill at 4 warps once its loads are pipelined).
    num_stages: depth of the software pipeline of the sequential kernel's per-chunk tile loads; the
        wrapper lowers it until the tiles fit in shared memory.
    prefetch: fused only; fetch the chunk's qscale and decay one chunk ahead.
    out_block_v, out_warps: split only; the output kernel's V block and warps.
    solve_warps, intra_warps: the per-chunk solve kernel's and matmul kernel's warps (more solve warps
        replicate its 16 x 16 tiles rather than split them: slower on the H100, gdn/NOTES.md).
    solve_stages: the solve's first key loop and forward-substitution loop pipelined this deep (their
        key blocks and rows of -A loaded ahead, cp.async); 1: each loaded in its own step.
    windows: split only; the pass's chunks cut into up to this many windows (of at least
        WINDOW_MIN_CHUNKS), each walked by a launch of its own on a second, high-priority stream while
        the caller's stream prepares the windows ahead (solve, matmuls) and computes the outputs of
        those behind: the latency-bound walk, one program an SM, then shares the GPU with the parallel
        kernels instead of leaving it idle. 1: one walk, the kernels one after another; 0: as many as
        the pass's size asks (window_count).
    """

    split: bool = True
    block_v: int = 0
    num_warps: int = 0
    num_stages: int = 3
    prefetch: bool = True
    out_block_v: int = 64
    out_warps: int = 4
    solve_warps: int = 1
    solve_stages: int = 1
    intra_warps: int = 8
    windows: int = 1


VARIANTS = {
    # short sequences: four matmuls a chunk, the per-chunk vectors loaded in the chain
    "fused": ChunkVariant(split=False, num_warps=4, num_stages=2, prefetch=False),
    # its loads pipelined (many sequences)
    "fused_pf": ChunkVariant(split=False, num_stages=3, prefetch=True),
    # the split design (few, long sequences)
    "split32": ChunkVariant(split=True, block_v=32, num_warps=4),
    # the same over chunk windows by the pass's size, the walk beside the parallel kernels (long passes)
    "split32_win": ChunkVariant(split=True, block_v=32, num_warps=4, windows=0),
}

# From CUDA graphs on the H200 (0a1f871, `bench kernels --only gdn --match "gdn_chunk[graph]"`), one
# sequence, us a call: split32 against fused 50 / 54 at T=512, 80 / 104 at 1k, 134 / 188 at 2k, and
# 0.51 against 0.64 ms at 8k (eager): split32 from this many tokens a sequence when its sequential grid
# fits one wave.
SPLIT_MIN_TOKENS_PER_SEQ = 512
# Many sequences (more than a wave): up to this many tokens a sequence "fused", above it "fused_pf".
FUSED_MAX_TOKENS_PER_SEQ = 2048
# ChunkVariant.windows: no window shorter than WINDOW_MIN_CHUNKS chunks; by size (windows 0) about
# WINDOW_CHUNKS a window, at least two from 2 * WINDOW_MIN_CHUNKS, at most WINDOW_MAX. On an H100 (the op
# at the 35B shape, one sequence, gdn/NOTES.md) against one walk: 8k 2 windows of 64 chunks 537 us
# against 558 (4 of 32: 632); 16k 2 of 128 1,053 against 1,122 (4 of 64: 1,069); 32k 4 of 128 2,097
# against 2,397 (8 of 64: 2,133); 64k 8 of 128 4,169 against 4,896 (4 of 256: 4,242).
WINDOW_MIN_CHUNKS = 64
WINDOW_CHUNKS = 128
WINDOW_MAX = 8


def pick_variant(num_seqs: int, num_v_heads: int, value_dim: int, num_sms: int, num_tokens: int | None = None) -> str:
    """The variant used when none is named. The split design shortens the per-chunk dependency chain
    (two matmuls instead of four) at the cost of an h round trip; it pays when the sequential grid is
    latency-bound (about one wave of programs: few sequences of 512 tokens or more). With many
    sequences the sequential kernel is throughput-bound and the fused design moves fewer bytes; short
    sequences keep the original fused kernel. A long split pass's walk runs in windows beside the
    parallel kernels (ChunkVariant.windows)."""
    per_seq = None if num_tokens is None else num_tokens / max(1, num_seqs)
    one_wave = num_seqs * num_v_heads * triton.cdiv(value_dim, 64) <= num_sms
    if one_wave and (per_seq is None or per_seq >= SPLIT_MIN_TOKENS_PER_SEQ):
        return "split32_win"  # split32 itself under 128 chunks or for several sequences (window_count)
    if per_seq is not None and per_seq <= FUSED_MAX_TOKENS_PER_SEQ:
        return "fused"
    return "fused_pf"


def _resolve_variant(variant, num_seqs: int, num_v_heads: int, value_dim: int, info: DeviceInfo, num_tokens: int):
    if variant is None:
        variant = pick_variant(num_seqs, num_v_heads, value_dim, info.num_sms, num_tokens)
    if isinstance(variant, str):
        variant = VARIANTS[variant]
    return variant


def chunk_gated_delta_rule(
    *, q, k, v, g, beta, cu_seqlens, state_pool, state_slots, has_initial_state, scale=None, use_qk_l2norm=True,
    chunk_size=CHUNK, chunk_states_out=None, variant=None, captures: StateCaptures | FixedCaptures | None = None,
    norm_gate=None, norm_weight=None, norm_eps=1e-6,
) -> torch.Tensor:  # fmt: skip
    """gdn.chunk_gated_delta_rule (chunks of 64 only). variant: a VARIANTS name or a ChunkVariant;
    None: pick_variant's. captures: the sequential kernel stores the state after the chunks they name
    (one int per chunk); a capture inside a chunk is that chunk's first tokens replayed on the
    kernels' own intermediates (advance.py; state.py; FixedCaptures: the same from device tensors,
    fixed_captures.py); no host sync. norm_gate / norm_weight: the GDN output norm too, inside the
    split design's output kernel (the fused designs run the norm kernel after)."""
    if chunk_size != CHUNK:
        raise ValueError(f"chunk_size must be {CHUNK}, got {chunk_size}")
    q, k, v = _contiguous_last(q), _contiguous_last(k), _contiguous_last(v)
    num_tokens, num_k_heads, key_dim = q.shape
    num_v_heads, value_dim = v.shape[1], v.shape[2]
    if state_pool.stride()[1:] != (key_dim * value_dim, value_dim, 1):
        raise ValueError("state_pool: each slot's [Hv, K, V] state must be contiguous")
    num_seqs = cu_seqlens.shape[0] - 1
    scale = key_dim**-0.5 if scale is None else scale
    device, dt = v.device, k.dtype
    info = device_info(device)
    cfg = _resolve_variant(variant, num_seqs, num_v_heads, value_dim, info, num_tokens)
    out = torch.empty((num_tokens, num_v_heads, value_dim), dtype=v.dtype, device=device)
    max_chunks = num_tokens // CHUNK + num_seqs
    # scratch, in few allocations: per (token, value head) float32 vectors, then matmul-dtype tiles.
    # qscale holds kscale in the split design
    gcum, rnorm, qscale = torch.empty((3, num_tokens, num_v_heads), dtype=torch.float32, device=device).unbind(0)
    a_scratch = torch.empty((num_tokens, num_v_heads, SUB), dtype=torch.float32, device=device)
    if cfg.split:
        y = torch.empty((num_tokens, num_v_heads, CHUNK), dtype=dt, device=device)
        w = torch.empty((num_tokens, num_v_heads, key_dim), dtype=dt, device=device)
        kd, scores = w, y  # unused
        # the state entering each chunk, for the output kernel
        h = torch.empty((max_chunks, num_v_heads, key_dim, value_dim), dtype=dt, device=device)
    else:
        y, scores = torch.empty((2, num_tokens, num_v_heads, CHUNK), dtype=dt, device=device).unbind(0)
        w, kd = torch.empty((2, num_tokens, num_v_heads, key_dim), dtype=dt, device=device).unbind(0)
    u = torch.empty((num_tokens, num_v_heads, value_dim), dtype=dt, device=device)
    chunk_states = None
    if chunk_states_out is not None:
        chunk_states = torch.empty((max_chunks, num_v_heads, key_dim, value_dim), dtype=torch.float32, device=device)
    if norm_gate is not None:
        assert norm_gate.shape == out.shape and norm_gate.stride(-1) == 1 and norm_weight is not None, "norm_gate"
    if num_seqs == 0:
        return out
    prepared = capture_arg = None
    on_device = captures if isinstance(captures, FixedCaptures) else None
    if on_device is not None:
        on_device.store_initial(state_pool, state_slots, has_initial_state, copy_state_slots)
        capture_arg = on_device.chunk_slots
    elif captures is not None and captures.items:
        prepared = captures.prepared(CHUNK, device)
        _store_initial_states(prepared.plan.initial_stores, state_pool, state_slots, has_initial_state)
        capture_arg = prepared.chunk_slots

    group = num_v_heads // num_k_heads
    bk = max(16, triton.next_power_of_2(key_dim))
    bv_all = max(16, triton.next_power_of_2(value_dim))

    def prepare(lo: int, hi: int) -> None:  # the solve and the whole-chunk matmuls of global chunks [lo, hi)
        _solve_kernel[(hi - lo, num_v_heads)](
            k, g, beta, cu_seqlens, gcum, rnorm, a_scratch, y, num_seqs, lo,
            k.stride(0), k.stride(1), g.stride(0), g.stride(1), beta.stride(0), beta.stride(1),
            HV=num_v_heads, GROUP=group, K=key_dim, BKP=min(32, bk), BT=CHUNK, BC=SUB, BLOCK_N=BLOCK_N,
            L2NORM=use_qk_l2norm, PRECISION="ieee" if dt == torch.float32 else "tf32", SUB_STAGES=cfg.solve_stages,
            num_warps=cfg.solve_warps, num_stages=1,
        )  # fmt: skip
        _intra_kernel[(hi - lo, num_v_heads)](
            q, k, v, beta, cu_seqlens, gcum, rnorm, y, w, u, kd, scores, qscale, num_seqs, lo, scale,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), beta.stride(0),
            beta.stride(1), HV=num_v_heads, GROUP=group, K=key_dim, V=value_dim, BKP=min(64, bk),
            BVP=min(64, bv_all), BT=CHUNK, BC=SUB, BLOCK_N=BLOCK_N, L2NORM=use_qk_l2norm, FUSED=not cfg.split,
            num_warps=cfg.intra_warps, num_stages=2,
        )  # fmt: skip

    bv = min(cfg.block_v or 64, bv_all)
    if not cfg.block_v:  # narrower V-blocks when there are too few (sequence, head) pairs to fill the GPU
        while bv > 32 and num_seqs * num_v_heads * triton.cdiv(value_dim, bv) < info.num_sms:
            bv //= 2
    seq_warps = cfg.num_warps or (4 if bv <= 32 else 8)
    seq_grid = (triton.cdiv(value_dim, bv) * num_seqs * num_v_heads,)
    cs_arg = w if chunk_states is None else chunk_states
    cap_arg = cu_seqlens if capture_arg is None else capture_arg  # never read without captures
    # shared memory of the sequential loop (estimates above what sm_90 builds allocate): per stage its
    # tiles (split: w, k, u; fused: w, q, kd, scores, u), besides the state and v_new matmul operands
    esize = w.element_size()
    fixed = esize * (bk + CHUNK) * bv + 8192
    per_stage = esize * CHUNK * ((2 if cfg.split else 3) * bk + bv + (0 if cfg.split else CHUNK))
    stages = stages_that_fit(cfg.num_stages, per_stage, fixed, info)
    gated = norm_gate is not None
    z = norm_gate if gated else out

    def walk(lo: int, hi: int) -> None:  # the split design's recurrence over global chunks [lo, hi)
        _recur_kernel[seq_grid](
            k, w, u, qscale, gcum, h, cs_arg, cap_arg, state_pool, cu_seqlens, state_slots, has_initial_state,
            num_seqs, lo, hi, k.stride(0), k.stride(1), state_pool.stride(0),
            HV=num_v_heads, GROUP=group, K=key_dim, V=value_dim, BK=bk, BV=bv, BT=CHUNK, BLOCK_N=BLOCK_N,
            STORE_CHUNK_STATES=chunk_states is not None, STORE_CAPTURE=capture_arg is not None,
            num_warps=seq_warps, num_stages=stages,
        )  # fmt: skip

    def output(lo: int, hi: int) -> None:
        _output_kernel[(hi - lo, num_v_heads)](
            q, k, gcum, rnorm, h, u, out, z, norm_weight if gated else out, cu_seqlens, num_seqs, lo, scale, norm_eps,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), z.stride(0), z.stride(1),
            HV=num_v_heads, GROUP=group, K=key_dim, V=value_dim, BK=bk, BV=min(cfg.out_block_v, bv_all), BT=CHUNK,
            BLOCK_N=BLOCK_N, L2NORM=use_qk_l2norm, GATED=gated,
            num_warps=cfg.out_warps, num_stages=2,
        )  # fmt: skip

    if cfg.split:
        _run_windows(chunk_windows(max_chunks, cfg.windows, num_seqs), prepare, walk, output, device)
    else:
        prepare(0, max_chunks)
        _state_kernel[seq_grid](
            q, w, u, kd, scores, qscale, gcum, out, cs_arg, cap_arg, state_pool,
            cu_seqlens, state_slots, has_initial_state, num_seqs, q.stride(0), q.stride(1), state_pool.stride(0),
            HV=num_v_heads, GROUP=group, K=key_dim, V=value_dim, BK=bk, BV=bv, BT=CHUNK, BLOCK_N=BLOCK_N,
            STORE_CHUNK_STATES=chunk_states is not None, PREFETCH=cfg.prefetch, STORE_CAPTURE=capture_arg is not None,
            num_warps=seq_warps, num_stages=stages,
        )  # fmt: skip

    replays = None
    if on_device is not None:
        on_device.copies(state_pool, copy_state_slots)
        replays = on_device.replay_fields()
    elif prepared is not None:
        for src, dst in prepared.plan.copies:
            state_pool[dst] = state_pool[src]
        if prepared.plan.replays:
            replays = dict(first=prepared.replay_first, count=prepared.replay_count, slots=prepared.replay_slots)
    if replays is not None:  # after the copies: each replay starts from the boundary state on its slot
        advance_within_chunks(
            k=k, w=w, u=u, gcum=gcum, rnorm=rnorm, state_pool=state_pool, v_new=cfg.split, l2norm=use_qk_l2norm,
            chunk=CHUNK, **replays,
        )  # fmt: skip
    if chunk_states_out is not None:
        counts = ((cu_seqlens[1:] - cu_seqlens[:-1] + CHUNK - 1) // CHUNK).tolist()
        start = 0
        for count in counts:
            chunk_states_out.append(chunk_states[start : start + count])
            start += count
    if norm_gate is not None and not cfg.split:  # the fused designs: the norm kernel (split: in _output_kernel)
        out = gated_rms_norm(x=out, gate=norm_gate, weight=norm_weight, eps=norm_eps, pdl=False)
    return out


def _store_initial_states(stores, state_pool, state_slots, has_initial_state) -> None:
    """Captures at a sequence's first token: its initial state (the slot's, or zeros), copied before
    the kernels overwrite the slot. Device ops only."""
    for seq, dst in stores:
        src = state_pool[state_slots[seq].long()]
        state_pool[dst] = torch.where(has_initial_state[seq].bool(), src, torch.zeros_like(src))


def window_count(max_chunks: int, windows: int, num_seqs: int = 1) -> int:
    """How many chunk windows a pass of max_chunks global chunks takes: at most `windows` (0: by size,
    about WINDOW_CHUNKS a window, two from 2 * WINDOW_MIN_CHUNKS, at most WINDOW_MAX; one for several
    sequences, whose walks one launch runs side by side while windows of the global chunks would run
    them one after another), none shorter than WINDOW_MIN_CHUNKS (one window below that)."""
    if windows == 0:
        windows = 1 if num_seqs > 1 else min(WINDOW_MAX, max(2, max_chunks // WINDOW_CHUNKS))
    return max(1, min(windows, max_chunks // WINDOW_MIN_CHUNKS))


def chunk_windows(max_chunks: int, windows: int, num_seqs: int = 1) -> list[tuple[int, int]]:
    """[lo, hi) ranges of global chunk indices (varlen.py) covering [0, max_chunks) in window_count's
    number of near-equal parts."""
    count = window_count(max_chunks, windows, num_seqs)
    bounds = [max_chunks * i // count for i in range(count + 1)]
    return list(zip(bounds[:-1], bounds[1:], strict=True))


def _run_windows(windows: list[tuple[int, int]], prepare, walk, output, device: torch.device) -> None:
    """The split design over chunk windows. One window: prepare, walk, output in turn. Several (CUDA):
    every window's preparation on the caller's stream, then each window's output after its walk; the
    walks on a high-priority stream, each after its window's preparation (walk i beside the
    preparations after it and the outputs before it). Off CUDA (the interpreter) window by window, so
    that a kernel reading past its window reads what is not computed yet (NaN in the tests)."""
    if len(windows) == 1 or device.type != "cuda":
        for lo, hi in windows:
            prepare(lo, hi)
            walk(lo, hi)
            output(lo, hi)
        return
    main = torch.cuda.current_stream(device)
    walks = side_stream(device, "gdn_walks")  # the walks take the SMs freed first
    walks.wait_stream(main)  # the inputs, and the slots' initial states
    prepared = []
    for lo, hi in windows:
        prepare(lo, hi)
        prepared.append(main.record_event())
    walked = []
    with torch.cuda.stream(walks):
        for (lo, hi), event in zip(windows, prepared, strict=True):
            walks.wait_event(event)
            walk(lo, hi)
            walked.append(walks.record_event())
    for (lo, hi), event in zip(windows, walked, strict=True):
        main.wait_event(event)  # the last one joins the walk stream
        output(lo, hi)
