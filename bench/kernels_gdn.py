"""Gated delta rule kernel cases at Qwen3.5-35B-A3B shapes (16 key heads, 32 value heads, K = V = 128,
bf16 q/k/v, float32 g/beta/state): chunked prefill of one sequence and recurrent decode, with fla as
the peer when it is importable (q and k handed to it already expanded to the value heads).

Every kernel variant (chunk.VARIANTS, recurrent.VARIANTS; the first of each is the design measured
first) is a row of its own, checked against the reference, so that one run times old and new side
by side; the row marked default= is the wrapper's own pick. DELTASERVE_GDN_VARIANTS=name,name,...
limits the other rows to those variants."""

from __future__ import annotations

import os
import sys

import torch
import torch.nn.functional as F

from deltaserve.bench.kernel_cases import Case
from deltaserve.layers.kernels.gdn import chunk as chunk_module
from deltaserve.layers.kernels.gdn import naive
from deltaserve.layers.kernels.gdn import recurrent as recurrent_module
from deltaserve.layers.kernels.gdn.chunk import CHUNK, chunk_gated_delta_rule
from deltaserve.layers.kernels.gdn.recurrent import fused_recurrent_gated_delta_rule

HK, HV, K, V = 16, 32, 128, 128
TOLERANCE = 2e-2  # bf16 operands against the float32 reference, relative to the reference's magnitude


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


def _selected(names: list[str]) -> list[str]:
    """The variant names to time: all of them, or those DELTASERVE_GDN_VARIANTS names."""
    wanted = os.environ.get("DELTASERVE_GDN_VARIANTS")
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
        out = chunk_gated_delta_rule(state_pool=ours_pool, variant=variant, **kwargs)
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
    default = chunk_module.pick_variant(1, HV, V, torch.device("cuda"), num_tokens)
    cases = []
    for i, variant in enumerate([None, *_selected(list(chunk_module.VARIANTS))]):
        cases.append(
            Case(
                op="gdn_chunk",
                shape=f"T={num_tokens} Hk={HK} Hv={HV} K=V={K} {_label(variant, default)}",
                ours=lambda variant=variant: chunk_gated_delta_rule(state_pool=work_pool, variant=variant, **kwargs),
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
    return cases


def _recurrent_cases(num_seqs: int, fla_recurrent) -> list[Case]:
    q, k, v, g, beta = _inputs(1, lead=(num_seqs,))
    pool = torch.randn(num_seqs + 8, HV, K, V, device="cuda") * 0.1
    slots = torch.randperm(num_seqs + 8, device="cuda")[:num_seqs].to(torch.int32)
    kwargs = dict(q=q, k=k, v=v, g=g, beta=beta, state_slots=slots)
    work_pool = pool.clone()

    def check(variant) -> float:
        ours_pool, ref_pool = pool.clone(), pool.clone()
        out = fused_recurrent_gated_delta_rule(state_pool=ours_pool, variant=variant, **kwargs)
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
    for i, variant in enumerate([None, *_selected(list(recurrent_module.VARIANTS))]):
        cases.append(
            Case(
                op="gdn_recurrent",
                shape=f"N={num_seqs} L=1 Hk={HK} Hv={HV} K=V={K} {_label(variant, recurrent_module.DEFAULT_VARIANT)}",
                ours=lambda variant=variant: fused_recurrent_gated_delta_rule(
                    state_pool=work_pool, variant=variant, **kwargs
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


def cases() -> list[Case]:
    torch.manual_seed(0)
    fla_chunk, fla_recurrent = _fla()
    out = [case for t in (2048, 8192, 32768) for case in _chunk_cases(t, fla_chunk)]
    out += [case for n in (1, 64, 256) for case in _recurrent_cases(n, fla_recurrent)]
    return out
