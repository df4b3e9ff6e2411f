"""Every Triton kernel of one pass compiled for sm_90 (the H200) without a GPU: registers, spilled
bytes and shared memory of each, at a preset's real shape.

The pass runs as bench/launches.py runs it (fake tensors that report CUDA, the tile pickers told
the device is an H200), each Triton launch recorded instead of run; each distinct launch is then
compiled by Triton's front end and the wheel's ptxas for sm_90 (pointers and 16-divisible integers
marked as the JIT finds them; integers equal to 1 specialised), and the cubin's resources read with
the wheel's cuobjdump. A spill (stack bytes at the register limit, or local bytes) in a kernel on the
pass's critical path costs every call; shared memory above the H200's 227 KB would fail at launch.
The GPU machines run Triton 3.6: put its wheel first on PYTHONPATH to see what they compile.

    python -m deltaserve.bench.sm90 --prefill 2048                # a fresh 2k prompt, its captures
    python -m deltaserve.bench.sm90 --decode 1 --decode 64        # decode steps

Exit status 1 when a kernel fails to compile, spills (other than those --allow-spills names) or asks
for more shared memory than a program may have. `--options "moe_sorted_persistent=1"`: the pass
under those kernel options.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import re
import subprocess
import sys
import tempfile
import warnings
from unittest import mock

import torch

from deltaserve.layers.kernels import device as kernel_device
from deltaserve.layers.kernels.options import KernelOptions

from .launches import decode_pass, fake_pass, fresh_prompt_captures, prefill_pass, with_adapters
from .presets import PRESETS, preset_config

H200_INFO = kernel_device.DeviceInfo(kernel_device.H200, 132, 227 * 1024, (9, 0))
# a stack frame below this many registers is a call's (libdevice's sin / cos keep their slow path's
# table there), not registers spilled
SPILL_REGS = 200
_LAUNCH_OPTIONS = ("num_warps", "num_stages", "num_ctas", "maxnreg", "launch_pdl")
_DTYPES = {
    torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.int32: "i32", torch.int64: "i64",
    torch.int8: "i8", torch.uint8: "u8", torch.bool: "i1", torch.float8_e4m3fn: "fp8e4nv", torch.int16: "i16",
}  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Launch:
    """One recorded launch: the kernel, its signature and constexprs, attributes, launch options."""

    fn: object
    signature: tuple
    constexprs: tuple
    attrs: tuple
    options: tuple

    @property
    def name(self) -> str:
        return self.fn.fn.__name__


def _arg_type(value) -> str | None:
    """A runtime argument's Triton type, None for a constexpr-like value (None)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    if value is None:
        return None
    if isinstance(value, TensorDescriptor):
        block = ", ".join(str(b) for b in value.block_shape)
        return f"tensordesc<{_DTYPES[value.base.dtype]}[{block}]>"
    if torch.is_tensor(value):
        return "*" + _DTYPES[value.dtype]
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32" if -(2**31) <= value < 2**31 else "i64"
    if isinstance(value, float):
        return "fp32"
    raise TypeError(f"argument of type {type(value).__name__}")


def record(fn, args: tuple, kwargs: dict) -> Launch:
    """The launch of JITFunction fn with these arguments, as the JIT would specialise it."""
    bound = dict(zip(fn.arg_names[: len(args)], args, strict=True))
    bound.update({k: v for k, v in kwargs.items() if k in fn.arg_names})
    options = tuple(sorted((k, v) for k, v in kwargs.items() if k in _LAUNCH_OPTIONS))
    sig, consts, attrs = [], [], []
    for i, param in enumerate(fn.params):
        value = bound.get(param.name, param.default if param.has_default else None)
        kind = None if param.is_constexpr else _arg_type(value)
        if kind is None or (
            kind.startswith("i") and not kind.startswith("i1") and value == 1 and not param.do_not_specialize
        ):
            sig.append((param.name, "constexpr"))
            consts.append((param.name, value))
            continue
        sig.append((param.name, kind))
        aligned = torch.is_tensor(value) or (isinstance(value, int) and not isinstance(value, bool) and value % 16 == 0)
        if aligned and not param.do_not_specialize:
            attrs.append(((i,), (("tt.divisibility", 16),)))
    return Launch(fn, tuple(sig), tuple(consts), tuple(attrs), options)


