"""The kernels that carry LoRA adapters, compiled for sm_90 on this machine (Triton's front end, then
ptxas from the Triton wheel; no GPU): the interpreter runs what the compiler refuses (a constexpr lost
through a tuple, a global that is not a constexpr), so each LoRA variant is compiled here too, in a
child process without TRITON_INTERPRET (the tests' conftest sets it, and the jitted kernels follow)."""

# test phase: parallel (its child process compiles kernels and exits)

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import triton

from deltaserve.layers.kernels.device import H200, DeviceInfo
from deltaserve.layers.kernels.lora import triton_lora
from deltaserve.layers.kernels.moe import pairs, tiles
from deltaserve.layers.kernels.moe import sorted as sorted_path
from deltaserve.layers.kernels.norm import triton_norm

BF16 = "*bf16"
H200_SMEM = 227 * 1024
H200_INFO = DeviceInfo(H200, 132, H200_SMEM, (9, 0))


def test_lora_kernels_compile_for_sm90():
    pytest.importorskip("triton.backends.nvidia.compiler", reason="Triton's NVIDIA back end")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["compiled", str(len(CASES))], done.stdout[-500:]


def compile_sm90(fn, pointers: dict[str, str], constexprs: dict, num_warps: int = 4, num_stages: int = 1):
    """fn compiled to a cubin: the named pointer arguments of the given types, other arguments i32
    (eps fp32), the constexprs as given. Pointers and strides (s_*, stride*) carry the 16-divisibility
    the JIT finds at the real shapes: without it no load is vectorised and none pipelined (a
    one-stage kernel whose shared memory would not show what the device compiles)."""
    sig, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in constexprs:
            sig[name] = "constexpr"
        else:
            sig[name] = pointers.get(name, "fp32" if name == "eps" else "i32")
            if name in pointers or name.startswith(("s_", "stride")):
                attrs[(i,)] = [["tt.divisibility", 16]]
    src = triton.compiler.ASTSource(fn, sig, constexprs, attrs)
    target = triton.backends.compiler.GPUTarget("cuda", 90, 32)
    kernel = triton.compile(src, target=target, options=dict(num_warps=num_warps, num_stages=num_stages))
    assert kernel.asm["cubin"], fn.__name__
    # the H200's opt-in shared memory: more is refused only at launch (OutOfResources)
    assert kernel.metadata.shared <= H200_SMEM, (fn.__name__, kernel.metadata.shared, constexprs)


LOW_RANK = {"lora_keys": "*i32", "lora_v": "*fp32", "lora_b": BF16}


def sorted_path_kernels(rank, fp8=False, quant_act=True, tokens=0, tma=False):
    """fp8: FP8 experts (float8 weights and quantized activations; without quant_act bf16 ones)
    beside the bf16 adapters. tokens: the H200's tiles for a pass of that many (tiles.sorted_config at
    the 35B shape), else small ones. tma: the weights through TMA descriptors (bf16)."""
    w = "*fp8e4nv" if fp8 else BF16
    x = w if quant_act else BF16
    up_ptrs = {"hidden": x, "w13": w, "act": BF16, "x_scale": "*fp32", "w_scale": "*fp32"}
    ids = {"sorted_ids": "*i32", "block_expert": "*i32", "num_padded": "*i32"}
    scales = dict(SCALE_N=128, SCALE_K=128) if fp8 else dict(SCALE_N=1, SCALE_K=1 << 30)
    small = dict(block_n=64, block_k=128, num_warps=4, num_stages=4)
    cfg = dict(block_m=16, n_major=True, up=small, down=small)
    if tokens:
        cfg = tiles.sorted_config(tokens * 8, 256, 2, H200_INFO, fp8=fp8, quantized_acts=quant_act)
    for name, kernel, ptrs in (
        ("up", sorted_path._up_kernel, {**up_ptrs, **ids, **LOW_RANK}),
        ("down", sorted_path._down_kernel, {"act": x, "w2": w, "y": BF16, "act_scale": "*fp32", "w_scale": "*fp32",
                                            **ids, **LOW_RANK, "topk_weights": "*fp32"}),
    ):  # fmt: skip
        t = cfg[name]
        consts = dict(HIDDEN=2048, INTER=512, LORA_RANK=rank, USE_PDL=True, QUANT_ACT=fp8 and quant_act,
                      N_MAJOR=cfg["n_major"], BLOCK_M=cfg["block_m"], BLOCK_N=t["block_n"], BLOCK_K=t["block_k"],
                      FP8=fp8, GROUP=128, W_DESC=tma, **scales)  # fmt: skip
        ptrs = {**ptrs, "w_desc": f"tensordesc<bf16[{t['block_n']}, {t['block_k']}]>" if tma else w}
        consts.update(PERSISTENT=False, FLATTEN=False)  # one program a tile: the adapters' path
        if name == "up":
            consts.update(TOPK=8, ACT_SORTED=False)
        else:
            consts["A_DESC"] = False
        compile_sm90(kernel, ptrs, consts, num_warps=t["num_warps"], num_stages=t["num_stages"])
    sum_ptrs = {n: BF16 for n in ("y", "out", "shared", "gate_logit", "residual", "norm_weight", "normed_out")}
    sum_ptrs |= {"res_out": BF16, "topk_ids": "*i64", "y_row": "*i32", "topk_weights": "*fp32", **LOW_RANK}
    sum_consts = dict(
        HIDDEN=2048, TOPK=8, BLOCK=2048, HAS_SHARED=True, ADD_NORM=True, LORA_RANK=rank, USE_PDL=True, BY_ROW=False
    )  # fmt: skip
    compile_sm90(sorted_path._sum_kernel, sum_ptrs, sum_consts, num_warps=8 if rank else 4)


