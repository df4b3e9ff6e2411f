"""LoRA adapters with data-parallel replicas (two Ray replicas behind one AsyncEngine): a load reaches
every replica under one id, a request on an adapter is served by either replica with PEFT's merged
model's greedy tokens, a load one replica refuses leaves it on none, a replica placed again after its
driver died loads the adapters the other holds (same id), and an unload leaves it on none."""

from __future__ import annotations

import asyncio

import pytest
from lora_adapters import greedy, peft_adapter
from test_model_vs_transformers import prompt

from deltaserve import SamplingParams
from deltaserve.cluster.config import EngineConfig
from deltaserve.cluster.core.request import RequestOptions
from deltaserve.cluster.entrypoints.async_engine import AdapterNotFoundError, AsyncEngine

pytestmark = [pytest.mark.ray, pytest.mark.timeout(300)]

STEPS = 5
GREEDY = SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True)


async def held(engine: AsyncEngine) -> list[list[tuple[str, int]]]:
    """Each replica's own adapters (asked of its driver, not of the AsyncEngine's records)."""
    lists = await asyncio.gather(*(r._driver.list_loras.remote() for r in engine._replicas))
    return [[(a.lora_name, a.lora_int_id) for a in loras] for loras in lists]


async def tokens(engine: AsyncEngine, req_id: str, ids: list[int], lora_name: str | None) -> list[int]:
    lora = None if lora_name is None else await engine.lora_request(lora_name)
    outs = [out async for out in engine.generate(ids, GREEDY, req_id, lora_request=lora)]
    return list(outs[-1].outputs[0].token_ids)


def test_adapters_reach_every_replica(ray_session, tiny_checkpoints, tmp_path):
    path, hf = tiny_checkpoints["qwen3_5"]
    merged = peft_adapter(hf, "qwen3_5", "all", tmp_path / "b", seed=11)
    peft_adapter(hf, "qwen3_5", "attention", tmp_path / "a", seed=12)
    rows = [prompt(10, seed=s) for s in range(4)]
    expected = [greedy(merged, row, STEPS) for row in rows]
    config = EngineConfig.from_kwargs(
        model=str(path), data_parallel_size=2, enable_lora=True, max_lora_rank=8, dtype="float32"
    )

    async def run():
        engine = await AsyncEngine.ray(config)
        try:
            await engine.load_lora("a", str(tmp_path / "a"))
            b = await engine.load_lora("b", str(tmp_path / "b"))
            await engine.unload_lora("a")  # b keeps id 2: a replica placed again must not renumber it
            assert b.lora_int_id == 2
            assert await held(engine) == [[("b", 2)], [("b", 2)]]
            assert [(a.lora_name, a.lora_int_id) for a in await engine.list_loras()] == [("b", 2)]

            # either replica serves it: least-loaded routing takes turns between idle replicas
            got = [await tokens(engine, f"b{i}", row, "b") for i, row in enumerate(rows)]
            assert got == expected
            assert [r.routed for r in engine.replica_infos()] == [2, 2]
            with pytest.raises(AdapterNotFoundError, match="lora_name"):
                await engine.submit("nope", rows[0], GREEDY, RequestOptions("nope"))

            # refused (no such folder): on no replica afterwards, and the name stays free
            with pytest.raises(ValueError, match="missing"):
                await engine.load_lora("bad", str(tmp_path / "missing"))
            assert await held(engine) == [[("b", 2)], [("b", 2)]]

            # replica 0's driver dies: placed again, it loads b (id 2) before it takes requests
            ray_session.kill(engine._replicas[0]._driver)
            for _ in range(600):
                await asyncio.sleep(0.1)
                if [r.state for r in engine.replica_infos()] == ["up", "up"]:
                    break
            assert [r.state for r in engine.replica_infos()] == ["up", "up"]
            assert await held(engine) == [[("b", 2)], [("b", 2)]]
            routed = [r.routed for r in engine.replica_infos()]
            got = [await tokens(engine, f"again{i}", row, "b") for i, row in enumerate(rows[:2])]
            assert got == expected[:2]
            assert [r.routed - before for r, before in zip(engine.replica_infos(), routed, strict=True)] == [1, 1]

            await engine.unload_lora("b")
            assert await held(engine) == [[], []]
            with pytest.raises(AdapterNotFoundError, match="lora_name"):
                await engine.submit("gone", rows[0], GREEDY, RequestOptions("b"))
            with pytest.raises(AdapterNotFoundError):
                await engine.unload_lora("b")
        finally:
            await engine.shutdown()

    asyncio.run(run())
