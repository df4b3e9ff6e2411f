"""Every Triton kernel of a fresh 2k prompt's prefill and of a batch-1 decode step at the
Qwen3.5-35B-A3B shape compiles for sm_90 on this machine (bench/sm90.py: the pass recorded on fake
tensors with the H200's tiles, Triton's front end and the wheel's ptxas) within the H200's shared
memory, and none spills registers but the paged prefill attention at head dim 256, whose every
tile spills (its 128 x 256 float32 accumulator and q fill the registers; layers/kernels/attention):
a new spill anywhere else fails here. In a child process without TRITON_INTERPRET (the conftest
sets it, and the kernels would be the interpreter's)."""

# test phase: parallel (its child processes compile kernels and exit)

from __future__ import annotations

import os
import subprocess
import sys

import pytest


def test_prefill_and_decode_kernels_compile_for_sm90_without_new_spills():
    pytest.importorskip("triton.backends.nvidia.compiler", reason="Triton's NVIDIA back end")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    cmd = [sys.executable, "-m", "deltaserve.bench.sm90", "--prefill", "2048", "--decode", "1",
           "--allow-spills", "_prefill_kernel"]  # fmt: skip
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    lines = done.stdout.splitlines()
    kernels = {line.split()[0] for line in lines if line.startswith("  ")}
    # the pass's GDN capture replay, the chunk kernels and the MoE's grouped GEMMs among them
    assert {"_advance_kernel", "_recur_kernel", "_up_kernel", "_down_kernel", "_row_gemv_kernel"} <= kernels
    assert not any("failed" in line for line in lines), done.stdout


def test_persistent_moe_gemms_compile_for_sm90():
    """The MoE sorted path's GEMMs as persistent programs with the tile and K loops flattened
    (KernelOptions.moe_sorted_persistent "flat"; "loop" shares the tile bodies) at a 2k prompt's
    tiles: they compile and fit the H200's shared memory (with tiles.FLAT_SMEM reserved); the down
    GEMM's 32 spilled bytes under Triton 3.9 (none under 3.6, the GPU machines') are let through."""
    pytest.importorskip("triton.backends.nvidia.compiler", reason="Triton's NVIDIA back end")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    cmd = [sys.executable, "-m", "deltaserve.bench.sm90", "--prefill", "2048", "--options",
           "moe_sorted_persistent=flat", "--allow-spills", "_prefill_kernel,_down_kernel"]  # fmt: skip
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    # exit 0: every kernel compiled, none asked for more shared memory than a program may have
    moe = {
        fields[0]: float(fields[4])
        for fields in (line.split() for line in done.stdout.splitlines())
        if fields[:1] in (["_up_kernel"], ["_down_kernel"])
    }
    # three stages of these tiles (144 KB: tiles.FLAT_SMEM keeps the fourth out) and the flattened loop's
    # own 32 KB, within a program's 227 KB
    assert moe.keys() == {"_up_kernel", "_down_kernel"}, done.stdout
    assert all(160 < kb <= 227 for kb in moe.values()), done.stdout
