"""Prefix caching for hybrid models: a request that shares a prefix with earlier ones skips it (KV pages
by block hash, GDN state from a snapshot at any token offset) and produces exactly what it produces
without the cache. The reference is the same engine with caching off (itself checked against
transformers in test_engine.py).

Logprobs are compared in float64 on the CPU: in float32 the reference alone moves by up to ~3e-5
between a batched and a single run of the same prompt (a matmul's rounding depends on its row
count), so 1e-5 can only be asked of runs whose arithmetic is finer than that. Greedy tokens are
compared in float32 as well."""

from __future__ import annotations

import pytest
import torch
from logprob_checks import assert_entries_close
from tiny_models import FAMILIES, VOCAB_SIZE

from deltaserve import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=6, logprobs=3)
PREFIX_LENGTHS = [1, 15, 16, 17, 63, 64, 65, 100, 511, 513]


def ids(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB_SIZE, (n,), generator=g).tolist()


def same_outputs(got, want) -> None:
    """Identical greedy tokens, and the logprobs of every sampled token (and its top 3) within 1e-5."""
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    for a, b in zip(got, want, strict=True):
        assert_entries_close(a.outputs[0].logprobs, b.outputs[0].logprobs, atol=1e-5)


@pytest.fixture(scope="module", params=FAMILIES)
def engines(request, tiny_checkpoints):
    path, _ = tiny_checkpoints[request.param]
    kw = dict(max_num_seqs=8, max_num_batched_tokens=256, max_model_len=1100, dtype="float64")
    on = LLM(str(path), prefix_snapshot_interval=128, **kw)
    off = LLM(str(path), enable_prefix_caching=False, **kw)
    assert on.engine.prefix_cache is not None and off.engine.prefix_cache is None
    return on, off


def counted(llm: LLM) -> dict[str, int]:
    """Tokens each request actually runs through the model, counted from the scheduler's plans."""
    sched = llm.engine.scheduler
    counts: dict[str, int] = {}
    build = sched._build_plan

    def wrapped(scheduled):
        for req, n in scheduled:
            counts[req.req_id] = counts.get(req.req_id, 0) + n
        return build(scheduled)

    sched._build_plan = wrapped
    return counts


@pytest.mark.parametrize("prefix_len", PREFIX_LENGTHS)
def test_shared_prefix_hits_and_changes_nothing(engines, prefix_len):
    on, off = engines
    on.reset_prefix_cache()
    prefix = ids(prefix_len, seed=prefix_len)
    prompts = [prefix + ids(n, seed=1000 * prefix_len + n) for n in (7, 5, 9, 3)]
    counts = counted(on)
    got = [on.generate([p], GREEDY, use_tqdm=False)[0] for p in prompts]
    want = off.generate(prompts, GREEDY, use_tqdm=False)
    same_outputs(got, want)
    # the second request learns where prompts diverge; the third and fourth hit the whole prefix
    assert got[2].num_cached_tokens == prefix_len and got[3].num_cached_tokens == prefix_len
    for out in got:
        # num_cached_tokens is what was skipped: the rest ran, and every sampled token but the last
        # (async scheduling may already have fed the last one when its request stopped)
        total = len(out.prompt_token_ids) + len(out.outputs[0].token_ids)
        assert out.num_cached_tokens + counts[out.request_id] in (total - 1, total)


def test_float32_tokens_identical_for_every_prefix_length(tiny_checkpoints):
    path, _ = tiny_checkpoints["qwen3_next"]
    on = LLM(str(path), max_num_seqs=8, max_num_batched_tokens=256, max_model_len=1100, prefix_snapshot_interval=128)
    off = LLM(str(path), max_num_seqs=8, max_num_batched_tokens=256, max_model_len=1100, enable_prefix_caching=False)
    params = SamplingParams(temperature=0, max_tokens=8)
    for prefix_len in PREFIX_LENGTHS:
        prefix = ids(prefix_len, seed=prefix_len)
        prompts = [prefix + ids(n, seed=77 * prefix_len + n) for n in (3, 6, 4)]
        got = [on.generate([p], params, use_tqdm=False)[0] for p in prompts]
        want = [off.generate([p], params, use_tqdm=False)[0] for p in prompts]
        assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
        assert got[2].num_cached_tokens == prefix_len


