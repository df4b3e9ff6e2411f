"""Gated delta rule kernel cases at Qwen3.5-35B-A3B shapes (16 key heads, 32 value heads, K = V = 128,
bf16 q/k/v, float32 g/beta/state): chunked prefill of one sequence and recurrent decode, with fla as
the peer when it is importable (q and k handed to it already expanded to the value heads).

Every kernel variant (CHUNK_VARIANTS: chunk.VARIANTS, the ones its picker chooses, and the others
compared with them; RECURRENT_VARIANTS; "fused" and "bv32" are the designs measured first) is a row
of its own, checked against the reference, so that one run times old and new side by side; the row
marked default= is the wrapper's own pick. DELTASERVE_GDN_VARIANTS=name,name,... limits the other
rows to those variants. Chunked prefill up to 2k tokens also runs from CUDA graphs of GRAPH_CALLS
calls (op gdn_chunk[graph], as prefill graphs run it; times per GRAPH_CALLS calls): eager calls of
~0.2 ms time the host's launches as well (on the H200 the same eager case gave 0.196 and 0.281 ms
in two runs of one session).

Gating (op gdn_gating: g = -exp(A_log) softplus(a + dt_bias), beta = sigmoid(b) from the strided
a / b columns of a bf16 in_proj output) and decode with raw gates (op gdn_decode_gates: the
recurrent kernel computing g / beta itself, against the torch gating ops + recurrent kernel it
replaces in the layer, and the fused gating kernel + recurrent kernel as the peer) are
microsecond kernels: each row captures GRAPH_CALLS back-to-back calls in one CUDA graph and times
its replay, so ours_ms / ref_ms / peer_ms there are per GRAPH_CALLS calls (the shape says so) and
bytes_moved counts all of them. So is the whole decode step between in_proj and out_proj (op
gdn_decode_step: decode.fused_gdn_decode, one launch, against the three unfused Triton kernels the
layer ran before, conv1d update + recurrent on raw gates + gated norm; the peer is the fused kernel
at block_v 64 instead of 32). Just those rows, per call:

    python -m deltaserve.bench.kernels_gdn [--json gates.json]

The chunked op kernel by kernel (torch profiler), variants side by side:

    python -m deltaserve.bench.kernels_gdn --breakdown 8192,32768 --variants split32,split32_ss6
"""

from __future__ import annotations

import argparse
import functools
import json
import sys

import torch
import torch.nn.functional as F

from deltaserve import envs
from deltaserve.bench.kernel_cases import Case
from deltaserve.layers.kernels.conv1d import triton_conv1d
from deltaserve.layers.kernels.device import num_sms
from deltaserve.layers.kernels.gdn import chunk as chunk_module
from deltaserve.layers.kernels.gdn import decode as decode_module
from deltaserve.layers.kernels.gdn import gating as gating_module
from deltaserve.layers.kernels.gdn import naive
from deltaserve.layers.kernels.gdn.chunk import CHUNK, ChunkVariant, chunk_gated_delta_rule
from deltaserve.layers.kernels.gdn.recurrent import DEFAULT_VARIANT, RecurrentVariant, fused_recurrent_gated_delta_rule
from deltaserve.layers.kernels.norm import triton_norm

HK, HV, K, V = 16, 32, 128, 128
CONV_WIDTH = 4
CONV_DIM = 2 * HK * K + HV * V  # the conv channels [q | k | v]
TOLERANCE = 2e-2  # bf16 operands against the float32 reference, relative to the reference's magnitude
GRAPH_CALLS = 20  # calls captured back to back in one CUDA graph by the gating / raw-gate rows
IN_PROJ_WIDTH = 2 * HK * K + 2 * HV * V + 2 * HV  # [q | k | v | z | b | a]


def _fla():
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_chunk
        from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule as fla_recurrent
    except Exception:  # fla is optional: carried to the GPU machine when wanted
        return None, None
    return fla_chunk, fla_recurrent


def _working_peer(peer):
    """The peer when one trial call succeeds (fla's signature has moved between releases), else None."""
    if peer is None:
        return None
    try:
        peer()
    except Exception as exc:  # report and time without it rather than fail the whole run
        print(f"fla peer disabled: {type(exc).__name__}: {exc}", file=sys.stderr)
        return None
    return peer


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """max |out - ref| over max(1, max |ref|); NaN counts as infinite."""
    if torch.isnan(out).any():
        return float("inf")
    return ((out.float() - ref.float()).abs().max() / ref.float().abs().max().clamp(min=1)).item()


