"""Kernel launches of one eager decode step, counted without a GPU: the model at a real shape on fake
tensors (torch's FakeTensorMode: shapes, no memory) that say they are CUDA tensors (`is_cuda`, which
is what the ops dispatch on), each Triton launch counted instead of run, each torch op that would
launch a kernel counted as one. Tiles come from the interpreter's table (the tensors' device is
the CPU): they change grids, not the launches.

    python -m deltaserve.bench.launches --preset qwen3_5_35b_a3b --batch 1 --adapters 0,1,8
    python -m deltaserve.bench.launches --adapters "" --spec-k 3 --by-kernel   # a speculative step
    python -m deltaserve.bench.launches --adapters "" --prefill 2048 --by-kernel   # a fresh 2k prompt

A CUDA graph replays exactly these launches, so the count is what a decode step's graph holds
(torch ops: one launch an op, an estimate; Triton: exact). Per kernel name with --by-kernel.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
from unittest import mock

import numpy as np
import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

from deltaserve.layers import base as layer_base
from deltaserve.layers import lora as lora_layers
from deltaserve.layers.kernels import device as kernel_device
from deltaserve.layers.kernels.attention import triton_attention
from deltaserve.layers.kernels.linear import triton_linear
from deltaserve.layers.kernels.options import KernelOptions
from deltaserve.layers.kernels.rotary import triton_rotary
from deltaserve.layers.loader import build_model
from deltaserve.layers.model import HybridModel
from deltaserve.workers.context import build_forward_context, logits_rows
from deltaserve.workers.plan import PassPlan, PoolSizes
from deltaserve.workers.state_pool import StatePool

from .presets import PRESETS, preset_config

# aten ops that only make a tensor or a view (no kernel)
_NO_LAUNCH = {
    "empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "view", "_unsafe_view", "reshape",
    "slice", "select", "t", "transpose", "permute", "expand", "unsqueeze", "squeeze", "as_strided", "detach",
    "alias", "unbind", "split", "split_with_sizes", "chunk", "narrow", "lift_fresh", "_to_copy_noop", "sym_size",
    "sym_stride", "sym_numel", "sym_storage_offset", "is_same_size", "lift_fresh_copy", "set_", "resolve_conj",
    "resolve_neg", "_reshape_alias", "numpy_T", "view_as", "expand_as", "contiguous_noop",
}  # fmt: skip


class _TorchOps(TorchDispatchMode):
    def __init__(self, counts: collections.Counter):
        super().__init__()
        self.counts = counts

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if func.namespace == "aten" and name not in _NO_LAUNCH:
            self.counts[f"torch.{name}"] += 1
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def count_launches(counts: collections.Counter):
    """Inside: Triton launches and kernel-launching torch ops add to counts (name -> launches)."""
    import triton.runtime.interpreter as interpreter
    import triton.runtime.jit as jit

    def run(self, *args, grid, warmup=False, **kwargs):
        counts[f"triton.{self.fn.__name__}"] += 1

    # compiled kernels, and interpreted ones (TRITON_INTERPRET=1, as the CPU tests run)
    with (
        mock.patch.object(jit.JITFunction, "run", run),
        mock.patch.object(interpreter.InterpretedFunction, "run", run),
        _TorchOps(counts),
    ):
        yield


_IS_CUDA = torch._C.TensorBase.is_cuda


# the kernels' per-device buffers (keyed "cpu" here): what a fake run adds must not reach a real one
_DEVICE_CACHES = (
    kernel_device._TICKETS, triton_linear._COUNTERS, triton_rotary._INV_FREQ, layer_base._ROW_STARTS,
    triton_attention._NO_PARTIALS,
)  # fmt: skip


@contextlib.contextmanager
def fake_cuda():
    """Fake tensors (created inside) on the CPU that report is_cuda, so the ops take their CUDA
    paths; yields the mode (mode.from_tensor makes a real tensor's fake twin). The kernels' device
    caches are as they were afterwards."""
    saved = [{key: list(v) if isinstance(v, list) else v for key, v in cache.items()} for cache in _DEVICE_CACHES]
    torch.Tensor.is_cuda = property(lambda t: isinstance(t, FakeTensor) or _IS_CUDA.__get__(t))
    try:
        with FakeTensorMode(allow_non_fake_inputs=True) as mode:
            yield mode
    finally:
        del torch.Tensor.is_cuda
        for cache, before in zip(_DEVICE_CACHES, saved, strict=True):
            cache.clear()
            cache.update(before)


def _faked(obj, mode: FakeTensorMode):
    """obj with every tensor in its dataclass fields (nested) replaced by its fake twin, in place."""
    if torch.is_tensor(obj):
        return mode.from_tensor(obj)
    if dataclasses.is_dataclass(obj) and not obj.__dataclass_params__.frozen:
        for f in dataclasses.fields(obj):
            setattr(obj, f.name, _faked(getattr(obj, f.name), mode))
    return obj


def _decode_plan(batch: int, context: int, block_size: int, lora_slots) -> PassPlan:
    pages = -(-(context + 1) // block_size)
    n = batch
    return PassPlan(
        pass_id=0, req_ids=[f"s{i}" for i in range(n)], num_decode_rows=n,
        input_ids=np.ones(n, np.int32), positions=np.full(n, context, np.int32),
        slot_mapping=np.arange(n, dtype=np.int64) * pages * block_size + context,
        query_start_loc=np.arange(n + 1, dtype=np.int32), seq_lens=np.full(n, context + 1, np.int32),
        block_tables=np.arange(n * pages, dtype=np.int32).reshape(n, pages), state_slots=np.arange(n, dtype=np.int32),
        has_initial_state=np.ones(n, bool), sample_rows=np.ones(n, bool), prompt_logprob_rows=np.zeros(n, bool),
        lora_slots=lora_slots,
    )  # fmt: skip


def fake_pass(
    config,
    plan: PassPlan,
    sizes: PoolSizes,
    launches: contextlib.AbstractContextManager,
    prepare=None,
    kernels: KernelOptions | None = None,
) -> None:
    """One eager forward of `plan` and its logits at `config`'s shape (bfloat16, the family's model
    class) on fake tensors that report CUDA, run inside `launches` (what records them). prepare(model):
    the model's set-up before the pass (adapters), returning build_forward_context's extra kwargs;
    kernels: the kernel options of the pass (default: the defaults)."""
    with fake_cuda() as mode:
        torch.set_default_dtype(torch.bfloat16)
        try:
            model = build_model(config, dtype=torch.bfloat16, device="cpu")
            extra = prepare(model) if prepare is not None else {}
            pool = StatePool(model, sizes, dtype=torch.bfloat16, device="cpu")
            indices, _ = logits_rows(plan)
            with _disable_current_modes():  # made on the host, then faked
                ctx = build_forward_context(plan, model.config, model.layout, "cpu", indices, kernels=kernels, **extra)
            ctx = _faked(ctx, mode)
            with torch.no_grad(), launches:
                hidden = model(ctx, pool.layer_states)
                model.compute_logits(hidden[ctx.logits_indices])
        finally:
            torch.set_default_dtype(torch.float32)


def decode_launches(
    preset: str, batch: int, adapters: int, *, rank: int = 16, context: int = 64, fp8: bool = False
) -> collections.Counter:
    """Launches of one eager decode step of `batch` rows on `adapters` distinct adapters (0: none)
    at the preset's shape (bfloat16, adapters on every projection and routed expert; fp8: block-FP8
    projections and experts, as `quantization="fp8"` loads them)."""
    counts: collections.Counter = collections.Counter()
    plan, sizes = decode_pass(batch, adapters, context=context)
    config = _config(preset, fp8)
    fake_pass(config, plan, sizes, count_launches(counts), prepare=with_adapters(adapters, rank))
    return counts


def _config(preset: str, fp8: bool):
    """The preset's config, its projections and experts in block FP8 when asked."""
    from deltaserve.layers.config import Fp8Scheme

    config = preset_config(preset)
    return dataclasses.replace(config, quantization=Fp8Scheme()) if fp8 else config