@contextlib.contextmanager
def h200_pickers():
    """The kernels' tile pickers see an H200 (device_info, in every kernel module that took it)."""
    patches = [
        mock.patch.object(module, "device_info", lambda device: H200_INFO)
        for name, module in list(sys.modules.items())
        if name.startswith("deltaserve.layers.kernels") and getattr(module, "device_info", None) is not None
    ]
    with contextlib.ExitStack() as stack:
        for p in patches:
            stack.enter_context(p)
        yield


def recorded_pass(
    preset: str,
    *,
    prefill: int = 0,
    decode: int = 0,
    fp8: bool = False,
    adapters: int = 0,
    kernels: KernelOptions | None = None,
) -> list[Launch]:
    """The distinct Triton launches of one eager pass at the preset's shape (bfloat16; fp8: its
    projections and experts in block FP8, as `quantization="fp8"` loads them): a fresh prompt of
    `prefill` tokens with its usual captures, or a decode step of `decode` rows (on `adapters`
    distinct rank-16 adapters), under these kernel options (default: the defaults)."""
    from deltaserve.layers.config import Fp8Scheme

    config = preset_config(preset)
    if fp8:
        config = dataclasses.replace(config, quantization=Fp8Scheme())
    if prefill:
        plan, sizes = prefill_pass(prefill, fresh_prompt_captures(prefill))
    else:
        plan, sizes = decode_pass(decode, adapters)
    return recorded_plan(config, plan, sizes, prepare=with_adapters(0 if prefill else adapters), kernels=kernels)


def recorded_plan(config, plan, sizes, *, prepare=None, kernels: KernelOptions | None = None) -> list[Launch]:
    """The distinct Triton launches of one eager pass of `plan` at `config`'s shape (fake tensors on an
    "H200": bench/launches.py's fake_pass)."""
    import triton.runtime.jit as jit

    seen: dict[Launch, None] = {}

    def run(self, *args, grid, warmup=False, **kwargs):
        seen.setdefault(record(self, args, kwargs))

    recording = contextlib.ExitStack()
    recording.enter_context(h200_pickers())
    recording.enter_context(mock.patch.object(jit.JITFunction, "run", run))
    fake_pass(config, plan, sizes, recording, prepare=prepare, kernels=kernels)
    return list(seen)


def first_layers(config, layers: int):
    """config with only its first `layers` decoder layers (0, or a family with per-layer tables beyond the
    layer and MLP types: all): a pass repeats each period of its layer types, so two periods launch the
    same distinct variants as the whole model (tests/test_compile_warmup.py holds the sets equal)."""
    if not layers or layers >= config.num_layers or config.ple is not None or config.hyper is not None:
        return config
    return dataclasses.replace(
        config, num_layers=layers, layer_types=config.layer_types[:layers], mlp_types=config.mlp_types[:layers]
    )


def warmup_coverage(
    preset: str, *, fp8: bool, slots: int, totals: tuple[int, ...], layers: int = 0
) -> dict[int, list[str]]:
    """The Triton variants a short mixed pass (a decode row beside a prompt chunk, `total` tokens) would
    launch that no start-up warm-up batch fitting a `slots`-slot pool launches (they would compile on
    a user's request), by total; empty lists: covered. layers: the model's first layers only
    (first_layers; 0: all)."""
    from deltaserve.layers.config import Fp8Scheme
    from deltaserve.workers.plan import PoolSizes
    from deltaserve.workers.warmup import WARMUP_BATCHES, warmup_fits, warmup_plan

    config = first_layers(preset_config(preset), layers)
    if fp8:
        config = dataclasses.replace(config, quantization=Fp8Scheme())
    sizes = PoolSizes(num_blocks=1024, block_size=16, num_slots=slots)
    warm: set[Launch] = set()
    for streams in WARMUP_BATCHES:
        if warmup_fits(streams, 2048, sizes):
            warm |= set(recorded_plan(config, warmup_plan(streams, 16), sizes))
    out = {}
    for total in totals:
        launched = recorded_plan(config, warmup_plan(((100, 1), (0, total - 1)), 16), sizes)
        out[total] = sorted({f"{m.name}{dict(m.constexprs)}" for m in launched if m not in warm})
    return out


def _cuobjdump() -> str:
    import triton.backends.nvidia as nvidia

    return os.path.join(os.path.dirname(nvidia.__file__), "bin", "cuobjdump")