def _inputs(num_tokens: int, lead: tuple[int, ...] = ()):
    """q, k, v as strided views of one [.., T, 2 Hk K + Hv V] bf16 tensor (the layer's layout), g, beta."""
    packed = torch.randn(*lead, num_tokens, 2 * HK * K + HV * V, device="cuda", dtype=torch.bfloat16)
    q = packed[..., : HK * K].unflatten(-1, (HK, K))
    k = packed[..., HK * K : 2 * HK * K].unflatten(-1, (HK, K))
    v = packed[..., 2 * HK * K :].unflatten(-1, (HV, V))
    g = F.logsigmoid(torch.randn(*lead, num_tokens, HV, device="cuda"))
    beta = torch.rand(*lead, num_tokens, HV, device="cuda")
    return q, k, v, g, beta


def _chunk_flops(num_tokens: int) -> int:
    """Matmul FLOPs of the chunked algorithm: k k^T, w, u; w S, kd^T v_new; q k^T, q S, scores v_new."""
    per_chunk = 2 * CHUNK * (3 * CHUNK * K + 2 * CHUNK * V + 3 * K * V)
    return per_chunk * HV * -(-num_tokens // CHUNK)


# the chunk kernel's designs: the picker's three, then the others measured against them (gdn/NOTES.md)
CHUNK_VARIANTS: dict[str, ChunkVariant] = {
    **chunk_module.VARIANTS,
    "fused64w8": ChunkVariant(split=False, block_v=64, num_warps=8, num_stages=3, prefetch=True),
    "split64": ChunkVariant(split=True, block_v=64, num_warps=4),
    "split64w8": ChunkVariant(split=True, block_v=64, num_warps=8),
    "split32_o128": ChunkVariant(split=True, block_v=32, num_warps=4, out_block_v=128, out_warps=8),
    # the parallel kernels' warps: the solve's substitution chains and the matmul kernel (split32 else)
    "split32_s2": ChunkVariant(split=True, block_v=32, num_warps=4, solve_warps=2),
    "split32_s4": ChunkVariant(split=True, block_v=32, num_warps=4, solve_warps=4),
    "split32_i4": ChunkVariant(split=True, block_v=32, num_warps=4, intra_warps=4),
    # the solve's key loop and substitution rows pipelined 3 / 6 deep (cp.async; sm_90: 254 / 181 registers)
    "split32_ss3": ChunkVariant(split=True, block_v=32, num_warps=4, solve_stages=3),
    "split32_ss6": ChunkVariant(split=True, block_v=32, num_warps=4, solve_stages=6),
    # over 2 / 4 / 8 chunk windows of at least 64 chunks (split32_win in chunk.VARIANTS: as many as the
    # pass's size asks): each window's walk beside the parallel kernels of the others on a second stream
    "split32_w2": ChunkVariant(split=True, block_v=32, num_warps=4, windows=2),
    "split32_w4": ChunkVariant(split=True, block_v=32, num_warps=4, windows=4),
    "split32_w8": ChunkVariant(split=True, block_v=32, num_warps=4, windows=8),
}
# the recurrent kernel's: "bv32" is the first design (H200: 75% of copy bandwidth at N=64), "bv64_1p"
# the default (recurrent.DEFAULT_VARIANT)
RECURRENT_VARIANTS: dict[str, RecurrentVariant] = {
    "bv32": RecurrentVariant(block_v=32, num_warps=4, one_pass=False, row_strides=False),
    "bv32_1p": RecurrentVariant(block_v=32, num_warps=4),
    "bv32_1p_r64": RecurrentVariant(block_v=32, num_warps=4, maxnreg=64),
    "bv64_1p": DEFAULT_VARIANT,
    "bv64w8_1p": RecurrentVariant(block_v=64, num_warps=8),
    "bv64w8_1p_r64": RecurrentVariant(block_v=64, num_warps=8, maxnreg=64),
    "bv128w8_1p": RecurrentVariant(block_v=128, num_warps=8),
}
DEFAULT_RECURRENT = next(name for name, v in RECURRENT_VARIANTS.items() if v == DEFAULT_VARIANT)


def _selected(names: list[str]) -> list[str]:
    """The variant names to time: all of them, or those DELTASERVE_GDN_VARIANTS names."""
    wanted = envs.read("DELTASERVE_GDN_VARIANTS")
    if not wanted:
        return names
    return [n for n in names if n in wanted.split(",")]


def _label(variant: str | None, default: str) -> str:
    return f"default={default}" if variant is None else variant


def _chunk_cases(num_tokens: int, fla_chunk) -> list[Case]:
    q, k, v, g, beta = _inputs(num_tokens)
    cu_seqlens = torch.tensor([0, num_tokens], dtype=torch.int32, device="cuda")
    pool = torch.randn(4, HV, K, V, device="cuda") * 0.1
    slots = torch.tensor([2], dtype=torch.int32, device="cuda")
    has_init = torch.tensor([True], device="cuda")
    kwargs = dict(q=q, k=k, v=v, g=g, beta=beta, cu_seqlens=cu_seqlens, state_slots=slots, has_initial_state=has_init)
    work_pool = pool.clone()
    reference_result = []  # (o, pool) of the reference, computed once for all variants

    def check(variant) -> float:
        if not reference_result:
            ref_pool = pool.clone()
            reference_result.append((naive.chunk_gated_delta_rule(state_pool=ref_pool, **kwargs), ref_pool))
        ref, ref_pool = reference_result[0]
        ours_pool = pool.clone()
        out = chunk_gated_delta_rule(state_pool=ours_pool, variant=CHUNK_VARIANTS.get(variant), **kwargs)
        return max(_rel_err(out, ref), _rel_err(ours_pool, ref_pool))

    peer = None
    if fla_chunk is not None:
        fq, fk = (t.repeat_interleave(HV // HK, dim=1).unsqueeze(0).contiguous() for t in (q, k))
        fv, fg, fb = v.unsqueeze(0).contiguous(), g.unsqueeze(0), beta.unsqueeze(0)
        h0 = pool[2:3].clone()

        def peer():
            return fla_chunk(
                fq, fk, fv, fg, fb, initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True,
                cu_seqlens=cu_seqlens.long(),
            )  # fmt: skip

    def reference():
        return naive.chunk_gated_delta_rule(state_pool=work_pool, **kwargs)

    io_bytes = num_tokens * (2 * HK * K * 2 + 2 * HV * V * 2 + 2 * HV * 4) + 2 * HV * K * V * 4
    peer = _working_peer(peer)
    default = chunk_module.pick_variant(1, HV, V, num_sms(torch.device("cuda")), num_tokens)
    cases = []
    for i, variant in enumerate([None, *_selected(list(CHUNK_VARIANTS))]):
        cases.append(
            Case(
                op="gdn_chunk",
                shape=f"T={num_tokens} Hk={HK} Hv={HV} K=V={K} {_label(variant, default)}",
                ours=lambda variant=variant: chunk_gated_delta_rule(
                    state_pool=work_pool, variant=CHUNK_VARIANTS.get(variant), **kwargs
                ),
                # the per-chunk torch loop is too slow beyond 2048 tokens; timed once per shape
                reference=reference if num_tokens <= 2048 and i == 0 else None,
                reference_label="naive torch",
                check=lambda variant=variant: check(variant),
                tolerance=TOLERANCE,
                bytes_moved=io_bytes,
                flops=_chunk_flops(num_tokens),
                peer=peer,
                peer_label="fla",
                target="faster than fla at T=2048/8192/32768, aiming at 1.5x",
            )
        )
    if num_tokens <= GRAPHED_CHUNK_MAX_TOKENS:  # short calls: eager timing would time the host's launches
        for variant in GRAPHED_CHUNK_VARIANTS:
            cfg = CHUNK_VARIANTS[variant]
            fn = functools.partial(chunk_gated_delta_rule, state_pool=work_pool, variant=cfg, **kwargs)
            cases.append(
                Case(
                    op="gdn_chunk[graph]",
                    shape=f"T={num_tokens} Hk={HK} Hv={HV} K=V={K} {variant} x{GRAPH_CALLS} calls",
                    ours=_graphed(fn),
                    reference=None,
                    reference_label="",
                    check=lambda variant=variant: check(variant),
                    tolerance=TOLERANCE,
                    bytes_moved=GRAPH_CALLS * io_bytes,
                    flops=GRAPH_CALLS * _chunk_flops(num_tokens),
                )
            )
    return cases


# the chunk kernel at prompt sizes up to 2k from CUDA graphs (as prefill graphs run it), to place
# chunk.SPLIT_MIN_TOKENS_PER_SEQ: eager calls of ~0.2 ms time the host as much as the kernels
GRAPHED_CHUNK_MAX_TOKENS = 2048
GRAPHED_CHUNK_VARIANTS = ("fused", "fused_pf", "split32", "split64", "split32_s2", "split32_s4", "split32_i4")


def _split_prefill_case(total: int = 16384, chunk: int = 2048) -> Case:
    """The seed's split SSM prefill, at the op: one prompt's GDN over all its tokens in one call
    (ours: the engine's way under the default token budget, `chunk`-token calls carrying the slot's
    state from one to the next; reference: the whole prompt at once). The same function: checked
    against each other."""
    q, k, v, g, beta = _inputs(total)
    pool = torch.randn(4, HV, K, V, device="cuda") * 0.1
    slots = torch.tensor([2], dtype=torch.int32, device="cuda")

    # the calls' device tensors made up front (made per call, their host-to-device copies would stall
    # the stream between calls, which the engine's passes never do)
    bounds = {step: [(s, min(total, s + step)) for s in range(0, total, step)] for step in (chunk, total)}
    cu = {(s, e): torch.tensor([0, e - s], dtype=torch.int32, device="cuda") for b in bounds.values() for s, e in b}
    has_init = torch.tensor([True], device="cuda")

    def run(state_pool, step):
        outs = []
        for start, end in bounds[step]:
            rows = slice(start, end)
            outs.append(
                chunk_gated_delta_rule(
                    q=q[rows],
                    k=k[rows],
                    v=v[rows],
                    g=g[rows],
                    beta=beta[rows],
                    cu_seqlens=cu[start, end],
                    state_pool=state_pool,
                    state_slots=slots,
                    has_initial_state=has_init,
                )  # fmt: skip
            )
        return torch.cat(outs)

    work = pool.clone()

    def check() -> float:
        split_pool, whole_pool = pool.clone(), pool.clone()
        split, whole = run(split_pool, chunk), run(whole_pool, total)
        return max(_rel_err(split, whole), _rel_err(split_pool, whole_pool))

    return Case(
        op="gdn_chunk_split",
        shape=f"T={total} as {-(-total // chunk)} calls of {chunk} (ours) vs one call (reference)",
        ours=lambda: run(work, chunk),
        reference=lambda: run(work, total),
        reference_label="whole prompt",
        check=check,
        tolerance=TOLERANCE,
        flops=_chunk_flops(total),
        target="issue 20: does GDN over the whole prompt (the split SSM prefill) pay?",
    )


def _recurrent_cases(num_seqs: int, fla_recurrent) -> list[Case]:
    q, k, v, g, beta = _inputs(1, lead=(num_seqs,))
    pool = torch.randn(num_seqs + 8, HV, K, V, device="cuda") * 0.1
    slots = torch.randperm(num_seqs + 8, device="cuda")[:num_seqs].to(torch.int32)
    kwargs = dict(q=q, k=k, v=v, g=g, beta=beta, state_slots=slots)
    work_pool = pool.clone()

    def check(variant) -> float:
        ours_pool, ref_pool = pool.clone(), pool.clone()
        out = fused_recurrent_gated_delta_rule(state_pool=ours_pool, variant=RECURRENT_VARIANTS.get(variant), **kwargs)
        ref = naive.fused_recurrent_gated_delta_rule(state_pool=ref_pool, **kwargs)
        return max(_rel_err(out, ref), _rel_err(ours_pool, ref_pool))

    peer = None
    if fla_recurrent is not None:
        fq, fk = (t.repeat_interleave(HV // HK, dim=2).contiguous() for t in (q, k))
        fv = v.contiguous()
        h0 = pool[slots.long()].contiguous()

        def peer():
            return fla_recurrent(
                fq, fk, fv, g, beta, initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True
            )

    state_bytes = 2 * num_seqs * HV * K * V * 4  # read and written once
    io_bytes = num_seqs * ((2 * HK * K + 2 * HV * V) * 2 + 2 * HV * 4)
    peer = _working_peer(peer)
    cases = []
    for i, variant in enumerate([None, *_selected(list(RECURRENT_VARIANTS))]):
        cases.append(
            Case(
                op="gdn_recurrent",
                shape=f"N={num_seqs} L=1 Hk={HK} Hv={HV} K=V={K} {_label(variant, DEFAULT_RECURRENT)}",
                ours=lambda variant=variant: fused_recurrent_gated_delta_rule(
                    state_pool=work_pool, variant=RECURRENT_VARIANTS.get(variant), **kwargs
                ),
                reference=(lambda: naive.fused_recurrent_gated_delta_rule(state_pool=work_pool, **kwargs))
                if i == 0
                else None,
                reference_label="naive torch",
                check=lambda variant=variant: check(variant),
                tolerance=TOLERANCE,
                bytes_moved=state_bytes + io_bytes,
                peer=peer,
                peer_label="fla",
                target=">= 80% of copy bandwidth at N=64/256",
            )
        )
    return cases


def _graphed(fn, calls: int = GRAPH_CALLS):
    """A callable replaying one CUDA graph of `calls` back-to-back fn() calls (captured at the first
    call, after a warm-up that compiles the kernels on a side stream)."""
    graph = []

    def replay():
        if not graph:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(3):
                    fn()
            torch.cuda.current_stream().wait_stream(side)
            captured = torch.cuda.CUDAGraph()
            with torch.cuda.graph(captured):
                for _ in range(calls):
                    fn()
            graph.append(captured)
        graph[0].replay()

    return replay


def _raw_gates(num_tokens: int, lead: tuple[int, ...] = ()):
    """a, b: [*lead, T, Hv] column views of a bf16 [*lead, T, in_proj width] tensor (the layer's
    layout), A_log, dt_bias: [Hv] bf16 (the model's dtype), with trained-like ranges."""
    proj = torch.randn(*lead, num_tokens, IN_PROJ_WIDTH, device="cuda", dtype=torch.bfloat16) * 4
    b, a = proj[..., -2 * HV : -HV], proj[..., -HV:]
    a_log = (torch.rand(HV, device="cuda") * 15 + 1).log().to(torch.bfloat16)  # A in [1, 16)
    dt_bias = torch.randn(HV, device="cuda").to(torch.bfloat16)
    return a, b, a_log, dt_bias


def _torch_gating(a, b, a_log, dt_bias):
    """The layer's former torch ops (8 kernels: casts, sigmoid, exp, neg, add, softplus, mul)."""
    beta = torch.sigmoid(b.float())
    g = -torch.exp(a_log.float()) * F.softplus(a.float() + dt_bias.float())
    return g, beta


def _gating_cases(num_tokens: int) -> list[Case]:
    a, b, a_log, dt_bias = _raw_gates(num_tokens)
    kwargs = dict(a=a, b=b, A_log=a_log, dt_bias=dt_bias)

    def check() -> float:
        g, beta = gating_module.gdn_gating(**kwargs)
        ref_g, ref_beta = naive.gdn_gating(**kwargs)
        return max(_rel_err(g, ref_g), _rel_err(beta, ref_beta))

    return [
        Case(
            op="gdn_gating",
            shape=f"T={num_tokens} Hv={HV} bf16 a,b [graph x{GRAPH_CALLS}]",
            ours=_graphed(lambda: gating_module.gdn_gating(**kwargs)),
            reference=_graphed(lambda: _torch_gating(a, b, a_log, dt_bias)),
            reference_label="torch ops",
            check=check,
            tolerance=1e-5,  # float32 math on both sides, relative to max |g|
            bytes_moved=GRAPH_CALLS * num_tokens * HV * (2 * 2 + 2 * 4),  # a, b in (bf16), g, beta out
            target="one launch: ~the cost of one torch elementwise op at T=1 (8 before)",
        )
    ]


def _decode_gate_cases(num_seqs: int) -> list[Case]:
    """The layer's decode step after the conv: gating + recurrent. Ours: the recurrent kernel on the
    raw a / b; reference: the former torch gating ops, then the recurrent kernel on g / beta; peer:
    the fused gating kernel, then the same."""
    q, k, v, _, _ = _inputs(1, lead=(num_seqs,))
    a, b, a_log, dt_bias = _raw_gates(1, lead=(num_seqs,))
    pool = torch.randn(num_seqs + 8, HV, K, V, device="cuda") * 0.1
    slots = torch.randperm(num_seqs + 8, device="cuda")[:num_seqs].to(torch.int32)
    raw = dict(a=a, b=b, A_log=a_log, dt_bias=dt_bias)
    qkv = dict(q=q, k=k, v=v, state_slots=slots)
    work_pool = pool.clone()

    def ours():
        return fused_recurrent_gated_delta_rule(state_pool=work_pool, **qkv, **raw)

    def torch_gates_then_recurrent():
        g, beta = _torch_gating(a, b, a_log, dt_bias)
        return fused_recurrent_gated_delta_rule(g=g, beta=beta, state_pool=work_pool, **qkv)

    def fused_gates_then_recurrent():
        g, beta = gating_module.gdn_gating(**raw)
        return fused_recurrent_gated_delta_rule(g=g, beta=beta, state_pool=work_pool, **qkv)

    def check() -> float:
        ours_pool, ref_pool = pool.clone(), pool.clone()
        out = fused_recurrent_gated_delta_rule(state_pool=ours_pool, **qkv, **raw)
        g, beta = naive.gdn_gating(**raw)
        ref = naive.fused_recurrent_gated_delta_rule(g=g, beta=beta, state_pool=ref_pool, **qkv)
        return max(_rel_err(out, ref), _rel_err(ours_pool, ref_pool))

    state_bytes = 2 * num_seqs * HV * K * V * 4
    io_bytes = num_seqs * ((2 * HK * K + 2 * HV * V) * 2 + 2 * HV * 2)
    return [
        Case(
            op="gdn_decode_gates",
            shape=f"N={num_seqs} L=1 raw a,b {DEFAULT_RECURRENT} [graph x{GRAPH_CALLS}]",
            ours=_graphed(ours),
            reference=_graphed(torch_gates_then_recurrent),
            reference_label="torch gating + recurrent",
            check=check,
            tolerance=TOLERANCE,
            bytes_moved=GRAPH_CALLS * (state_bytes + io_bytes),
            peer=_graphed(fused_gates_then_recurrent),
            peer_label="gating kernel + recurrent",
            target="the gating ops' ~8 launches gone from the decode step (~10 us per layer at N=1)",
        )
    ]


def _decode_step_cases(num_seqs: int) -> list[Case]:
    """The layer's decode step between in_proj and out_proj at one token per sequence. Ours: the
    fused kernel (conv update, delta rule, gated norm in one launch); reference: the three unfused
    Triton kernels (conv1d update, recurrent on raw gates, gated norm); peer: the fused kernel at
    block_v 64 instead of its 32. Inputs are column views of one bf16 in_proj output."""
    proj = torch.randn(num_seqs, IN_PROJ_WIDTH, device="cuda", dtype=torch.bfloat16)
    mixed = proj[:, :CONV_DIM]
    z = proj[:, CONV_DIM : CONV_DIM + HV * V].unflatten(-1, (HV, V))
    _, _, a_log, dt_bias = _raw_gates(1)
    b, a = proj[:, -2 * HV : -HV], proj[:, -HV:]
    conv_weight = torch.randn(CONV_DIM, CONV_WIDTH, device="cuda", dtype=torch.bfloat16) * 0.5
    conv_pool = torch.randn(num_seqs + 8, CONV_DIM, CONV_WIDTH - 1, device="cuda", dtype=torch.bfloat16)
    pool = torch.randn(num_seqs + 8, HV, K, V, device="cuda") * 0.1
    slots = torch.randperm(num_seqs + 8, device="cuda")[:num_seqs].to(torch.int32)
    norm_weight = torch.ones(V, device="cuda", dtype=torch.bfloat16)
    step = dict(mixed_qkv=mixed, z=z, a=a, b=b, conv_weight=conv_weight, A_log=a_log, dt_bias=dt_bias,
                state_slots=slots, norm_weight=norm_weight, eps=1e-6)  # fmt: skip
    work_conv, work_pool = conv_pool.clone(), pool.clone()

    def fused(block_v: int | None = None):
        return decode_module.fused_gdn_decode(conv_state_pool=work_conv, state_pool=work_pool, block_v=block_v, **step)

    def unfused():
        conv_out = triton_conv1d.causal_conv1d_update(
            x=mixed, weight=conv_weight, bias=None, conv_state_pool=work_conv, state_slots=slots
        )
        q, k, v = conv_out.split([HK * K, HK * K, HV * V], dim=1)
        core = fused_recurrent_gated_delta_rule(
            q=q.view(num_seqs, 1, HK, K), k=k.view(num_seqs, 1, HK, K), v=v.view(num_seqs, 1, HV, V),
            a=a.unsqueeze(1), b=b.unsqueeze(1), A_log=a_log, dt_bias=dt_bias, state_pool=work_pool,
            state_slots=slots,
        )  # fmt: skip
        return triton_norm.gated_rms_norm(x=core[:, 0], gate=z, weight=norm_weight, eps=1e-6)

    def check() -> float:
        ours_conv, ours_pool, ref_conv, ref_pool = conv_pool.clone(), pool.clone(), conv_pool.clone(), pool.clone()
        out = decode_module.fused_gdn_decode(conv_state_pool=ours_conv, state_pool=ours_pool, **step)
        ref = naive.fused_gdn_decode(conv_state_pool=ref_conv, state_pool=ref_pool, **step)
        conv_ok = torch.equal(ours_conv, ref_conv)  # the windows are copied, not computed
        return max(_rel_err(out, ref), _rel_err(ours_pool, ref_pool), 0.0 if conv_ok else float("inf"))

    state_bytes = 2 * num_seqs * HV * K * V * 4
    io_bytes = num_seqs * ((CONV_DIM + HV * V + 2 * HV) * 2 + 2 * CONV_DIM * (CONV_WIDTH - 1) * 2 + HV * V * 2)
    block_v, other = decode_module.BLOCK_V, 64
    return [
        Case(
            op="gdn_decode_step",
            shape=f"N={num_seqs} conv+recurrent+norm bv{block_v} bf16 [graph x{GRAPH_CALLS}]",
            ours=_graphed(fused),
            reference=_graphed(unfused),
            reference_label="3 unfused kernels",
            check=check,
            tolerance=TOLERANCE,
            bytes_moved=GRAPH_CALLS * (state_bytes + io_bytes),
            peer=_graphed(lambda: fused(other)),
            peer_label=f"fused bv{other}",
            target="below the unfused kernels' time where the layer takes it (N <= 12)",
        )
    ]


def gate_cases() -> list[Case]:
    """The CUDA-graph rows: the fused gating kernel, decode with raw gates, and the fused decode step."""
    out = [case for t in (1, 64, 256, 8192) for case in _gating_cases(t)]
    out += [case for n in (1, 64, 256) for case in _decode_gate_cases(n)]
    out += [case for n in (1, 8, 12, 16, 64) for case in _decode_step_cases(n)]
    return out


def cases() -> list[Case]:
    torch.manual_seed(0)
    fla_chunk, fla_recurrent = _fla()
    out = [case for t in (128, 256, 512, 1024, 2048, 8192, 32768) for case in _chunk_cases(t, fla_chunk)]
    out.append(_split_prefill_case())
    out += [case for n in (1, 64, 256) for case in _recurrent_cases(n, fla_recurrent)]
    out += gate_cases()
    return out


def norm_ab(tokens: list[int]) -> None:
    """The chunked op with the GDN output norm inside (norm_gate: the split design's output kernel)
    against the op followed by the norm kernel, one sequence of each length, z a strided view of an
    in_proj-wide tensor as in the layer; us a call (median) and the largest difference."""
    import triton.testing

    for num_tokens in tokens:
        q, k, v, g, beta = _inputs(num_tokens)
        proj = torch.randn(num_tokens, IN_PROJ_WIDTH, device="cuda", dtype=torch.bfloat16)
        z = proj[:, 2 * HK * K + HV * V : 2 * HK * K + 2 * HV * V].unflatten(-1, (HV, V))
        weight = (1 + 0.2 * torch.randn(V, device="cuda")).to(torch.bfloat16)
        pool = torch.randn(4, HV, K, V, device="cuda") * 0.1
        kw = dict(q=q, k=k, v=v, g=g, beta=beta, cu_seqlens=torch.tensor([0, num_tokens], dtype=torch.int32,
                  device="cuda"), state_pool=pool, state_slots=torch.tensor([2], dtype=torch.int32, device="cuda"),
                  has_initial_state=torch.tensor([True], device="cuda"))  # fmt: skip

        def fused(kw=kw, z=z, weight=weight):
            return chunk_gated_delta_rule(**kw, norm_gate=z, norm_weight=weight, norm_eps=1e-6)

        def apart(kw=kw, z=z, weight=weight):
            o = chunk_gated_delta_rule(**kw)
            return triton_norm.gated_rms_norm(x=o, gate=z, weight=weight, eps=1e-6, pdl=False)

        start = pool.clone()  # each call advances the slot's state: compare both from the same one
        got = fused().float()
        pool.copy_(start)
        diff = (got - apart().float()).abs().max().item()
        ms_fused = triton.testing.do_bench(fused, rep=100, return_mode="median")
        ms_apart = triton.testing.do_bench(apart, rep=100, return_mode="median")
        print(f"gdn_chunk+norm T={num_tokens}: inside {ms_fused * 1e3:8.1f} us  apart {ms_apart * 1e3:8.1f} us "
              f"({ms_apart / ms_fused:.3f}x)  max diff {diff:.1e}", flush=True)  # fmt: skip


def breakdown(tokens: list[int], variants: list[str], calls: int = 20) -> None:
    """The chunked op kernel by kernel: each variant's kernels' device time (torch profiler over `calls`
    eager calls, one sequence of each length, variants run in turn with the first again last as a
    drift check), us a call; and first its wall time a call (CUDA events around `calls` eager calls,
    without the profiler: what the windowed variants change, their kernels overlapping on two streams)."""
    import collections

    from torch.profiler import ProfilerActivity, profile

    for num_tokens in tokens:
        q, k, v, g, beta = _inputs(num_tokens)
        pool = torch.randn(4, HV, K, V, device="cuda") * 0.1
        kw = dict(q=q, k=k, v=v, g=g, beta=beta, cu_seqlens=torch.tensor([0, num_tokens], dtype=torch.int32,
                  device="cuda"), state_pool=pool, state_slots=torch.tensor([2], dtype=torch.int32, device="cuda"),
                  has_initial_state=torch.tensor([True], device="cuda"))  # fmt: skip
        for name in [*variants, variants[0]]:
            variant = CHUNK_VARIANTS[name]
            for _ in range(3):
                chunk_gated_delta_rule(variant=variant, **kw)
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(calls):
                chunk_gated_delta_rule(variant=variant, **kw)
            end.record()
            torch.cuda.synchronize()
            wall = start.elapsed_time(end) * 1000 / calls
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(calls):
                    chunk_gated_delta_rule(variant=variant, **kw)
                torch.cuda.synchronize()
            spent: dict[str, float] = collections.defaultdict(float)
            for event in prof.events():
                if event.device_type.name == "CUDA":
                    spent[event.name] += event.device_time_total / calls
            parts = "  ".join(f"{n[:20]} {t:.1f}" for n, t in sorted(spent.items(), key=lambda x: -x[1]) if t > 1)
            busy = sum(spent.values())
            print(f"gdn_chunk T={num_tokens} {name:<12} wall {wall:8.1f} us  busy {busy:8.1f} us | {parts}", flush=True)


def main(argv: list[str] | None = None) -> int:
    """The CUDA-graph rows only, in microseconds per call."""
    import triton.testing

    parser = argparse.ArgumentParser(description="GDN gating, raw-gate decode, fused decode step: CUDA graphs")
    parser.add_argument("--json", default=None)
    parser.add_argument("--norm", default="", help="instead: norm_ab at these token counts (comma list)")
    parser.add_argument(
        "--breakdown", default="", help="instead: the chunked op kernel by kernel at these token counts (comma list)"
    )
    parser.add_argument("--variants", default="split32", help="with --breakdown: CHUNK_VARIANTS names (comma list)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA device", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    if args.norm:
        norm_ab([int(t) for t in args.norm.split(",")])
        return 0
    if args.breakdown:
        unknown = [v for v in args.variants.split(",") if v not in CHUNK_VARIANTS]
        if unknown:
            parser.error(f"--variants: unknown {unknown[:3]} (CHUNK_VARIANTS: {', '.join(CHUNK_VARIANTS)})")
        breakdown([int(t) for t in args.breakdown.split(",")], args.variants.split(","))
        return 0
    print(f"device: {torch.cuda.get_device_name()}  ({GRAPH_CALLS} calls per CUDA graph, median of replays)")
    rows = []
    for case in gate_cases():
        err = case.check()
        row = {"op": case.op, "shape": case.shape, "max_err": err, "ok": err <= case.tolerance}
        for key, fn in (("ours_us", case.ours), ("ref_us", case.reference), ("peer_us", case.peer)):
            if fn is not None:
                ms = triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
                row[key] = ms * 1e3 / GRAPH_CALLS
        rows.append(row)
        line = f"{row['op']:<17} {row['shape']:<44} ours {row['ours_us']:7.2f} us"
        line += f"  {case.reference_label} {row['ref_us']:7.2f} us ({row['ref_us'] / row['ours_us']:.2f}x)"
        if "peer_us" in row:
            line += f"  {case.peer_label} {row['peer_us']:7.2f} us ({row['peer_us'] / row['ours_us']:.2f}x)"
        line += f"  err {err:.1e} {'ok' if row['ok'] else 'FAIL'}"
        print(line, flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "graph_calls": GRAPH_CALLS, "rows": rows}, f, indent=1)
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