def decode_pass(batch: int, adapters: int = 0, *, context: int = 64) -> tuple[PassPlan, PoolSizes]:
    """A decode step of `batch` rows at `context` tokens on 16-token pages (rows on `adapters`
    distinct adapter slots, 0: none), and the pool sizes it needs."""
    block_size = 16
    slots = np.arange(batch, dtype=np.int32) % adapters if adapters else None
    return _decode_plan(batch, context, block_size, slots), PoolSizes(batch * (context // block_size + 2), 16, batch)


def with_adapters(adapters: int, rank: int = 16):
    """fake_pass's `prepare`: `adapters` rank-`rank` adapter slots on every projection and routed
    expert, all present (0: none)."""

    def prepare(model) -> dict:
        if not adapters:
            return {}
        lora_layers.enable_lora(model, max_loras=adapters, max_lora_rank=rank)
        for s in range(adapters):
            for owner_slots in lora_layers._all_slots(model):
                owner_slots.present[s] = True
        return dict(num_lora_slots=adapters, moe_lora_route=lora_layers.MoeLoraRoute.FOLD)

    return prepare


def fresh_prompt_captures(tokens: int) -> tuple[int, ...]:
    """A fresh prompt's usual prefix-cache captures (CapturePolicy's defaults, 16-token blocks):
    every 1,024 tokens, its last block boundary before its last token, its end."""
    return tuple(sorted({*range(1024, tokens, 1024), (tokens - 1) // 16 * 16, tokens}))


def prefill_pass(tokens: int, captures: tuple[int, ...]) -> tuple[PassPlan, PoolSizes]:
    """One fresh prompt of `tokens` tokens on 16-token pages and slot 0, with captures at these offsets
    into snapshot slots 1.., and the pool sizes it needs."""
    block_size = 16
    pages = -(-tokens // block_size)
    plan = PassPlan(
        pass_id=0, req_ids=["p0"], num_decode_rows=0, input_ids=np.ones(tokens, np.int32),
        positions=np.arange(tokens, dtype=np.int32), slot_mapping=np.arange(tokens, dtype=np.int64),
        query_start_loc=np.array([0, tokens], np.int32), seq_lens=np.array([tokens], np.int32),
        block_tables=np.arange(pages, dtype=np.int32)[None], state_slots=np.zeros(1, np.int32),
        has_initial_state=np.zeros(1, bool), sample_rows=np.ones(1, bool), prompt_logprob_rows=np.zeros(1, bool),
    )  # fmt: skip
    if captures:
        plan.captures = np.array([[0, off, 1 + i] for i, off in enumerate(captures)], np.int32)
    return plan, PoolSizes(pages + 1, block_size, 1, num_snapshots=max(1, len(captures)))


def prefill_launches(
    preset: str, tokens: int, captures: tuple[int, ...] = (), *, fp8: bool = False
) -> collections.Counter:
    """Launches of one eager prefill pass of one fresh prompt of `tokens` tokens at the preset's shape
    (bfloat16; fp8 as decode_launches), with prefix-cache captures at these offsets
    (fresh_prompt_captures: the usual ones)."""
    counts: collections.Counter = collections.Counter()
    plan, sizes = prefill_pass(tokens, captures)
    fake_pass(_config(preset, fp8), plan, sizes, count_launches(counts))
    return counts


def spec_step_launches(preset: str, batch: int, k: int, *, context: int = 64) -> collections.Counter:
    """Launches of one eager speculative step (what the engine's verify graph holds: the target over
    k + 1 tokens a row, the argmax, the acceptance, write-on-accept, the MTP head's catch-up and its
    k - 1 draft steps; workers/spec_graphs.py) of `batch` greedy verify rows at the preset's shape."""
    from deltaserve.layers.kernels import argmax as argmax_kernels
    from deltaserve.layers.mtp import MtpHead
    from deltaserve.workers.rejection import accept_drafts
    from deltaserve.workers.spec_decode import SpecDecoder

    from .spec import scratch_plan

    config = dataclasses.replace(preset_config(preset), num_mtp_layers=1)
    counts: collections.Counter = collections.Counter()
    block_size = 16
    with fake_cuda() as mode:
        torch.set_default_dtype(torch.bfloat16)
        try:
            model = HybridModel(config)
            model.mtp = MtpHead(config, model.layout)
            pages = batch * ((context + 2 * k + 2) // block_size + 2)
            pool = StatePool(model, PoolSizes(pages, block_size, batch), dtype=torch.bfloat16, device="cpu")
            pool.enable_verify(model, rows=batch, length=k + 1)
            spec = SpecDecoder(model, pool, k)
            plan = scratch_plan(batch, context, k + 1, block_size, config.vocab_size, k)
            indices, _ = logits_rows(plan)
            with _disable_current_modes():
                ctx = build_forward_context(plan, model.config, model.layout, "cpu", indices)
            ctx = _faked(ctx, mode)
            with torch.no_grad(), count_launches(counts):
                hidden = model(ctx, pool.layer_states)
                sampled = argmax_kernels.row_argmax(logits=model.compute_logits(hidden)).view(batch, k + 1)
                accepted = accept_drafts(sampled, ctx.input_ids.view(batch, k + 1)[:, 1:])
                spec.after_sampling(plan, ctx, hidden, sampled, accepted, None, [-1] * batch)
        finally:
            torch.set_default_dtype(torch.float32)
    return counts


def _print_counts(label: str, counts: collections.Counter, by_kernel: bool) -> None:
    triton_n = sum(v for k, v in counts.items() if k.startswith("triton."))
    print(f"{label}: {sum(counts.values())} launches ({triton_n} Triton)")
    if by_kernel:
        for name, v in sorted(counts.items(), key=lambda kv: -kv[1]):
            print(f"  {v:6d} {name}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="qwen3_5_35b_a3b", choices=sorted(PRESETS))
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--adapters", default="0,1,8", help="distinct adapters (0: none), comma list")
    p.add_argument("--spec-k", type=int, default=0, help="also one speculative step with k drafts (MTP head)")
    p.add_argument("--prefill", type=int, default=0, help="also one prefill pass of a fresh prompt of this many tokens")
    p.add_argument("--fp8", action="store_true", help="block-FP8 projections and experts (quantization fp8)")
    p.add_argument("--by-kernel", action="store_true")
    args = p.parse_args(argv)
    for n in (int(a) for a in args.adapters.split(",") if a):
        counts = decode_launches(args.preset, args.batch, n, fp8=args.fp8)
        _print_counts(f"batch {args.batch}, {n} adapter(s)", counts, args.by_kernel)
    if args.prefill:
        n = args.prefill
        caps = fresh_prompt_captures(n)
        counts = prefill_launches(args.preset, n, caps, fp8=args.fp8)
        _print_counts(f"prefill of {n} tokens, captures at {caps}", counts, args.by_kernel)
    if args.spec_k:
        counts = spec_step_launches(args.preset, args.batch, args.spec_k)
        _print_counts(f"batch {args.batch}, speculative step k = {args.spec_k}", counts, args.by_kernel)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
