"""Priority scheduling (`scheduling_policy="priority"`, vLLM's): requests run by `priority` (lower
first), then arrival; a waiting request that does not fit preempts running ones of a lower priority;
pages run out on the lowest running request, not the newest; a higher-priority request's tokens take
the pass's budget before a lower one's prompt chunk. Whatever the order and the preemptions, every
request's tokens are those it gets alone. fcfs (the default) takes only priority 0, as vLLM."""

from __future__ import annotations

import pytest
import torch
from tiny_models import VOCAB_SIZE

from deltaserve import LLM, SamplingParams
from deltaserve.cluster.core.request import RequestOptions, RequestStatus

pytestmark = pytest.mark.timeout(120)

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def prompt(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB_SIZE, (n,), generator=g).tolist()


@pytest.fixture(scope="module")
def path(tiny_checkpoints):
    return str(tiny_checkpoints["qwen3_5_moe"][0])


@pytest.fixture(scope="module")
def alone(path):
    """Each prompt's greedy tokens run by itself."""
    llm = LLM(path, max_num_seqs=1)
    cache: dict[tuple, list[int]] = {}

    def tokens(ids: list[int], params: SamplingParams = GREEDY) -> list[int]:
        key = (tuple(ids), params.max_tokens)
        if key not in cache:
            (out,) = llm.generate([ids], params, use_tqdm=False)
            cache[key] = list(out.outputs[0].token_ids)
        return cache[key]

    yield tokens
    llm.shutdown()


def run(engine, reqs) -> dict[str, list[int]]:
    """Step until every request finished; each one's tokens."""
    got: dict[str, list[int]] = {}
    while len(got) < len(reqs):
        for out in engine.step():
            if out.finished:
                got[out.request_id] = list(out.outputs[0].token_ids)
    return got


def test_fcfs_takes_only_priority_zero(path):
    llm = LLM(path, max_num_seqs=2)
    try:
        with pytest.raises(ValueError, match=r"^priority: only 0 unless .*scheduling_policy='priority'"):
            llm.generate([prompt(5, 1)], GREEDY, priority=[1], use_tqdm=False)
        with pytest.raises(ValueError, match=r"^priority: 2 given for 1 prompts"):
            llm.generate([prompt(5, 1)], GREEDY, priority=[0, 0], use_tqdm=False)
        (out,) = llm.generate([prompt(5, 1)], GREEDY, priority=[0], use_tqdm=False)
        assert out.finished and not llm.engine.scheduler.has_work()
    finally:
        llm.shutdown()


@pytest.mark.parametrize(
    "options, message",
    [
        (RequestOptions(priority=2**31), r"^priority: must be within"),
        (RequestOptions(priority=True), r"^priority: must be an integer, got bool"),
        (RequestOptions(priority=1.5), r"^priority: must be an integer, got float"),
        (RequestOptions(cache_salt="s" * 257), r"^cache_salt: must be a string of at most 256"),
        (RequestOptions(cache_salt=7), r"^cache_salt: must be a string"),
    ],
)
def test_request_options_name_the_field(options, message):
    with pytest.raises(ValueError, match=message):
        options.check()


def test_lower_priority_value_runs_first_then_arrival(path, alone):
    """One sequence at a time: the four prompts start in (priority, arrival) order."""
    llm = LLM(path, max_num_seqs=1, scheduling_policy="priority")
    try:
        prompts = [prompt(9 + i, 10 + i) for i in range(4)]
        outs = llm.generate(prompts, GREEDY, priority=[3, -1, 3, 0], use_tqdm=False)
        started = sorted(range(4), key=lambda i: outs[i].metrics.first_scheduled_time)
        assert started == [1, 3, 0, 2]
        assert [list(o.outputs[0].token_ids) for o in outs] == [alone(p) for p in prompts]
    finally:
        llm.shutdown()


