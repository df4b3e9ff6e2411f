"""Routing between engine replicas: the least-loaded router takes turns among the least busy; a
PrefixMirror built from an engine's own page-index events holds exactly the blocks that engine can
reuse (same chained hashes); the prefix-aware router sends a prompt to the replica holding its prefix
unless that one is far busier. On a Ray cluster (one node), two replicas behind one AsyncEngine: a
shared prefix keeps going to one replica and hits its cache; a replica whose driver dies fails only
its own requests, the other serves, and it is placed again."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import pytest

from deltaserve import LLM, SamplingParams
from deltaserve.cluster.config import EngineConfig
from deltaserve.cluster.core.prefix_cache import PrefixMirror, prompt_block_hashes
from deltaserve.cluster.entrypoints.async_engine import AsyncEngine
from deltaserve.cluster.entrypoints.driver import EngineUnavailableError
from deltaserve.cluster.entrypoints.router import PREFIX_SLACK_REQUESTS, LeastLoaded, PrefixAware

pytestmark = pytest.mark.timeout(120)

BS = 16


@dataclass(eq=False)
class FakeReplica:
    in_flight: int = 0
    mirror: PrefixMirror | None = None


def test_least_loaded_takes_turns_among_the_least_busy():
    router = LeastLoaded()
    replicas = [FakeReplica(3), FakeReplica(1), FakeReplica(1), FakeReplica(2)]
    picks = [router.choose(replicas) for _ in range(4)]
    assert sorted(set(picks)) == [1, 2] and picks[0] != picks[1] and picks[0] == picks[2]
    replicas[2].in_flight = 0
    assert router.choose(replicas) == 2


def test_mirror_holds_what_the_engine_can_reuse(tiny_checkpoints):
    llm = LLM(str(tiny_checkpoints["qwen3_next"][0]), block_size=BS)
    try:
        events = llm.engine.prefix_events()
        mirror = PrefixMirror()
        prompt = list(range(3, 3 + 3 * BS + 5))  # three full blocks and a partial one
        llm.generate([prompt], SamplingParams(max_tokens=2, temperature=0), use_tqdm=False)
        mirror.apply([events.popleft() for _ in range(len(events))])
        assert mirror.matched_blocks(prompt_block_hashes(prompt, BS)) == 3
        # the engine resumes the same prompt from the blocks the mirror says it holds
        (again,) = llm.generate([prompt], SamplingParams(max_tokens=2, temperature=0), use_tqdm=False)
        assert again.num_cached_tokens >= 3 * BS
        forked = prompt[:BS] + [7] * (2 * BS)  # same first block, then different
        assert mirror.matched_blocks(prompt_block_hashes(forked, BS)) == 1
        assert mirror.matched_blocks(prompt_block_hashes(prompt, BS, cache_key="salt:x")) == 0
        llm.engine.reset_prefix_cache()  # forgotten blocks are events too
        mirror.apply([events.popleft() for _ in range(len(events))])
        assert len(mirror) == 0 and mirror.matched_blocks(prompt_block_hashes(prompt, BS)) == 0
    finally:
        llm.shutdown()


def test_prefix_aware_prefers_the_replica_holding_the_prefix():
    router = PrefixAware(BS)
    prefix = list(range(100, 100 + 4 * BS))
    holder, other = FakeReplica(2, PrefixMirror()), FakeReplica(0, PrefixMirror())
    holder.mirror.apply((True, h) for h in prompt_block_hashes(prefix + [1], BS))
    replicas = [other, holder]
    assert router.choose(replicas, prefix + [1, 2, 3]) == 1  # busier, within the slack
    holder.in_flight = PREFIX_SLACK_REQUESTS + 1
    assert router.choose(replicas, prefix + [1, 2, 3]) == 0  # too busy: the least loaded takes it
    holder.in_flight = 0
    assert router.choose(replicas, list(range(900, 950))) in (0, 1)  # no match anywhere: least loaded
    # a new prefix routed somewhere is expected there before its blocks' events arrive
    fresh = list(range(500, 500 + 3 * BS))
    first = router.choose(replicas, fresh + [1])
    replicas[first].in_flight += 1
    assert [router.choose(replicas, fresh + [t]) for t in (2, 3)] == [first, first]


# ---- two replicas on a Ray cluster -------------------------------------------------------------------------
@pytest.mark.ray
def test_two_replicas_route_by_prefix_and_survive_a_driver_death(ray_session, tiny_checkpoints):
    model = str(tiny_checkpoints["qwen3_next"][0])
    config = EngineConfig.from_kwargs(model=model, data_parallel_size=2, routing="prefix_aware", block_size=BS)
    greedy = dict(max_tokens=4, temperature=0, ignore_eos=True)

    async def run():
        engine = await AsyncEngine.ray(config)
        try:
            info = await engine.info()
            node = ray_session.get_runtime_context().get_node_id()
            assert [(r.state, r.node_id, r.transport) for r in info.replicas] == [("up", node, "local")] * 2

            async def generate(req_id, prompt, **sampling):
                outs = [out async for out in engine.generate(prompt, SamplingParams(**(sampling or greedy)), req_id)]
                return outs[-1]

            shared = list(range(10, 10 + 4 * BS))
            finals = [await generate(f"p{i}", shared + [200 + i, 201]) for i in range(4)]
            routed = [r.routed for r in engine.replica_infos()]
            assert sorted(routed) == [0, 4]  # the shared prefix stays on one replica
            assert all(f.num_cached_tokens >= 3 * BS for f in finals[1:])

            # a replica whose driver dies: its request in flight fails, the other replica serves on
            holder = routed.index(4)
            long = SamplingParams(max_tokens=300, temperature=0, ignore_eos=True)
            await engine.submit("doomed", shared + [9], long)  # the prefix sends it to the holder
            stream = engine.stream("doomed")
            await anext(stream)
            ray_session.kill(engine._replicas[holder]._driver)
            with pytest.raises(EngineUnavailableError, match=f"replica {holder} "):
                async for _ in stream:
                    pass
            assert (await generate("after", [5, 6, 7])).outputs[0].token_ids
            # placed again (this node has room): both replicas up, and serving
            for _ in range(600):
                if all(r.state == "up" for r in engine.replica_infos()):
                    break
                await asyncio.sleep(0.1)
            assert [r.state for r in engine.replica_infos()] == ["up", "up"]
            assert (await generate("again", shared + [9])).outputs[0].token_ids
        finally:
            await engine.shutdown()

    asyncio.run(run())
