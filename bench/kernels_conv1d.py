"""Causal conv1d kernel cases at Qwen3.5-35B-A3B shapes: the GDN layer's conv over q, k, v
(C = 2 * 16 * 128 + 32 * 128 = 8192 channels, width 4, bf16 inputs and window, silu).

    python -m deltaserve.bench.kernels_conv1d --sweep --tokens 2048,8192   # the prefill kernel's tiles
"""

from __future__ import annotations

import argparse
import itertools

import torch

from deltaserve.bench.kernel_cases import Case
from deltaserve.layers.kernels.conv1d import naive
from deltaserve.layers.kernels.conv1d.triton_conv1d import VARLEN_TILES, causal_conv1d_update, causal_conv1d_varlen

CHANNELS, WIDTH = 2 * 16 * 128 + 32 * 128, 4
TOLERANCE = 1e-2  # bf16 outputs, relative to the reference's magnitude


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """max |out - ref| over max(1, max |ref|); NaN counts as infinite."""
    if torch.isnan(out).any():
        return float("inf")
    return ((out.float() - ref.float()).abs().max() / ref.float().abs().max().clamp(min=1)).item()


def _varlen_case(num_tokens: int) -> Case:
    x = torch.randn(num_tokens, CHANNELS, device="cuda", dtype=torch.bfloat16)
    weight = torch.randn(CHANNELS, WIDTH, device="cuda", dtype=torch.bfloat16) * 0.5
    pool = torch.randn(4, CHANNELS, WIDTH - 1, device="cuda", dtype=torch.bfloat16)
    kwargs = dict(
        x=x,
        weight=weight,
        bias=None,
        cu_seqlens=torch.tensor([0, num_tokens], dtype=torch.int32, device="cuda"),
        state_slots=torch.tensor([1], dtype=torch.int32, device="cuda"),
        has_initial_state=torch.tensor([True], device="cuda"),
    )
    work_pool = pool.clone()

    def check() -> float:
        ours_pool, ref_pool = pool.clone(), pool.clone()
        out = causal_conv1d_varlen(conv_state_pool=ours_pool, **kwargs)
        ref = naive.causal_conv1d_varlen(conv_state_pool=ref_pool, **kwargs)
        return max(_rel_err(out, ref), _rel_err(ours_pool, ref_pool))

    return Case(
        op="conv1d_varlen",
        shape=f"T={num_tokens} C={CHANNELS} W={WIDTH}",
        ours=lambda: causal_conv1d_varlen(conv_state_pool=work_pool, **kwargs),
        reference=lambda: naive.causal_conv1d_varlen(conv_state_pool=work_pool, **kwargs),
        reference_label="naive torch",
        check=check,
        tolerance=TOLERANCE,
        bytes_moved=2 * num_tokens * CHANNELS * 2 + CHANNELS * WIDTH * 2 + 2 * CHANNELS * (WIDTH - 1) * 2,
        flops=2 * num_tokens * CHANNELS * WIDTH,
        target="near the copy-bandwidth floor",
    )


def _update_case(num_seqs: int) -> Case:
    x = torch.randn(num_seqs, CHANNELS, device="cuda", dtype=torch.bfloat16)
    weight = torch.randn(CHANNELS, WIDTH, device="cuda", dtype=torch.bfloat16) * 0.5
    pool = torch.randn(num_seqs + 8, CHANNELS, WIDTH - 1, device="cuda", dtype=torch.bfloat16)
    slots = torch.randperm(num_seqs + 8, device="cuda")[:num_seqs].to(torch.int32)
    kwargs = dict(x=x, weight=weight, bias=None, state_slots=slots)
    work_pool = pool.clone()

    def check() -> float:
        ours_pool, ref_pool = pool.clone(), pool.clone()
        out = causal_conv1d_update(conv_state_pool=ours_pool, **kwargs)
        ref = naive.causal_conv1d_update(conv_state_pool=ref_pool, **kwargs)
        return max(_rel_err(out, ref), _rel_err(ours_pool, ref_pool))

    return Case(
        op="conv1d_update",
        shape=f"N={num_seqs} C={CHANNELS} W={WIDTH}",
        ours=lambda: causal_conv1d_update(conv_state_pool=work_pool, **kwargs),
        reference=lambda: naive.causal_conv1d_update(conv_state_pool=work_pool, **kwargs),
        reference_label="naive torch",
        check=check,
        tolerance=TOLERANCE,
        bytes_moved=2 * num_seqs * CHANNELS * 2 + CHANNELS * WIDTH * 2 + 2 * num_seqs * CHANNELS * (WIDTH - 1) * 2,
        target="launch-bound at these sizes: a few microseconds",
    )


def cases() -> list[Case]:
    torch.manual_seed(0)
    return [_varlen_case(8192), _update_case(64), _update_case(256)]


def sweep(tokens: list[int]) -> None:
    """The prefill kernel's tiles (tokens, channels, warps a program) on one sequence of each length:
    us a call, TB/s of the copy floor's bytes (x in, y out), the error against the reference."""
    import triton.testing

    for num_tokens in tokens:
        x = torch.randn(num_tokens, CHANNELS, device="cuda", dtype=torch.bfloat16)
        weight = torch.randn(CHANNELS, WIDTH, device="cuda", dtype=torch.bfloat16) * 0.5
        pool = torch.randn(4, CHANNELS, WIDTH - 1, device="cuda", dtype=torch.bfloat16)
        kw = dict(x=x, weight=weight, bias=None, cu_seqlens=torch.tensor([0, num_tokens], dtype=torch.int32,
                  device="cuda"), state_slots=torch.tensor([1], dtype=torch.int32, device="cuda"),
                  has_initial_state=torch.tensor([True], device="cuda"))  # fmt: skip
        ref = naive.causal_conv1d_varlen(conv_state_pool=pool.clone(), **kw)
        work = pool.clone()  # the timed calls' windows: the values move on, the cost does not
        print(f"T={num_tokens} C={CHANNELS} W={WIDTH} (default tiles {VARLEN_TILES})")
        for tiles in itertools.product((16, 32, 64, 128), (64, 128, 256), (2, 4, 8)):

            def run(tiles=tiles, work=work, kw=kw) -> torch.Tensor:
                return causal_conv1d_varlen(conv_state_pool=work, tiles=tiles, **kw)

            try:
                err = _rel_err(causal_conv1d_varlen(conv_state_pool=pool.clone(), tiles=tiles, **kw), ref)
                ms = triton.testing.do_bench(run, rep=50, return_mode="median")
            except Exception as e:  # a tile that does not compile is reported, not fatal
                print(f"  {tiles} failed: {type(e).__name__}: {str(e)[:80]}")
                continue
            tb_s = 2 * num_tokens * CHANNELS * 2 / (ms * 1e-3) / 1e12
            print(f"  {tiles}  {ms * 1e3:8.1f} us  {tb_s:5.2f} TB/s  err {err:.1e}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--tokens", default="2048,8192")
    args = parser.parse_args()
    if args.sweep:
        sweep([int(t) for t in args.tokens.split(",")])
