"""Prefill CUDA graphs (workers/prefill_graphs.py), checked on the CPU through their static forward:
the same buffers, padding (the idle stream on the scratch slot and page), fixed host ints and
device-side captures the graph replays, run eagerly (`capture=False`).

Each graphed pass is also run on the normal eager path from the same pool contents: logits and
every pool tensor after the pass (KV pages, GDN state and conv windows, prefix-cache snapshot slots
the pass captured into) must agree, all but the scratch page and slot, which only the padding
touches. End to end, the engine's tokens and logprobs equal those of an engine without the cache
and without graphs, and snapshots the graphed passes captured serve later hits."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from logprob_checks import assert_entries_close
from prefill_checks import CheckedGraphs
from tiny_models import FAMILIES, VOCAB_SIZE

from deltaserve import LLM, SamplingParams
from deltaserve.layers.kernels import conv1d as conv_kernels
from deltaserve.layers.kernels import gdn as gdn_kernels
from deltaserve.layers.kernels.gdn import chunk as triton_chunk
from deltaserve.layers.kernels.gdn.fixed_captures import NUM_FIELDS, FixedCaptures, max_chunks
from deltaserve.layers.kernels.gdn.state import StateCapture, StateCaptures
from deltaserve.workers.prefill_graphs import CAPTURE_CAPACITY, token_buckets
from deltaserve.workers.warmup import warmup_plan as _warmup_plan

GREEDY = SamplingParams(temperature=0, max_tokens=4, logprobs=3)
# odd lengths, a block's end and one past it, a GDN chunk's end and one past it, several chunks
# (split between the two tests: each length costs two engine runs per family)
SHORT_LENGTHS = [1, 16, 17, 65]
HIT_LENGTHS = [15, 63, 64, 200]


def ids(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB_SIZE, (n,), generator=g).tolist()


def same_outputs(got, want, atol: float = 1e-4) -> None:
    """Identical greedy tokens, logprobs within atol: against an engine without the cache, whose float32
    sums run over other row counts (CheckedGraphs holds each graphed pass to 1e-5 of its eager run, relative
    to the logits' scale)."""
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    for a, b in zip(got, want, strict=True):
        assert_entries_close(a.outputs[0].logprobs, b.outputs[0].logprobs, atol=atol)


@pytest.fixture(scope="module", params=[f for f in FAMILIES if f != "qwen3_5"])  # MoE and dense GDN stacks
def engines(request, tiny_checkpoints):
    path, _ = tiny_checkpoints[request.param]
    # small pools: every checked pass clones and compares them whole
    kw = dict(max_num_seqs=4, max_num_batched_tokens=256, max_model_len=1024, dtype="float32", num_kv_blocks=320)
    kw.update(num_prefix_snapshots=16)
    on = LLM(str(path), prefix_snapshot_interval=128, **kw)
    off = LLM(str(path), enable_prefix_caching=False, **kw)
    runner = on.engine.executor.runner
    assert runner.prefill_graphs is None  # CPU: no graphs unless a test puts the static forward there
    runner.prefill_graphs = CheckedGraphs(runner, runner._capture_prefill_graphs(capture=False))
    return on, off, runner.prefill_graphs


@pytest.mark.parametrize("length", SHORT_LENGTHS)
def test_short_prompt_matches_eager(engines, length):
    on, off, checked = engines
    on.reset_prefix_cache()
    before = checked.passes
    prompt = ids(length, seed=length)
    same_outputs(on.generate([prompt], GREEDY, use_tqdm=False), off.generate([prompt], GREEDY, use_tqdm=False))
    assert checked.passes == before + 1  # the prompt's one prefill pass took the graph path
    assert checked.logit_diff <= 1e-5 and checked.pool_diff <= 1e-5


@pytest.mark.parametrize("length", HIT_LENGTHS)
def test_prefix_hit_matches_eager_and_its_snapshots_serve_later_hits(engines, length):
    on, off, checked = engines
    on.reset_prefix_cache()
    prefix = ids(150, seed=7)
    on.generate([prefix + ids(9, seed=8)], GREEDY, use_tqdm=False)  # snapshots at 128, 144 (its last block), 159
    prompt = prefix + ids(length, seed=length)
    before, captured = checked.passes, checked.with_captures
    hit = on.generate([prompt], GREEDY, use_tqdm=False)
    assert hit[0].num_cached_tokens == 144
    same_outputs(hit, off.generate([prompt], GREEDY, use_tqdm=False))
    assert checked.passes == before + 1 and checked.with_captures == captured + 1  # with its snapshots
    # the same prompt again, and one going on from it: they resume from what the graphed pass captured
    longer = prompt + ids(20, seed=99)
    again = on.generate([prompt, longer], GREEDY, use_tqdm=False)
    assert again[0].num_cached_tokens >= len(prompt) - 16 and again[1].num_cached_tokens >= len(prompt) - 16
    same_outputs(again, off.generate([prompt, longer], GREEDY, use_tqdm=False))
    assert checked.logit_diff <= 1e-5 and checked.pool_diff <= 1e-5


def test_ineligible_passes_run_eagerly(engines):
    on, off, checked = engines
    on.reset_prefix_cache()
    before = checked.passes
    # chunks of 256, 256 and 88 tokens: the first two are graphed (the second on the first's state);
    # the last one's block table outruns the graphs' span (the model's 512 positions): eager
    long_prompt = ids(600, seed=3)
    two = [ids(30, seed=4), ids(40, seed=5)]  # one pass of two rows
    logprob = SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=2)
    same_outputs(
        on.generate([long_prompt], GREEDY, use_tqdm=False), off.generate([long_prompt], GREEDY, use_tqdm=False)
    )
    assert checked.passes == before + 2
    same_outputs(on.generate(two, GREEDY, use_tqdm=False), off.generate(two, GREEDY, use_tqdm=False))
    assert checked.passes == before + 2
    got = on.generate([two[0]], logprob, use_tqdm=False)
    want = off.generate([two[0]], logprob, use_tqdm=False)
    assert got[0].outputs[0].token_ids == want[0].outputs[0].token_ids
    assert checked.passes == before + 2
    assert checked.logit_diff <= 1e-5 and checked.pool_diff <= 1e-5


