"""The start-up warm-up batches (run on the GPU before serving, so that no kernel compiles on a
user's request): each is a valid plan (the worker's own checks pass) whose rows are what it says,
and the runner runs all of them on a scratch pool (here on CPU, with a tiny model)."""

# test phase: parallel (its child processes compile kernels and exit)

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch
import triton
import triton.language as tl

from deltaserve.cluster.config import EngineConfig
from deltaserve.layers.config import ModelConfig
from deltaserve.workers.plan import PoolSizes
from deltaserve.workers.runner import ModelRunner
from deltaserve.workers.state_pool import StatePool
from deltaserve.workers.warmup import WARMUP_BATCHES, profile_plan, warmup_fits, warmup_plan
from deltaserve.workers.wire import check_plan_ranges, decode_plan, encode_plan

SIZES = PoolSizes(num_blocks=1024, block_size=16, num_slots=32)


@pytest.mark.parametrize("streams", WARMUP_BATCHES)
def test_warmup_plans_are_valid(streams):
    plan = decode_plan(encode_plan(warmup_plan(streams, SIZES.block_size)))  # the codec's checks
    check_plan_ranges(plan, SIZES, vocab_size=10)
    assert plan.num_rows == len(streams) and plan.num_tokens == sum(new for _, new in streams)
    cached = np.array([c for c, _ in streams])
    assert np.array_equal(plan.has_initial_state, cached > 0)
    assert np.array_equal(plan.seq_lens, [c + n for c, n in streams])
    decode = [c > 0 and n == 1 for c, n in streams]
    assert plan.num_decode_rows == sum(decode) and all(decode[: plan.num_decode_rows])
    # every new token lands on its own KV slot inside its row's pages
    assert len(set(plan.slot_mapping.tolist())) == plan.num_tokens
    for row, (c, n) in enumerate(streams):
        lo, hi = plan.query_start_loc[row], plan.query_start_loc[row + 1]
        assert np.array_equal(plan.positions[lo:hi], np.arange(c, c + n))
        pages = plan.block_tables[row][plan.positions[lo:hi] // SIZES.block_size]
        assert np.array_equal(plan.slot_mapping[lo:hi] // SIZES.block_size, pages)


def test_profile_plan_is_one_prompt():
    plan = profile_plan(100, 16)
    assert plan.num_rows == 1 and plan.num_tokens == 100 and plan.block_tables.shape == (1, 7)
    assert np.array_equal(plan.slot_mapping, np.arange(100))


def test_warmup_fits_the_budget_and_pool():
    small = PoolSizes(num_blocks=8, block_size=16, num_slots=4)
    assert warmup_fits(((0, 64),), 64, small) and not warmup_fits(((0, 65),), 64, small)
    assert not warmup_fits(((0, 16),) * 4, 1024, small)  # 4 rows need 5 slots (one is scratch)
    assert not warmup_fits(((0, 128),), 1024, small)  # 8 pages of the 8 (one is scratch)


def test_runner_runs_every_fitting_warmup_batch(tiny_checkpoints, monkeypatch):
    path = str(tiny_checkpoints["qwen3_5_moe"][0])
    config = EngineConfig.from_kwargs(model=path, max_num_batched_tokens=2048).worker_config()
    runner = ModelRunner(config, ModelConfig.from_pretrained(path))
    ran = []
    forward = runner._forward
    monkeypatch.setattr(runner, "_forward", lambda plan, pool: ran.append(plan.num_tokens) or forward(plan, pool))
    pool = StatePool(runner.model, SIZES, dtype=runner.dtype, device=runner.device)
    runner.compile_warmup(pool)
    expected = [sum(n for _, n in b) for b in WARMUP_BATCHES if warmup_fits(b, 2048, SIZES)]
    # then one prompt of the whole budget (the profiling pass's shape); over the budget: skipped
    assert ran == [*expected, 2048] and 3072 not in ran


def test_warmup_runs_the_greedy_argmax_in_both_logit_dtypes(tiny_checkpoints, monkeypatch):
    """The sampler's Triton kernel (the greedy argmax) runs after each warm-up pass on the model's
    logits and on their float32 copy (what penalties leave), so a server's first greedy request
    does not compile it (a first-use compile stalls every running request)."""
    from deltaserve.workers import sampler as sampler_module

    path = str(tiny_checkpoints["qwen3_5_moe"][0])
    config = EngineConfig.from_kwargs(model=path, dtype="bfloat16", max_num_batched_tokens=2048).worker_config()
    runner = ModelRunner(config, ModelConfig.from_pretrained(path))
    seen = []
    real = sampler_module.argmax_kernels.row_argmax
    monkeypatch.setattr(
        sampler_module.argmax_kernels,
        "row_argmax",
        lambda *, logits, **kw: seen.append(logits.dtype) or real(logits=logits, **kw),
    )
    pool = StatePool(runner.model, SIZES, dtype=runner.dtype, device=runner.device)
    runner.compile_warmup(pool)
    passes = sum(warmup_fits(b, 2048, SIZES) for b in WARMUP_BATCHES) + 1  # and the full-budget prompt
    assert seen == [torch.bfloat16, torch.float32] * passes


def test_warmup_reaches_every_gdn_chunk_variant():
    """At the serving default budget (8,192 tokens) and Qwen3.5-35B-A3B's GDN shape (32 value heads
    of 128) on an H200's 132 SMs, the warm-up (with the profiling pass of one full-budget prompt)
    runs each chunk variant the default picker can choose, so none compiles mid-serving."""
    from deltaserve.layers.kernels.gdn.chunk import pick_variant

    prefills = [[n for cached, n in b if not (n == 1 and cached > 0)] for b in WARMUP_BATCHES]
    prefills.append([8192])  # the profiling pass
    sizes = PoolSizes(num_blocks=8192 // 16 + 1, block_size=16, num_slots=1 + max(len(b) for b in WARMUP_BATCHES))
    fitting = [p for p, b in zip(prefills, [*WARMUP_BATCHES, ((0, 8192),)], strict=True) if warmup_fits(b, 8192, sizes)]
    picked = {pick_variant(len(p), 32, 128, 132, sum(p)) for p in fitting if p}
    assert picked == {"fused", "split32_win", "fused_pf"}  # split32_win: split32's kernels, windowed


def test_warmup_reaches_the_split_prefill_attention():
    """At the serving default budget, on an H200's 132 SMs and Qwen3.5-35B-A3B's attention (16 q
    heads, 2 kv heads, head dim 256), a warm-up batch takes the split-K prefill and its merge kernel
    (a prefix-cache hit's first use would compile it mid-serving otherwise)."""
    from deltaserve.layers.kernels.attention import triton_attention as ta

    h200 = ta.DeviceInfo("NVIDIA H200", 132, 227 * 1024, (9, 0))
    block_q = ta._prefill_config(256, 8, 2, h200)["block_m"] // 8
    sizes = PoolSizes(num_blocks=8192 // 16 + 1, block_size=16, num_slots=1 + max(len(b) for b in WARMUP_BATCHES))
    splits = []
    for streams in WARMUP_BATCHES:
        prefill = [(c, n) for c, n in streams if not (n == 1 and c > 0)]
        if prefill and warmup_fits(streams, 8192, sizes):
            programs = (sum(n for _, n in prefill) // block_q + len(prefill)) * 2
            width = max(-(-(c + n) // 16) for c, n in prefill) * 16
            splits.append(ta._prefill_splits(programs, width, h200))
    assert max(splits) > 1


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_warmup_launches_every_variant_of_short_mixed_passes_in_few_slots(fp8):
    """An engine of few sequences captures no decode graph past its batch, so its short mixed passes
    (a decode row beside a prompt chunk) meet token-count classes only the warm-up reaches: at
    Qwen3.5-35B-A3B's shape on an "H200" (launches recorded on fake tensors, `bench.sm90
    --warmup-coverage`, in a child process without TRITON_INTERPRET), every Triton variant a pass of
    5 to 128 tokens launches is launched by a warm-up batch that fits a 3-slot pool (the FP8 run at
    03df658 compiled a 16-row skinny GEMM mid-run, at batch 8)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    # two periods of the layer types launch what all 40 layers do (the test below)
    command = [sys.executable, "-m", "deltaserve.bench.sm90", "--warmup-coverage", "3", "--layers", "8"]
    command += ["--fp8"] if fp8 else []
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    assert done.stdout.count("covered") == 10, done.stdout[-2000:]


def test_two_periods_of_layers_launch_what_the_whole_model_does():
    """The coverage check runs the model's first 8 layers (two periods of 3 GDN + 1 attention): a warm-up
    batch's and a short mixed pass's distinct Triton launches are those of all 40 layers, bf16 and FP8
    (launches recorded on fake tensors in a child process without TRITON_INTERPRET)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    assert done.stdout.split()[-2:] == ["equal", "4"], done.stdout[-2000:]


def _launch_sets_equal() -> None:
    """(In the child.) Full model against its first 8 layers on two plans, bf16 and FP8."""
    import dataclasses

    from deltaserve.bench import sm90
    from deltaserve.bench.presets import preset_config
    from deltaserve.layers.config import Fp8Scheme
    from deltaserve.workers.plan import PoolSizes
    from deltaserve.workers.warmup import warmup_plan

    sizes = PoolSizes(num_blocks=1024, block_size=16, num_slots=3)
    plans = [warmup_plan(((40, 1), (17, 1), (300, 200), (0, 99)), 16), warmup_plan(((100, 1), (0, 15)), 16)]
    equal = 0
    for fp8 in (False, True):
        whole = preset_config("qwen3_5_35b_a3b")
        if fp8:
            whole = dataclasses.replace(whole, quantization=Fp8Scheme())
        cut = sm90.first_layers(whole, 8)
        assert cut.num_layers == 8 and whole.num_layers == 40
        for plan in plans:
            a, b = set(sm90.recorded_plan(whole, plan, sizes)), set(sm90.recorded_plan(cut, plan, sizes))
            assert a == b, sorted(f"{x.name}{dict(x.constexprs)}" for x in a ^ b)[:5]
            equal += 1
    print("equal", equal)


def test_late_compile_log_records_and_warns(caplog):
    """The JIT hooks the runner installs after start-up: a compile is timed, kept and logged as a
    warning naming the kernel; the before-hook never asks Triton to skip the compile."""
    from deltaserve.workers.compile_watch import LateCompileLog

    late = LateCompileLog()
    assert late.before(key="k1", repr="_linear_kernel[num_warps=4](x: *bf16)") is None
    with caplog.at_level("WARNING", logger="deltaserve.workers.compile_watch"):
        late.after(key="k1", repr="_linear_kernel[num_warps=4](x: *bf16)")
    assert [r for r, _ in late.events] == ["_linear_kernel[num_warps=4](x: *bf16)"]
    assert late.events[0][1] >= 0
    assert "_linear_kernel" in caplog.text and "after start-up" in caplog.text


def test_late_compile_log_ignores_start_ups(caplog, tiny_checkpoints, monkeypatch):
    """Compiles inside compile_watch.starting() (a runner's start-up: the hooks are process-wide, and
    the log of a runner started earlier in the process would report the next one's warm-up and graph
    captures) are neither kept nor logged, nested or not; a runner's construction and allocate hold
    it, and a compile after them is kept."""
    from deltaserve import LLM
    from deltaserve.workers import compile_watch
    from deltaserve.workers.compile_watch import LateCompileLog
    from deltaserve.workers.runner import ModelRunner

    late = LateCompileLog()

    def compile_(name: str) -> None:
        late.before(key=name, repr=name)
        late.after(key=name, repr=name)

    with caplog.at_level("WARNING", logger="deltaserve.workers.compile_watch"):
        with compile_watch.starting():
            with compile_watch.starting():
                compile_("nested")
            compile_("outer")
        assert not late.events and "after start-up" not in caplog.text
        for method in ("_size_pools", "_capture_graphs"):  # inside __init__ and inside allocate
            original = getattr(ModelRunner, method)

            def hooked(self, *args, _original=original, _name=method, **kwargs):
                compile_(_name)
                return _original(self, *args, **kwargs)

            monkeypatch.setattr(ModelRunner, method, hooked)
        LLM(str(tiny_checkpoints["qwen3_5"][0]), device="cpu", num_kv_blocks=64)
        assert not late.events and "after start-up" not in caplog.text
        compile_("serving")
    assert [r for r, _ in late.events] == ["serving"] and "after start-up" in caplog.text


@pytest.mark.gpu
def test_gpu_late_compile_log_sees_a_real_compile():
    """Installed into this Triton, the hooks see a kernel compiled after installation (their keyword
    signature matches what Triton passes), and the kernel still runs."""
    from deltaserve.workers.compile_watch import LateCompileLog

    before = (triton.knobs.runtime.jit_cache_hook, triton.knobs.runtime.jit_post_compile_hook)
    late = LateCompileLog()
    late.install()
    try:
        x = torch.zeros(5, device="cuda")
        _add_one[(1,)](x, 5, BLOCK=8)
        torch.cuda.synchronize()
    finally:
        triton.knobs.runtime.jit_cache_hook, triton.knobs.runtime.jit_post_compile_hook = before
    assert torch.equal(x.cpu(), torch.ones(5))
    assert any("_add_one" in r for r, _ in late.events)


@triton.jit
def _add_one(x, n, BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK)
    tl.store(x + i, tl.load(x + i, mask=i < n) + 1, mask=i < n)


if __name__ == "__main__":
    _launch_sets_equal()
