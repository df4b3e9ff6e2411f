"""The chunked GDN kernels that prefix-cache captures run, compiled for sm_90 on this machine (Triton's
front end, then ptxas from the Triton wheel; no GPU) at the Qwen3.5 shapes (Hk 16, Hv 32, K = V =
128, bf16): the sequential kernels with their capture stores, the replay kernel on the chunk's own
WY rows (advance.py) in both designs and both entry dtypes (an eager pass's int32, a graph's int64),
and the per-chunk solve with its loops pipelined or not. Each must fit the H200's shared memory and
keep its registers without spilling to local memory (the sequential walks hold a [128, BV] float32
state a program: a spill there costs every chunk of every prefill). In a child process without
TRITON_INTERPRET (the conftest sets it)."""

# test phase: parallel (its child process compiles kernels and exits)

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from deltaserve.layers.kernels.gdn import advance, chunk_prepare, chunk_state

BF16, F32 = "*bf16", "*fp32"
H200_SMEM = 227 * 1024
SHAPE = dict(HV=32, GROUP=2, K=128, V=128, BK=128, BT=64)


def test_gdn_capture_kernels_compile_for_sm90_without_spills():
    pytest.importorskip("triton.backends.nvidia.compiler", reason="Triton's NVIDIA back end")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split()[-2:] == ["compiled", str(len(CASES))], done.stdout[-1500:]


def compile_sm90(fn, pointers: dict[str, str], constexprs: dict, num_warps: int, num_stages: int) -> dict:
    """fn compiled to a cubin by bench.sm90 (pointers as typed, other arguments i32, pointers and
    strides 16-divisible as the JIT finds them at these shapes); asserts it fits the H200's shared
    memory and spills nothing; returns its resources."""
    from deltaserve.bench.sm90 import Launch
    from deltaserve.bench.sm90 import compile_sm90 as compiled

    sig, attrs = [], []
    for i, name in enumerate(fn.arg_names):
        sig.append((name, "constexpr" if name in constexprs else pointers.get(name, "i32")))
        if name not in constexprs and (name in pointers or name.startswith(("s_", "stride"))):
            attrs.append(((i,), (("tt.divisibility", 16),)))
    options = (("num_stages", num_stages), ("num_warps", num_warps))
    r = compiled(Launch(fn, tuple(sig), tuple(constexprs.items()), tuple(attrs), options))
    assert r["smem"] <= H200_SMEM, (fn.__name__, r, constexprs)
    assert r["stack"] == 0 and r["local"] == 0, (fn.__name__, constexprs, r)
    return r


def replay(v_new: bool, entries: str):
    ptrs = {"k": BF16, "w": BF16, "u": BF16, "gcum": F32, "rnorm": F32, "pool": F32}
    ptrs |= {name: entries for name in ("first", "count", "slots")}
    consts = dict(SHAPE, BV=advance.BLOCK_V, L2NORM=True, V_NEW=v_new)
    return compile_sm90(advance._advance_kernel, ptrs, consts, num_warps=4, num_stages=1)


SEQ_PTRS = {"pool": F32, "cu_seqlens": "*i32", "slots": "*i32", "has_initial_state": "*i1", "capture": "*i32"}


def recur(capture: bool):
    """split32 (chunk.VARIANTS): block_v 32, 4 warps, 3 stages."""
    ptrs = {"k": BF16, "w": BF16, "u": BF16, "kscale": F32, "gcum": F32, "h": BF16, "chunk_states": F32, **SEQ_PTRS}
    consts = dict(SHAPE, BV=32, BLOCK_N=64, STORE_CHUNK_STATES=False, STORE_CAPTURE=capture)
    return compile_sm90(chunk_state._recur_kernel, ptrs, consts, num_warps=4, num_stages=3)


def fused(capture: bool, block_v: int, warps: int, stages: int, prefetch: bool):
    """fused (block_v 32, 4 warps, 2 stages) and fused_pf (block_v 64, 8 warps, 3 stages)."""
    ptrs = {n: BF16 for n in ("q", "w", "u", "kd", "scores", "o")} | {"qscale": F32, "gcum": F32, "chunk_states": F32}
    consts = dict(SHAPE, BV=block_v, BLOCK_N=64, STORE_CHUNK_STATES=False, PREFETCH=prefetch, STORE_CAPTURE=capture)
    return compile_sm90(chunk_state._state_kernel, {**ptrs, **SEQ_PTRS}, consts, num_warps=warps, num_stages=stages)


def solve(stages: int):
    """The per-chunk solve (one warp), its substitution rows loaded `stages` rows ahead (ChunkVariant.solve_stages)."""
    ptrs = {
        "k": BF16,
        "g": F32,
        "beta": F32,
        "cu_seqlens": "*i32",
        "gcum": F32,
        "rnorm": F32,
        "a_scratch": F32,
        "y": BF16,
    }
    consts = dict(HV=32, GROUP=2, K=128, BKP=32, BT=64, BC=16, BLOCK_N=64, L2NORM=True, PRECISION="tf32")
    return compile_sm90(chunk_prepare._solve_kernel, ptrs, dict(consts, SUB_STAGES=stages), num_warps=1, num_stages=1)


CASES = [
    (solve, 1), (solve, 6),
    (replay, True, "*i32"), (replay, False, "*i32"), (replay, True, "*i64"), (replay, False, "*i64"),
    (recur, True), (recur, False), (fused, False, 32, 4, 2, False), (fused, True, 64, 8, 3, True),
    (fused, True, 32, 4, 2, False), (fused, False, 64, 8, 3, True),
]  # fmt: skip

if __name__ == "__main__":
    for fn, *args in CASES:
        print(fn.__name__, args, fn(*args))
    print("compiled", len(CASES))