def test_resending_a_conversation_resumes_where_it_ended(engines):
    """Multi-turn: the next turn resends prompt + reply + a new message and skips all of the first two."""
    on, off = engines
    on.reset_prefix_cache()
    first = ids(40, seed=7)
    turn1 = on.generate([first], GREEDY, use_tqdm=False)[0]
    history = first + turn1.outputs[0].token_ids
    turn2 = on.generate([history + ids(6, seed=8)], GREEDY, use_tqdm=False)[0]
    assert turn2.num_cached_tokens == len(history) - 1 or turn2.num_cached_tokens == len(history)
    same_outputs([turn2], off.generate([history + ids(6, seed=8)], GREEDY, use_tqdm=False))


def test_requests_sharing_a_prefix_in_one_batch(engines):
    on, off = engines
    on.reset_prefix_cache()
    prefix = ids(70, seed=3)
    batch1 = [prefix + ids(n, seed=n) for n in (4, 9, 2)]
    batch2 = [prefix + ids(n, seed=50 + n) for n in (5, 1, 8)]
    for batch in (batch1, batch2, batch2):
        same_outputs(on.generate(batch, GREEDY, use_tqdm=False), off.generate(batch, GREEDY, use_tqdm=False))
    assert on.engine.prefix_cache_stats()["hits"] > 0


def test_identical_prompt_resent_hits_its_last_block(engines):
    on, off = engines
    on.reset_prefix_cache()
    prompt = ids(53, seed=5)
    first = on.generate([prompt], GREEDY, use_tqdm=False)[0]
    again = on.generate([prompt], GREEDY, use_tqdm=False)[0]
    assert first.num_cached_tokens == 0 and again.num_cached_tokens == 48
    same_outputs([again], off.generate([prompt], GREEDY, use_tqdm=False))


def test_a_different_salt_never_reuses(engines):
    on, _ = engines
    on.reset_prefix_cache()
    prompt = ids(80, seed=9)
    on.generate([{"prompt_token_ids": prompt, "cache_salt": "a"}], GREEDY, use_tqdm=False)
    other = on.generate([{"prompt_token_ids": prompt, "cache_salt": "b"}], GREEDY, use_tqdm=False)[0]
    same = on.generate([{"prompt_token_ids": prompt, "cache_salt": "a"}], GREEDY, use_tqdm=False)[0]
    plain = on.generate([prompt], GREEDY, use_tqdm=False)[0]
    assert other.num_cached_tokens == 0 and plain.num_cached_tokens == 0 and same.num_cached_tokens > 0


def test_prompt_logprob_requests_get_every_position(engines):
    on, off = engines
    on.reset_prefix_cache()
    prompt = ids(60, seed=12)
    params = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=2)
    on.generate([prompt], GREEDY, use_tqdm=False)
    got = on.generate([prompt], params, use_tqdm=False)[0]
    want = off.generate([prompt], params, use_tqdm=False)[0]
    assert got.num_cached_tokens == 0 and len(got.prompt_logprobs) == len(prompt)
    assert_entries_close(got.prompt_logprobs, want.prompt_logprobs, atol=1e-5)


