"""Soak: thousands of short requests through the gRPC gateway in front of the Ray backend (driver actor,
worker actor, shared-memory ring), mixed with cancellations, bad requests, deadlines and clients that
disconnect at random points. Afterwards every page and state slot is free (prefix-cache pages count as
free), the gateway's and the driver's memory have not grown past MEMORY_BOUND, greedy outputs equal a
fresh server's, and once the engine stops no actor or shared-memory segment of ours is left.

Bounded for CI by DELTASERVE_SOAK_REQUESTS (default 3000, about 20 s on 2 cores); set it higher to soak longer."""

from __future__ import annotations

import asyncio
import os
import random
import time
from collections import Counter

import grpc
import pytest
import ray
from serving_harness import (
    LoopThread,
    Served,
    collect,
    descendant_pids,
    live_ray_actors,
    rss_bytes,
    shm_segments_of,
    start_served,
    stop_served,
    wait_for_idle_pool,
)
from tiny_models import VOCAB_SIZE

from deltaserve.cluster.config import EngineConfig
from deltaserve.cluster.entrypoints.async_engine import AsyncEngine
from deltaserve.cluster.entrypoints.client import GenerationClient, generate_request
from deltaserve.cluster.entrypoints.gateway import Gateway
from deltaserve.protos import generation_pb2_grpc

REQUESTS = int(os.environ.get("DELTASERVE_SOAK_REQUESTS", "3000"))
CONCURRENCY = 32
WARMUP = 200  # requests before the first memory reading (allocator pools, grpc buffers, caches filled)
MEMORY_BOUND = 64 * 2**20  # RSS growth allowed per process between the warm-up and the end
PROBES = [[5, 6, 7], [40, 41, 42, 43, 44], [100] * 20, [7] * 40]
BAD = [  # (fields, the field the error names)
    ({"temperature": float("inf")}, "temperature"),
    ({"top_p": float("nan")}, "top_p"),
    ({"repetition_penalty": 1e300}, "repetition_penalty"),
    ({"stop": ["x" * 20_000]}, "stop"),
    ({"stop_token_ids": [VOCAB_SIZE]}, "stop_token_ids"),
    ({"max_tokens": 1000}, "max_tokens"),
    ({"logprobs": 99}, "logprobs"),
]

pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.timeout(900)]


def random_prompt(rng: random.Random) -> list[int]:
    return [rng.randrange(3, VOCAB_SIZE) for _ in range(rng.randint(1, 24))]


def random_sampling(rng: random.Random) -> dict:
    sampling = {"max_tokens": rng.randint(1, 6), "ignore_eos": rng.random() < 0.5}
    if rng.random() < 0.5:
        sampling["temperature"] = 0.0
    else:
        sampling.update(temperature=rng.uniform(0.1, 1.5), top_p=rng.uniform(0.5, 1.0), top_k=rng.choice([-1, 5, 50]))
        if rng.random() < 0.5:
            sampling["seed"] = rng.randrange(2**31)
    if rng.random() < 0.2:
        sampling.update(repetition_penalty=1.3, presence_penalty=0.5, logprobs=rng.randint(0, 5))
    return sampling


async def one(target: str, shared: grpc.aio.Channel, rng: random.Random, tally: Counter) -> None:
    """One request of a random kind; the outcome must be the one its kind allows."""
    kind = rng.choices(["ok", "cancel", "bad", "disconnect", "deadline"], weights=[55, 15, 10, 10, 10])[0]
    prompt, sampling = random_prompt(rng), random_sampling(rng)
    if kind == "bad":
        fields, field = rng.choice(BAD)
        sampling = {**sampling, **fields}
    own = grpc.aio.insecure_channel(target) if kind == "disconnect" else None
    stub = generation_pb2_grpc.GenerationStub(own or shared)
    timeout = rng.uniform(0.001, 0.05) if kind == "deadline" else 60
    call = stub.Generate(generate_request(prompt, **sampling), timeout=timeout)
    leave_after = rng.randint(0, 2)  # responses read before a cancel / disconnect
    try:
        seen = 0
        async for _ in call:
            seen += 1
            if kind in ("cancel", "disconnect") and seen >= leave_after:
                break
        if kind == "cancel":
            call.cancel()
        elif kind == "disconnect":
            await own.close()  # the client goes away, its stream still open
        tally[kind] += 1
        assert kind != "bad", f"bad request {field} was served"
    except grpc.RpcError as e:
        tally[f"{kind}:{e.code().name}"] += 1
        if kind == "bad":
            assert e.code() == grpc.StatusCode.INVALID_ARGUMENT and e.details().startswith(f"{field}:"), e.details()
        elif kind == "deadline":
            assert e.code() == grpc.StatusCode.DEADLINE_EXCEEDED, e.details()
        elif kind == "disconnect" and leave_after == 0:
            assert e.code() == grpc.StatusCode.CANCELLED, e.details()
        else:
            raise
    finally:
        if own is not None:
            await own.close()