def test_a_waiting_request_preempts_a_lower_priority_one(path, alone):
    """Two sequences, both taken by priority 5: a priority-0 arrival takes the seat of the later of
    them (the lowest in (priority, arrival)), which resumes when a seat frees; an equal-priority
    arrival only waits. Tokens as alone, every page and slot back."""
    llm = LLM(path, max_num_seqs=2, scheduling_policy="priority", async_scheduling=False)
    engine, sched = llm.engine, llm.engine.scheduler
    try:
        params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
        p = {name: prompt(7 + i, 20 + i) for i, name in enumerate(["early", "late", "equal", "high"])}
        early = engine.add_request("early", p["early"], params, priority=5)
        late = engine.add_request("late", p["late"], params, priority=5)
        for _ in range(3):
            engine.step()
        assert sched.running == [early, late]

        equal = engine.add_request("equal", p["equal"], params, priority=5)
        engine.step()
        assert (sched.stats.num_preemptions, equal.status) == (0, RequestStatus.WAITING)

        high = engine.add_request("high", p["high"], params, priority=0)
        engine.step()
        assert sched.stats.num_preemptions == 1 and late.num_preemptions == 1
        assert sched.running == [high, early]
        assert [r.req_id for r in sched.waiting] == ["late", "equal"]  # back in (priority, arrival) order

        got = run(engine, ["early", "late", "equal", "high"])
        assert got == {name: alone(ids, params) for name, ids in p.items()}
        assert sched.stats.num_preemptions == 1
        assert engine.blocks.num_free == engine.blocks.capacity and engine.slots.num_free == engine.slots.capacity
    finally:
        llm.shutdown()


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_pages_run_out_on_the_lowest_request(path, alone, policy):
    """Too few KV pages for both requests to finish: fcfs preempts the newest (the priority-0 one),
    priority the lowest (the earlier priority-9 one)."""
    llm = LLM(
        path,
        max_num_seqs=2,
        block_size=16,
        num_kv_blocks=8,
        scheduling_policy=policy,
        async_scheduling=False,
        enable_prefix_caching=False,
    )
    engine = llm.engine
    try:
        params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
        low_ids, high_ids = prompt(40, 31), prompt(40, 32)
        low = engine.add_request("low", low_ids, params, priority=9 if policy == "priority" else 0)
        high = engine.add_request("high", high_ids, params)
        while not engine.scheduler.stats.num_preemptions:
            assert engine.scheduler.has_work()
            engine.step()
        victim, kept = (high, low) if policy == "fcfs" else (low, high)
        assert (victim.num_preemptions, kept.num_preemptions) == (1, 0)
        got = run(engine, ["low", "high"])
        assert got == {"low": alone(low_ids, params), "high": alone(high_ids, params)}
    finally:
        llm.shutdown()


def test_a_higher_priority_prompt_takes_the_budget_first(path, alone):
    """A 32-token budget: a priority-5 100-token prompt is being prefilled in chunks when a priority-0
    20-token prompt arrives; the next pass runs the new prompt whole and the rest of the budget of
    the old one's."""
    llm = LLM(path, max_num_batched_tokens=32, scheduling_policy="priority", async_scheduling=False)
    engine = llm.engine
    try:
        long_ids, short_ids = prompt(100, 41), prompt(20, 42)
        slow = engine.add_request("slow", long_ids, GREEDY, priority=5)
        engine.step()
        assert slow.num_computed_tokens == 32
        fast = engine.add_request("fast", short_ids, GREEDY, priority=0)
        engine.step()
        assert (fast.num_computed_tokens, slow.num_computed_tokens) == (20, 44)
        assert len(fast.output_token_ids) == 1
        assert run(engine, ["slow", "fast"]) == {"slow": alone(long_ids), "fast": alone(short_ids)}
    finally:
        llm.shutdown()


def test_n_completions_and_prefix_hits_keep_their_priority(path, alone):
    """n = 3 completions of a priority-1 prompt behind a priority-0 one: all share the prompt's
    priority, and follow the leader's prefill from the cache."""
    llm = LLM(path, max_num_seqs=4, scheduling_policy="priority")
    try:
        a, b = prompt(70, 51), prompt(12, 52)
        outs = llm.generate([a, b], [SamplingParams(temperature=0, max_tokens=8, n=3), GREEDY], priority=[1, 0])
        assert [list(c.token_ids) for c in outs[0].outputs] == [alone(a)] * 3
        assert list(outs[1].outputs[0].token_ids) == alone(b)
        assert outs[1].metrics.first_scheduled_time <= outs[0].metrics.first_scheduled_time
        assert llm.engine.prefix_cache_stats()["hit_tokens"] >= 2 * 64
    finally:
        llm.shutdown()