def test_hit_after_preemption(tiny_checkpoints):
    path, _ = tiny_checkpoints["qwen3_5"]
    kw = dict(max_num_seqs=6, max_num_batched_tokens=64, num_kv_blocks=14, async_scheduling=False)
    on = LLM(str(path), prefix_snapshot_interval=32, **kw)
    off = LLM(str(path), enable_prefix_caching=False, **kw)
    prefix = ids(45, seed=21)
    prompts = [prefix + ids(n, seed=n) for n in (3, 8, 5, 11, 2, 7)]
    params = SamplingParams(temperature=0, max_tokens=20, logprobs=3)
    got = on.generate(prompts, params, use_tqdm=False)
    want = off.generate(prompts, params, use_tqdm=False)
    assert on.engine.scheduler.stats.num_preemptions > 0
    same_outputs(got, want)
    again = on.generate(prompts, params, use_tqdm=False)
    same_outputs(again, want)
    assert on.engine.blocks.num_free == on.engine.blocks.capacity


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_plans_blocks_are_indexed_after_its_launch(tiny_checkpoints, async_scheduling):
    """A prompt's full blocks enter the page index once its pass is launched (that host work overlaps
    the pass), not while the plan is built, and before the next plan: a request arriving after the
    first pass was launched hits the blocks it computed."""
    path, _ = tiny_checkpoints["qwen3_5"]
    llm = LLM(str(path), max_num_batched_tokens=64, prefix_snapshot_interval=32, async_scheduling=async_scheduling)
    engine, cache = llm.engine, llm.engine.blocks.cache
    indexed_at_launch = []
    launch = engine.executor.execute_async

    def spy(plan):
        indexed_at_launch.append(cache.num_cached)
        handle = launch(plan)
        return handle

    engine.executor.execute_async = spy
    prefix = ids(80, seed=41)
    engine.add_request("first", prefix + [5], SamplingParams(temperature=0, max_tokens=2))
    engine.step()  # the first 64 tokens' pass: four full blocks of 16
    assert indexed_at_launch == [0] and cache.num_cached == 4
    engine.add_request("second", prefix[:64] + [7, 8], SamplingParams(temperature=0, max_tokens=2))
    while engine.has_unfinished():
        engine.step()
    assert engine.scheduler.requests == {} and engine.prefix_cache_stats()["hit_tokens"] == 64