def test_buckets_past_the_models_positions(tiny_checkpoints):
    """A pass budget above the model's positions (buckets up to 1,024 tokens, 256 positions): the
    largest bucket's idle stream spans more pages than any row may, its placeholder stages (as the
    capture at start-up does for every key), and a prompt through the static forward gives the eager
    pass's logits and pools."""
    path, _ = tiny_checkpoints["qwen3_5_moe"]
    kw = dict(max_num_seqs=2, max_num_batched_tokens=1024, max_model_len=256, dtype="float32", num_kv_blocks=160)
    llm = LLM(str(path), enable_prefix_caching=False, **kw)
    runner = llm.engine.executor.runner
    graphs = runner._capture_prefill_graphs(capture=False)  # stages every key's placeholder
    page = runner.sizes.block_size
    assert graphs.buckets[-1] == 1024 and graphs.table_width == -(-1025 // page) > graphs.max_pages
    runner.prefill_graphs = checked = CheckedGraphs(runner, graphs)
    prompt = ids(200, seed=11)
    graphed = llm.generate([prompt], GREEDY, use_tqdm=False)
    runner.prefill_graphs = None
    same_outputs(graphed, llm.generate([prompt], GREEDY, use_tqdm=False), atol=1e-5)
    assert checked.passes == 1 and checked.logit_diff <= 1e-5 and checked.pool_diff <= 1e-5


def test_can_run(engines):
    graphs = engines[2].graphs
    # the default buckets up to the pass budget (256 here: none above what one pass may hold)
    assert graphs.buckets == (16, 32, 64, 128, 256) and graphs.max_rows == 1 and graphs.with_captures
    assert graphs.can_run(_warmup_plan(((0, 100),), 16)) and graphs.can_run(_warmup_plan(((300, 1),), 16)) is False
    assert graphs.can_run(_warmup_plan(((40, 200),), 16)) and graphs.can_run(_warmup_plan(((0, 256),), 16))
    assert not graphs.can_run(_warmup_plan(((0, 257),), 16))  # above the largest bucket
    assert not graphs.can_run(_warmup_plan(((0, 30), (0, 40)), 16))  # two rows
    assert not graphs.can_run(_warmup_plan(((30, 1), (0, 50)), 16))  # a decode row
    plan = _warmup_plan(((0, 100),), 16)
    plan.prompt_logprob_rows = np.array([True])
    assert not graphs.can_run(plan)
    plan.prompt_logprob_rows = np.array([False])
    plan.lora_slots = np.array([0], np.int32)
    assert not graphs.can_run(plan)
    plan.lora_slots = np.array([-1], np.int32)
    plan.captures = np.array([[0, 20 * i, 10 + i] for i in range(1, CAPTURE_CAPACITY + 1)], np.int32)
    assert graphs.can_run(plan)
    plan.captures = np.array([[0, 10 * i, 10 + i] for i in range(1, CAPTURE_CAPACITY + 2)], np.int32)
    assert not graphs.can_run(plan)


# ---- the pieces ---------------------------------------------------------------------------------
def test_token_buckets():
    assert token_buckets(512) == (16, 32, 64, 128, 256, 512)
    assert token_buckets(2048) == (16, 32, 64, 128, 256, 512, 1024, 2048)
    assert token_buckets(100) == (16, 32, 64, 100)
    assert token_buckets(8) == (8,)
    assert token_buckets(0) == ()


CAPTURE_SETS = [
    [(0, 200, 5)],  # the row's end (its last chunk's store)
    [(0, 200, 5), (0, 192, 6)],  # a hit's usual pair: the prompt end and the last block boundary
    [(0, 7, 5), (0, 64, 6), (0, 100, 7), (0, 120, 8)],  # in the first chunk, a boundary, two in one chunk
    [(0, 130, 5), (1, 3, 6), (1, 20, 7)],  # the second stream, both in its first chunk
]


@pytest.mark.parametrize(
    "items, initial, impl",
    [
        *((c, i, "dispatch") for c in CAPTURE_SETS for i in (False, True)),
        ([(0, 64, 5), (0, 66, 6), (1, 3, 7)], True, "triton"),
    ],
)
def test_fixed_captures_write_what_state_captures_write(items, initial, impl):
    """The chunked rule and the conv with FixedCaptures (device tensors, padded entries on a
    scratch slot) leave exactly the states and windows StateCaptures leave. impl "triton": the
    chunked kernels and the replay's recurrent kernel (rows of no tokens skipped) under the
    interpreter."""
    torch.manual_seed(0)
    triton_impl = impl == "triton"
    dev = "cuda" if triton_impl and torch.cuda.is_available() else "cpu"  # else the interpreter
    lens = (200, 30, 5) if impl == "dispatch" else (67, 4, 2)  # the last stream stands for the idle one
    t, hk, hv, kd, vd, slots, scratch = sum(lens), 2, 4, 16, 8, 12, 3
    q, k = torch.randn(t, hk, kd), torch.randn(t, hk, kd)
    v = torch.randn(t, hv, vd)
    g, beta = -torch.rand(t, hv), torch.rand(t, hv)
    cu = torch.tensor(np.concatenate([[0], np.cumsum(lens)]), dtype=torch.int32)
    state_slots = torch.tensor([0, 1, scratch])
    has_initial = torch.tensor([initial, initial, False])
    pool0 = torch.randn(slots, hv, kd, vd)
    x = torch.randn(t, 24)
    conv0, weight = torch.randn(slots, 24, 3), torch.randn(24, 4)
    eager = StateCaptures(tuple(StateCapture(*c) for c in items), lens)
    fields = np.zeros((NUM_FIELDS, CAPTURE_CAPACITY), np.int64)
    chunk_slots = np.zeros(max_chunks(t, len(lens)), np.int32)
    assert FixedCaptures.stage(fields, chunk_slots, eager, scratch, len(lens) - 1)
    results = []
    fixed = FixedCaptures(torch.from_numpy(chunk_slots).to(dev), torch.from_numpy(fields).to(dev))
    q, k, v, g, beta, cu, state_slots, has_initial, pool0, x, conv0, weight = (
        t.to(dev) for t in (q, k, v, g, beta, cu, state_slots, has_initial, pool0, x, conv0, weight)
    )
    for captures in (eager, fixed):
        pool, conv = pool0.clone(), conv0.clone()
        chunk_op = triton_chunk.chunk_gated_delta_rule if triton_impl else gdn_kernels.chunk_gated_delta_rule
        out = chunk_op(
            q=q, k=k, v=v, g=g, beta=beta, cu_seqlens=cu, state_pool=pool, state_slots=state_slots,
            has_initial_state=has_initial, captures=captures,
        )  # fmt: skip
        y = conv_kernels.causal_conv1d_varlen(
            x=x, weight=weight, cu_seqlens=cu, conv_state_pool=conv, state_slots=state_slots,
            has_initial_state=has_initial, captures=captures,
        )  # fmt: skip
        results.append((out, y, pool, conv))
    (out_a, y_a, pool_a, conv_a), (out_b, y_b, pool_b, conv_b) = results
    assert torch.equal(out_a, out_b) and torch.equal(y_a, y_b)
    keep = [s for s in range(slots) if s != scratch]
    if triton_impl:  # the eager captures' replays run only their tokens too: the same arithmetic
        assert torch.equal(pool_a[keep], pool_b[keep])
    assert torch.equal(conv_a[keep], conv_b[keep])
    assert torch.allclose(pool_a[keep], pool_b[keep], atol=1e-6, rtol=0)
    for c in items:  # every capture slot was written
        assert not torch.equal(pool_b[c[2]], pool0[c[2]]) and not torch.equal(conv_b[c[2]], conv0[c[2]])


def test_too_many_captures_are_refused():
    lens = (200, 1)
    offsets = range(200 - 10 * CAPTURE_CAPACITY, 201, 10)  # one more than the graphs hold
    items = tuple(StateCapture(0, offset, 5 + i) for i, offset in enumerate(offsets))
    fields = np.zeros((NUM_FIELDS, CAPTURE_CAPACITY), np.int64)
    chunk_slots = np.zeros(max_chunks(201, 2), np.int32)
    assert not FixedCaptures.stage(fields, chunk_slots, StateCaptures(items, lens), 3, 1)


def test_fresh_row_takes_sdpa_over_its_padded_tokens(tiny_checkpoints, monkeypatch):
    """prefill_attention "sdpa": a fresh prompt's graphed pass (its one row, then the idle stream)
    attends by causal SDPA over all of its bucket's tokens, exact for the row's queries (the idle
    stream's rows are dropped): the eager pass's logits and pools. A prefix hit's graphed pass (keys
    cached before its row) keeps the paged kernel."""
    from deltaserve.layers.kernels.attention import naive as attn_naive

    monkeypatch.setenv("DELTASERVE_PREFILL_ATTENTION", "sdpa")
    path, _ = tiny_checkpoints["qwen3_5_moe"]
    kw = dict(max_num_seqs=2, max_num_batched_tokens=256, max_model_len=1024, dtype="float32", num_kv_blocks=160)
    on = LLM(str(path), prefix_snapshot_interval=128, num_prefix_snapshots=16, **kw)
    runner = on.engine.executor.runner
    graphs = runner._capture_prefill_graphs(capture=False)
    assert graphs.fresh_buckets == set(graphs.buckets) and (64, 1, True, True) in graphs.keys
    runner.prefill_graphs = checked = CheckedGraphs(runner, graphs)
    taken = []
    real = attn_naive.causal_sdpa
    monkeypatch.setattr(
        attn_naive, "causal_sdpa", lambda **a: taken.append((a["q"].shape[0], a["k"].shape[0])) or real(**a)
    )
    on.generate([ids(50, seed=21)], GREEDY, use_tqdm=False)
    # the graph's pass: 50 tokens and 15 idle ones, causal over all 65; then its eager check: 50 over 50
    assert taken[:2] == [(65, 65), (65, 65)] and taken[2:4] == [(50, 50), (50, 50)]
    assert checked.passes == 1 and checked.logit_diff <= 1e-5 and checked.pool_diff <= 1e-5
    taken.clear()
    on.generate([ids(50, seed=21) + ids(30, seed=22)], GREEDY, use_tqdm=False)  # a hit on the first's blocks
    assert checked.passes == 2 and checked.logit_diff <= 1e-5 and checked.pool_diff <= 1e-5
    # the graph's pass paged; only its eager check takes SDPA, over the 80 keys (cached ones first)
    assert len(taken) == 2 and all(q < k == 80 for q, k in taken), taken


def test_auto_takes_sdpa_in_graphs_from_its_threshold(tiny_checkpoints, monkeypatch):
    """prefill_attention "auto" (the default): fresh rows' graphs take SDPA from SDPA_MIN_QUERIES tokens
    (their padding counted; 100 here); smaller buckets stay paged."""
    from deltaserve.layers import attention as attention_layer

    monkeypatch.setattr(attention_layer, "SDPA_MIN_QUERIES", 100)
    path, _ = tiny_checkpoints["qwen3_5_moe"]
    kw = dict(max_num_seqs=2, max_num_batched_tokens=256, max_model_len=1024, dtype="float32", num_kv_blocks=160)
    llm = LLM(str(path), **kw)
    graphs = llm.engine.executor.runner._capture_prefill_graphs(capture=False)
    assert graphs.fresh_buckets == {128, 256} and (128, 1, True, True) in graphs.keys
    assert (64, 1, True, True) not in graphs.keys