def test_async_engine_carries_priority_and_salt(path, alone):
    """Through the serving path (AsyncEngine -> replica -> engine loop): one sequence at a time, a
    busy engine starts the waiting requests by priority; a prompt again under the same cache salt
    finds its blocks, under another salt or none nothing."""
    import asyncio

    from deltaserve.cluster.config import EngineConfig
    from deltaserve.cluster.entrypoints.async_engine import AsyncEngine

    long = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    prompts = {name: prompt(9 + i, 60 + i) for i, name in enumerate(["busy", "p2", "p0", "p1"])}
    shared = prompt(150, 70)

    async def main():
        config = EngineConfig.from_kwargs(model=path, max_num_seqs=1, scheduling_policy="priority")
        engine = await AsyncEngine.local(config)

        async def one(name: str, ids: list[int], params: SamplingParams, **options):
            outs = [out async for out in engine.generate(ids, params, name, **options)]
            return outs[-1]

        try:
            busy = asyncio.create_task(one("busy", prompts["busy"], long))
            while not engine.replica_infos()[0].in_flight:
                await asyncio.sleep(0.01)
            rest = [one(n, prompts[n], GREEDY, priority=int(n[1])) for n in ("p2", "p0", "p1")]
            finals = await asyncio.gather(busy, *rest)
            salted = [await one(f"s{i}", shared, GREEDY, cache_salt=s) for i, s in enumerate(["a", "a", "b", None])]
            return finals, salted
        finally:
            await engine.shutdown()

    finals, salted = asyncio.run(main())
    by_name = {f.request_id: f for f in finals}
    assert sorted(["p2", "p0", "p1"], key=lambda n: by_name[n].metrics.first_scheduled_time) == ["p0", "p1", "p2"]
    assert list(by_name["busy"].outputs[0].token_ids) == alone(prompts["busy"], long)
    for name in ("p2", "p0", "p1"):
        assert list(by_name[name].outputs[0].token_ids) == alone(prompts[name])
    cached = [s.num_cached_tokens for s in salted]
    assert cached[0] == cached[2] == cached[3] == 0 and cached[1] >= 128, cached
    assert all(list(s.outputs[0].token_ids) == alone(shared) for s in salted)


@pytest.mark.parametrize("seed", range(4))
def test_random_arrivals_priorities_and_a_small_pool(path, alone, seed):
    """Requests of random lengths and priorities arrive at random steps into three sequences, a 32-token
    budget and a pool of ten 16-token pages (preemptions by priority and by pages both happen): each
    gets the tokens it gets alone, and every page and slot is back at the end."""
    import random

    rng = random.Random(seed)
    arrivals = sorted(
        (rng.randint(0, 12), f"r{i}", prompt(rng.randint(5, 70), 100 + 10 * seed + i), rng.randint(-2, 3))
        for i in range(10)
    )
    budget = dict(max_num_seqs=3, block_size=16, num_kv_blocks=10, max_num_batched_tokens=32)
    llm = LLM(path, scheduling_policy="priority", async_scheduling=seed % 2 == 0, **budget)
    engine = llm.engine
    try:
        params = {
            name: SamplingParams(temperature=0, max_tokens=rng.randint(3, 12), ignore_eos=True)
            for _, name, _, _ in arrivals
        }
        got: dict[str, list[int]] = {}
        step = 0
        while len(got) < len(arrivals):
            for at, name, ids, priority in arrivals:
                if at == step:
                    engine.add_request(name, ids, params[name], priority=priority)
            for out in engine.step():
                if out.finished:
                    got[out.request_id] = list(out.outputs[0].token_ids)
            step += 1
        assert engine.scheduler.stats.num_preemptions > 0
        assert got == {name: alone(ids, params[name]) for _, name, ids, _ in arrivals}
        assert engine.blocks.num_free == engine.blocks.capacity and engine.slots.num_free == engine.slots.capacity
    finally:
        llm.shutdown()