async def load(target: str, n: int, seed: int, tally: Counter) -> None:
    rng = random.Random(seed)
    async with grpc.aio.insecure_channel(target) as shared:
        queue = [random.Random(rng.random()) for _ in range(n)]

        async def runner() -> None:
            while queue:
                await one(target, shared, queue.pop(), tally)

        await asyncio.gather(*(runner() for _ in range(CONCURRENCY)))


def greedy(target: str) -> list[list[int]]:
    with GenerationClient(target) as client:
        return [collect(client.generate(p, temperature=0, max_tokens=8, ignore_eos=True)).token_ids for p in PROBES]


def test_soak(ray_session, tiny_checkpoints, report):
    model = str(tiny_checkpoints["qwen3_next"][0])
    config = EngineConfig.from_kwargs(model=model, max_model_len=64, executor="ray")
    actors_before = Counter(live_ray_actors())
    aio = LoopThread()
    engine = aio.run(AsyncEngine.ray(config), timeout_s=180)
    served = Served(aio, engine, Gateway(engine))
    stopped = False
    try:
        aio.run(served.gateway.start())
        driver_pid = ray.get(engine._replicas[0]._driver.__ray_call__.remote(lambda self: os.getpid()))
        ours = descendant_pids() | {os.getpid()}
        assert shm_segments_of(ours), "the Ray executor runs over a shared-memory ring"
        tally: Counter = Counter()
        started = time.monotonic()
        asyncio.run(load(served.target, WARMUP, 1, tally))
        wait_for_idle_pool(served, within_s=10)
        memory_before = {"gateway": rss_bytes(), "driver": rss_bytes(driver_pid)}
        asyncio.run(load(served.target, REQUESTS - WARMUP, 2, tally))
        wait_for_idle_pool(served, within_s=10)
        elapsed = time.monotonic() - started
        memory_after = {"gateway": rss_bytes(), "driver": rss_bytes(driver_pid)}
        soaked = greedy(served.target)
        ours |= descendant_pids()
        aio.run(served.gateway.stop(0))
        aio.run(engine.shutdown())
        stopped = True
    finally:
        if not stopped:
            aio.run(served.gateway.stop(0))
            aio.run(engine.shutdown())
        aio.close()

    sent = sum(tally.values())
    mib = {k: (memory_before[k] / 2**20, memory_after[k] / 2**20) for k in memory_before}
    report(
        f"soak: {sent} requests sent in {elapsed:.0f} s ({', '.join(f'{k} {v}' for k, v in sorted(tally.items()))}); "
        + "; ".join(f"{k} RSS {a:.0f} -> {b:.0f} MiB" for k, (a, b) in mib.items())
        + f" (bound +{MEMORY_BOUND // 2**20} MiB)"
    )
    assert sent == REQUESTS
    for name in memory_before:
        assert memory_after[name] - memory_before[name] < MEMORY_BOUND, (name, mib[name])

    # nothing of ours is left: actors (Ray marks them dead) and shared-memory segments
    deadline = time.monotonic() + 10
    while Counter(live_ray_actors()) != actors_before and time.monotonic() < deadline:
        time.sleep(0.1)
    assert Counter(live_ray_actors()) == actors_before
    assert not shm_segments_of(ours)

    fresh_aio = LoopThread()
    fresh = start_served(fresh_aio, EngineConfig.from_kwargs(model=model, max_model_len=64))
    try:
        assert soaked == greedy(fresh.target)
    finally:
        stop_served(fresh)
        fresh_aio.close()
