"""What a dependency between two decode phases costs: a kernel boundary under programmatic dependent
launch (PDL) against a grid barrier inside one persistent kernel.

    python -m deltaserve.bench.kernels_sync [--steps 40] [--json out.json]

GPU only. Two chains, each timed in a CUDA graph:
- square GEMVs (N = K = 2048, bf16, a distinct weight per step so each streams from HBM), one row
  of activations feeding the next: `row_gemv` launches with PDL, against one kernel whose programs
  load their next weight tile before a grid barrier and the activations after it;
- trivial steps (each program reads one value the previous step wrote): the bare cost of a
  boundary, launch against barrier.
The floor of the GEMV chain is its weight bytes over the copy bandwidth measured in the same run.
"""

from __future__ import annotations

import argparse
import json

import torch
import triton
import triton.language as tl

from ..layers.kernels.linear.triton_row import row_gemv
from ..layers.kernels.pdl import pdl_launch, pdl_wait
from .kernel_cases import graphed
from .kernels import measure_copy_bandwidth


@triton.jit
def _grid_wait(counter, target):
    """Spin until `counter` reaches `target` (one thread polls; the CTA barrier after the acquire
    orders every thread's later loads after the arrivals it observed)."""
    seen = tl.atomic_add(counter, 0, sem="acquire", scope="gpu")
    while seen < target:
        seen = tl.atomic_add(counter, 0, sem="acquire", scope="gpu")
    tl.debug_barrier()


@triton.jit
def _grid_arrive(counter):
    """Every thread's stores before the release of this program's arrival."""
    tl.debug_barrier()
    tl.atomic_add(counter, 1, sem="release", scope="gpu")


@triton.jit
def _persistent_gemv_chain(bufs, w, counter, STEPS: tl.constexpr, N: tl.constexpr, BLOCK_N: tl.constexpr):
    """Step s: bufs[(s + 1) % 2] = w[s] @ bufs[s % 2]; BLOCK_N rows a program, N = programs * BLOCK_N."""
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    r = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    k = tl.arange(0, N)
    cols = k[None, :] + 0 * r[:, None]
    for s in range(STEPS):
        wt = tl.load(w + s * N * N + r[:, None] * N + k[None, :], eviction_policy="evict_first")
        if s > 0:
            _grid_wait(counter, s * programs)
        x = tl.load(bufs + (s % 2) * N + cols, cache_modifier=".cg").to(tl.float32)
        acc = tl.sum(wt.to(tl.float32) * x, 1)
        tl.store(bufs + ((s + 1) % 2) * N + r, acc.to(bufs.dtype.element_ty))
        _grid_arrive(counter)


@triton.jit
def _tiny_step(src, dst, USE_PDL: tl.constexpr):
    pdl_wait(USE_PDL)
    pid = tl.program_id(0)
    tl.store(dst + pid, tl.load(src + (pid + 1) % tl.num_programs(0)) + 1)


@triton.jit
def _persistent_tiny_chain(bufs, counter, STEPS: tl.constexpr):
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    for s in range(STEPS):
        if s > 0:
            _grid_wait(counter, s * programs)
        v = tl.load(bufs + (s % 2) * programs + (pid + 1) % programs, cache_modifier=".cg")
        tl.store(bufs + ((s + 1) % 2) * programs + pid, v + 1)
        _grid_arrive(counter)


def _time(fn, reps: int = 50) -> float:
    """Median seconds of one call of fn (a graph replay)."""
    return triton.testing.do_bench(fn, warmup=10, rep=reps, return_mode="median") * 1e-3


def gemv_chain(steps: int, n: int = 2048) -> dict:
    device = torch.device("cuda")
    w = torch.randn(steps, n, n, device=device, dtype=torch.bfloat16) / n**0.5
    x0 = torch.randn(1, n, device=device, dtype=torch.bfloat16)
    results: dict[str, float] = {}

    def launches():
        x = x0
        for s in range(steps):
            x = row_gemv(x=x, weight=w[s])[0]
        return x

    reference = launches().float()
    results["pdl launches"] = _time(graphed([launches])) / steps
    counter = torch.zeros(1, dtype=torch.int32, device=device)
    bufs = torch.empty(2, n, device=device, dtype=torch.bfloat16)
    for block_n, warps in ((16, 8), (8, 4), (8, 8)):
        programs = n // block_n

        def persistent(block_n=block_n, warps=warps, programs=programs):
            counter.zero_()
            bufs[0].copy_(x0[0])
            _persistent_gemv_chain[(programs,)](bufs, w, counter, STEPS=steps, N=n, BLOCK_N=block_n, num_warps=warps)

        persistent()
        got = bufs[steps % 2].float()
        err = (got - reference[0]).abs().max().item() / reference.abs().max().item()
        results[f"persistent {programs} programs x {warps} warps (rel err {err:.1e})"] = (
            _time(graphed([persistent])) / steps
        )
    floor = n * n * 2 / measure_copy_bandwidth()
    return {"floor": floor, **results}


def tiny_chain(steps: int, programs: int) -> dict:
    device = torch.device("cuda")
    bufs = torch.zeros(2, programs, dtype=torch.int32, device=device)
    counter = torch.zeros(1, dtype=torch.int32, device=device)

    def launches():
        for s in range(steps):
            _tiny_step[(programs,)](bufs[s % 2], bufs[(s + 1) % 2], **pdl_launch(bufs))

    def persistent():
        counter.zero_()
        _persistent_tiny_chain[(programs,)](bufs, counter, STEPS=steps, num_warps=4)

    return {
        f"pdl launches, {programs} programs": _time(graphed([launches])) / steps,
        f"persistent, {programs} programs": _time(graphed([persistent])) / steps,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("kernels_sync: needs a GPU")
        return 1
    report = {"gemv 2048x2048": gemv_chain(args.steps)}
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for programs in (sms, 2 * sms, 8 * sms):
        report[f"tiny x{programs}"] = tiny_chain(4 * args.steps, programs)
    for section, rows in report.items():
        print(f"--- {section}: us per step ---")
        for label, seconds in rows.items():
            print(f"{seconds * 1e6:9.2f}  {label}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