def test_small_snapshot_pool_under_many_prefixes_keeps_serving(tiny_checkpoints):
    path, _ = tiny_checkpoints["qwen3_5_moe"]
    on = LLM(str(path), max_num_seqs=4, num_prefix_snapshots=3, prefix_snapshot_interval=16, num_kv_blocks=64)
    off = LLM(str(path), max_num_seqs=4, enable_prefix_caching=False, num_kv_blocks=64)
    prompts = [ids(20 + i % 7, seed=100 + i // 2) + ids(3, seed=i) for i in range(30)]
    params = SamplingParams(temperature=0, max_tokens=4)
    for i in range(0, 30, 5):
        got = on.generate(prompts[i : i + 5], params, use_tqdm=False)
        want = off.generate(prompts[i : i + 5], params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    stats = on.engine.prefix_cache_stats()
    assert stats["snapshots_held"] <= 3 and stats["snapshots_evicted"] > 0
    assert on.engine.blocks.num_free == on.engine.blocks.capacity  # pages held only by snapshots are reclaimable
    on.reset_prefix_cache()
    assert on.engine.prefix_cache_stats()["snapshots_held"] == 0
    assert on.engine.blocks.cache.num_cached == 0


def test_reset_under_load_is_safe(engines):
    on, off = engines
    prefix = ids(90, seed=31)
    prompts = [prefix + ids(n, seed=n) for n in (2, 6, 4, 8)]
    on.generate(prompts[:2], GREEDY, use_tqdm=False)
    engine = on.engine
    for i, p in enumerate(prompts):
        engine.add_request(f"reset-{i}", p, GREEDY)
    final, steps = {}, 0
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
        steps += 1
        if steps % 2:
            assert on.reset_prefix_cache()
    got = [final[f"reset-{i}"] for i in range(len(prompts))]
    same_outputs(got, off.generate(prompts, GREEDY, use_tqdm=False))


def test_cache_counters_are_logged_while_prompts_arrive(engines, caplog):
    """A periodic log line with blocks cached, snapshots held and the hit rate, once new prompts were
    looked up since the last one (an idle engine logs nothing)."""
    import time

    from deltaserve.cluster.core.engine import PREFIX_LOG_INTERVAL_S

    on, _ = engines
    engine = on.engine
    prefix = ids(40, seed=41)
    for n in (3, 5):  # one after the other: the second hits the first's prefix
        on.generate([prefix + ids(n, seed=n)], GREEDY, use_tqdm=False)
    later = time.monotonic() + PREFIX_LOG_INTERVAL_S + 1
    caplog.set_level("INFO", logger="deltaserve.cluster.core.engine")
    engine._log_prefix_stats(now=later)
    stats = engine.prefix_cache_stats()
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("prefix cache:")]
    assert len(lines) == 1
    assert f"{stats['blocks_cached']} blocks cached" in lines[0]
    assert f"{stats['snapshots_held']} of {stats['snapshot_slots']} snapshots held" in lines[0]
    assert f"{stats['hits']} of {stats['queries']} prompts hit" in lines[0] and stats["hits"] >= 1
    engine._log_prefix_stats(now=later + 2 * PREFIX_LOG_INTERVAL_S)  # no prompt since: nothing new
    assert sum(r.getMessage().startswith("prefix cache:") for r in caplog.records) == 1


def test_snapshot_policy_and_interval_are_checked(tiny_checkpoints):
    path, _ = tiny_checkpoints["qwen3_5"]
    with pytest.raises(ValueError, match="prefix_snapshot_policy"):
        LLM(str(path), prefix_snapshot_policy="sometimes")
    with pytest.raises(ValueError, match="prefix_snapshot_interval"):
        LLM(str(path), prefix_snapshot_interval=100)


# budget 5: many one-token prompt chunks planned as decode rows (their snapshots saved at the next pass)
@pytest.mark.parametrize("async_scheduling, seed, budget", [(False, 0, 12), (True, 1, 12), (True, 2, 5)])
def test_random_traffic_under_a_tight_pool(tiny_checkpoints, async_scheduling, seed, budget):
    """Shared prefixes, preemption, evictions of snapshots and cached pages, all at once: the tokens
    are those of the engine without a cache, and every page and slot is free at the end."""
    path, _ = tiny_checkpoints["qwen3_next"]
    kw = dict(
        max_num_seqs=4, block_size=4, num_kv_blocks=16, max_num_batched_tokens=budget,
        async_scheduling=async_scheduling, dtype="float64",
    )  # fmt: skip
    on = LLM(str(path), num_prefix_snapshots=3, prefix_snapshot_interval=8, **kw)
    off = LLM(str(path), enable_prefix_caching=False, **kw)
    g = torch.Generator().manual_seed(seed)
    prefixes = [ids(int(n), seed=seed * 10 + i) for i, n in enumerate(torch.randint(1, 14, (3,), generator=g))]
    prompts, params = [], []
    for i in range(10):
        p = prefixes[int(torch.randint(0, 3, (1,), generator=g))]
        prompts.append(p + ids(int(torch.randint(1, 7, (1,), generator=g)), seed=100 * seed + i))
        params.append(SamplingParams(temperature=0, max_tokens=int(torch.randint(2, 14, (1,), generator=g))))
    for batch in (prompts[:5], prompts[5:], prompts):
        got = on.generate(batch, params[: len(batch)], use_tqdm=False)
        want = off.generate(batch, params[: len(batch)], use_tqdm=False)
        assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    engine = on.engine
    assert engine.prefix_cache_stats()["hits"] > 0
    assert engine.blocks.num_free == engine.blocks.capacity and engine.slots.num_free == engine.slots.capacity


def test_a_pass_never_captures_two_snapshots_into_one_slot(tiny_checkpoints, monkeypatch):
    """A tight snapshot pool (3 slots) under traffic whose passes capture several states: a snapshot
    taken for one of a pass's captures must not be evicted (its slot taken again) by a later capture of
    the same pass. Two captures into one slot were written by the same kernel launch in either order,
    and the index could name the state the other one left (seen with this traffic before the fix)."""
    from deltaserve.cluster.core import scheduler as scheduler_module

    seen = []
    schedule = scheduler_module.Scheduler.schedule

    def spy(self, *args, **kwargs):
        plan = schedule(self, *args, **kwargs)
        if plan is not None and plan.captures is not None and len(plan.captures):
            seen.append([int(slot) for _, _, slot in plan.captures])
        return plan

    monkeypatch.setattr(scheduler_module.Scheduler, "schedule", spy)
    path, _ = tiny_checkpoints["qwen3_next"]
    kw = dict(max_num_seqs=4, block_size=4, num_kv_blocks=16, max_num_batched_tokens=12, dtype="float64")
    on = LLM(str(path), num_prefix_snapshots=3, prefix_snapshot_interval=8, async_scheduling=False, **kw)
    g = torch.Generator().manual_seed(0)
    prefixes = [ids(int(n), seed=i) for i, n in enumerate(torch.randint(1, 14, (3,), generator=g))]
    prompts = [prefixes[int(torch.randint(0, 3, (1,), generator=g))] + ids(3 + i % 4, seed=i) for i in range(10)]
    on.generate(prompts, SamplingParams(temperature=0, max_tokens=6), use_tqdm=False)
    assert any(len(slots) >= 2 for slots in seen)  # passes with several captures happened
    assert all(len(set(slots)) == len(slots) for slots in seen), seen
    assert on.engine.prefix_cache_stats()["snapshots_evicted"] > 0


def drive(llm: LLM, arrivals: dict, max_steps: int = 200) -> dict[str, list[int]]:
    """Steps the engine, adding arrivals[step] = [(req_id, prompt, params, priority)] before each step."""
    engine, out = llm.engine, {}
    for step in range(max_steps):
        for req_id, prompt, params, priority in arrivals.get(step, []):
            engine.add_request(req_id, prompt, params, priority=priority)
        if not engine.has_unfinished() and step > max(arrivals):
            break
        for o in engine.step():
            if o.finished:
                out[o.request_id] = list(o.outputs[0].token_ids)
    return out


@pytest.mark.parametrize("form", ["priority", "speculation"])
def test_a_pinned_snapshots_page_is_not_counted_free(tiny_checkpoints, form):
    """A hit pins its snapshot, whose partly filled page only snapshots hold: that page was still counted
    free, so a later grow of the same plan (a lower-priority running request's next page; a speculating
    request's lookahead pages) passed can_grow and found no page ("out of KV pages": the engine failed
    every request). Six / seven KV pages; the tokens are those of the engine without a cache."""
    path, _ = tiny_checkpoints["qwen3_next"]
    greedy = lambda n: SamplingParams(temperature=0, max_tokens=n)  # noqa: E731
    kw = dict(dtype="float64", block_size=4, max_num_seqs=4, max_num_batched_tokens=32, num_prefix_snapshots=3)
    if form == "priority":
        kw |= dict(num_kv_blocks=6, scheduling_policy="priority", async_scheduling=False, max_model_len=24)
        arrivals = {
            0: [("A", [1, 2], greedy(1), 0)],
            2: [("R", list(range(100, 116)), greedy(6), 1)],
            3: [("W", [1, 2, 50], greedy(4), 0)],
        }
    else:
        kw |= dict(num_kv_blocks=7, max_model_len=28, speculative_config={"method": "mtp", "num_speculative_tokens": 2})
        arrivals = {
            0: [("A", [1, 2], greedy(1), 0)],
            1: [("R", list(range(100, 116)), greedy(8), 0)],
            2: [("W", [1, 2, 50, 51], greedy(4), 0)],
        }
    want = drive(LLM(str(path), enable_prefix_caching=False, **kw), arrivals)
    on = LLM(str(path), **kw)
    assert drive(on, arrivals) == want and set(want) == {"A", "R", "W"}
    assert on.engine.prefix_cache_stats()["hits"] > 0


def test_a_one_token_row_of_a_hit_leaves_the_shared_page(tiny_checkpoints):
    """A hit whose snapshot lies before the end of its shared pages, with a one-token budget: the row is
    planned as a decode row, and decode rows wrote their token's KV into the shared, indexed page (the
    prefill rows' rule, never rewrite positions below kv_shared_until, did not reach them). The page
    is bit for bit what it was."""
    path, _ = tiny_checkpoints["qwen3_next"]
    greedy = lambda n: SamplingParams(temperature=0, max_tokens=n)  # noqa: E731
    llm = LLM(
        str(path), dtype="float32", block_size=4, num_kv_blocks=16, max_num_seqs=4, max_num_batched_tokens=2,
        async_scheduling=False, max_model_len=40, num_prefix_snapshots=4,
        prefix_snapshot_policy="prompt_end,last_block",
    )  # fmt: skip
    engine = llm.engine
    pool = engine.executor.runner.pool
    first = [1, 2, 3, 4, 5]
    out = drive(llm, {0: [("A", first, greedy(4), 0)]})["A"]
    engine.add_request("R", [200, 201, 202], greedy(12))
    for _ in range(3):  # R decoding: the budget leaves the hit one token
        engine.step()
    engine.add_request("W", first + out + [77, 78], greedy(3))
    seen = {}
    build = engine.scheduler._build_plan

    def spy(scheduled):
        for req, n in scheduled:
            if req.req_id == "W" and not seen:
                page = req.block_table[req.num_computed_tokens // 4]
                seen.update(n=n, shared=req.num_computed_tokens < req.kv_shared_until, page=page)
                seen["kv"] = pool.k_pages[:, page].clone(), pool.v_pages[:, page].clone()
        return build(scheduled)

    engine.scheduler._build_plan = spy
    engine.step()
    assert seen["n"] == 1 and seen["shared"]  # the case: a one-token row inside the shared pages
    assert torch.equal(pool.k_pages[:, seen["page"]], seen["kv"][0])
    assert torch.equal(pool.v_pages[:, seen["page"]], seen["kv"][1])


def test_a_one_token_final_prompt_chunk_leaves_its_prompt_end_snapshot(tiny_checkpoints):
    """A prompt whose last chunk is one token runs it as a decode row, where the kernels capture
    nothing: its prompt-end snapshot comes from its slot at the start of the next pass. A later prompt
    extending it resumes there, with the tokens of the engine without a cache."""
    path, _ = tiny_checkpoints["qwen3_next"]
    kw = dict(
        block_size=4, max_num_seqs=4, max_num_batched_tokens=3, max_model_len=48, dtype="float32",
        async_scheduling=False,
    )  # fmt: skip
    on = LLM(str(path), num_prefix_snapshots=8, prefix_snapshot_policy="prompt_end", **kw)
    off = LLM(str(path), enable_prefix_caching=False, **kw)
    first = ids(7, seed=21)  # chunks of 3, 3, then 1
    params = SamplingParams(temperature=0, max_tokens=5)
    chunks = []
    build = on.engine.scheduler._build_plan

    def spy(scheduled):
        chunks.extend((req.num_computed_tokens, n) for req, n in scheduled if req.num_computed_tokens < len(first))
        return build(scheduled)

    on.engine.scheduler._build_plan = spy
    on.generate([first], params, use_tqdm=False)
    assert chunks == [(0, 3), (3, 3), (6, 1)]
    later = first + ids(5, seed=22)
    got = on.generate([later], params, use_tqdm=False)[0]
    want = off.generate([later], params, use_tqdm=False)[0]
    assert got.num_cached_tokens == len(first)
    assert got.outputs[0].token_ids == want.outputs[0].token_ids