def pairs_down_gemv(rank, shared_rank):

    names = ("act", "w2", "out", "shared_gate_up", "shared_w2", "shared_gate_logit", "residual", "norm_weight")
    ptrs = {n: BF16 for n in (*names, "normed_out", "res_out", "w2_scale", "shared_scale", "slora_b")}
    ptrs |= {"topk_weights": "*fp32", "topk_ids": "*i64", "tickets": "*i32", "slora_keys": "*i32"}
    ptrs |= {"slora_v": "*fp32", **LOW_RANK}
    consts = dict(
        HIDDEN=2048, INTER=512, TOPK=8, BLOCK_H=2, BLOCK_I=512, SHARED_INTER=512, ADD_NORM=True, BLOCK_HID=2048,
        FP8=False, SCALE_N=1, SCALE_K=1, SHARED_FP8=False, SHARED_SCALE_N=1, SHARED_SCALE_K=1, LORA_RANK=rank,
        SHARED_LORA_RANK=shared_rank, USE_PDL=True,
    )  # fmt: skip
    compile_sm90(pairs._down_gemv_kernel, ptrs, consts, num_warps=2)


def pair_shrink(keys_from_ids, second):

    ptrs = {"x": BF16, "a": BF16, "x2": BF16, "a2": BF16, "v": "*fp32", "v2": "*fp32", "keys": "*i32"}
    ptrs |= {"keys2": "*i32", "token_slots": "*i32", "topk_ids": "*i64"}
    consts = dict(
        K=2048, RA=32, ROW_DIV=8, BLOCK_R=8, BLOCK_K=256, KEYS_FROM_IDS=keys_from_ids, GLU=not keys_from_ids,
        K2=512 if second else 0, RA2=16 if second else 0, BLOCK_K2=256, GLU2=second, USE_PDL=True,
    )  # fmt: skip
    compile_sm90(triton_lora._pair_shrink_kernel, ptrs, consts)


def norm_with_low_rank():

    ptrs = {n: BF16 for n in ("x", "gate", "residual", "weight", "out", "res_out")} | {"ids": "*i64", **LOW_RANK}
    consts = dict(
        DIM=2048, ROWS=1, BLOCK_D=2048, ZERO_CENTERED=True, HAS_GATE=False, HAS_RESIDUAL=True, GATHER=False,
        LORA_RANK=16, USE_PDL=True,
    )  # fmt: skip
    compile_sm90(triton_norm._rms_norm_kernel, ptrs, consts, num_warps=8)


CASES = [
    (sorted_path_kernels, 0), (sorted_path_kernels, 16), (sorted_path_kernels, 16, True),
    (sorted_path_kernels, 0, True, False), (sorted_path_kernels, 16, False, True, 8192),
    (sorted_path_kernels, 0, True, True, 2048), (sorted_path_kernels, 0, True, False, 8192),
    (sorted_path_kernels, 16, False, True, 8192, True), (pairs_down_gemv, 16, 0),
    (pairs_down_gemv, 16, 16), (pairs_down_gemv, 0, 16), (pair_shrink, True, False), (pair_shrink, False, True),
    (norm_with_low_rank,),
]  # fmt: skip

if __name__ == "__main__":
    for fn, *args in CASES:
        fn(*args)
    print("compiled", len(CASES))