def compile_sm90(launch: Launch) -> dict:
    """The launch compiled for sm_90: registers, stack and local bytes (spills), shared memory, and
    the warp-specialized loops' partitions (0: none)."""
    import triton

    src = triton.compiler.ASTSource(
        launch.fn, dict(launch.signature), dict(launch.constexprs), {k: [list(a) for a in v] for k, v in launch.attrs}
    )
    options = {k: v for k, v in launch.options if k != "launch_pdl"}
    kernel = triton.compile(src, target=triton.backends.compiler.GPUTarget("cuda", 90, 32), options=options)
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        usage = subprocess.run([_cuobjdump(), "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
    line = next(x for x in usage.splitlines() if "REG:" in x)
    regs, stack, local = (int(re.search(rf"{key}:(\d+)", line).group(1)) for key in ("REG", "STACK", "LOCAL"))
    partitions = len(re.findall(r"^\s*partition\d+\(", kernel.asm["ttgir"], re.M))
    return dict(regs=regs, stack=stack, local=local, smem=int(kernel.metadata.shared), partitions=partitions)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="qwen3_5_35b_a3b", choices=sorted(PRESETS))
    p.add_argument("--prefill", type=int, action="append", default=[], help="a fresh prompt of this many tokens")
    p.add_argument("--decode", type=int, action="append", default=[], help="a decode step of this many rows")
    p.add_argument("--fp8", action="store_true", help="block-FP8 weights (quantization fp8)")
    p.add_argument("--adapters", type=int, default=0, help="decode rows on this many distinct LoRA adapters")
    p.add_argument("--allow-spills", default="", help="kernels whose spills are known (comma list): exit 0 on them")
    p.add_argument(
        "--warmup-coverage",
        type=int,
        metavar="SLOTS",
        default=0,
        help="instead: whether the start-up warm-up (batches fitting SLOTS state slots) launches every variant "
        "short mixed passes of 5 to 128 tokens do; exit 1 naming those it misses",
    )
    p.add_argument(
        "--layers", type=int, default=0, help="with --warmup-coverage: the model's first layers only (0: all)"
    )
    p.add_argument(
        "--options", default="", help='kernel options of the passes, "name=value,..." (KernelOptions fields)'
    )
    args = p.parse_args(argv)
    os.environ.pop("TRITON_INTERPRET", None)
    if args.warmup_coverage:
        totals = (5, 8, 13, 16, 21, 32, 57, 64, 99, 128)
        gaps = warmup_coverage(args.preset, fp8=args.fp8, slots=args.warmup_coverage, totals=totals, layers=args.layers)
        for total, missing in gaps.items():
            print(f"mixed pass of {total:4d} tokens: {'covered' if not missing else 'MISSES ' + '; '.join(missing)}")
        return 1 if any(gaps.values()) else 0
    settings = dict(pair.split("=", 1) for pair in args.options.split(",") if pair)
    kernels = KernelOptions().with_settings(settings)
    allowed = {name for name in args.allow_spills.split(",") if name}
    passes = [(f"prefill {n}", dict(prefill=n)) for n in args.prefill]
    passes += [(f"decode {n}", dict(decode=n)) for n in args.decode]
    spilled = 0
    for label, kw in passes or [("prefill 2048", dict(prefill=2048))]:
        launches = recorded_pass(args.preset, fp8=args.fp8, adapters=args.adapters, kernels=kernels, **kw)
        print(f"{label}: {len(launches)} distinct launches (sm_90: registers, stack and local bytes, shared KB)")
        for launch in launches:
            try:
                r = compile_sm90(launch)
            except Exception as e:  # a kernel the compiler refuses: report it, go on
                print(f"  {launch.name:32s} failed: {type(e).__name__}: {str(e)[:160]}")
                spilled += 1
                continue
            flag = "  SPILLS" if r["local"] or r["stack"] and r["regs"] >= SPILL_REGS else ""
            flag += "  SHARED MEMORY" if r["smem"] > H200_INFO.smem_per_block else ""
            flag += f"  warp-specialized: {r['partitions']} partitions" if r["partitions"] else ""
            options = " ".join(f"{k}={v}" for k, v in launch.options if k != "launch_pdl")
            sizes = f"{r['regs']:4d} {r['stack']:5d} {r['local']:5d} {r['smem'] / 1024:6.1f}"
            print(f"  {launch.name:32s} {sizes}  {options}{flag}")
            bad = "SPILLS" in flag or "SHARED" in flag
            spilled += bad and (launch.name not in allowed or "SHARED" in flag)
    return 1 if spilled else 0


if __name__ == "__main__":
    warnings.filterwarnings("ignore", category=UserWarning)  # fake tensors' data_ptr, Triton's knobs
    raise SystemExit(main())
