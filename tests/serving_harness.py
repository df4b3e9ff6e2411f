"""What the serving tests share (the gRPC gateway's now; an HTTP front door can reuse it): an asyncio
loop on a thread for blocking clients, an in-process server started and stopped in front of an
AsyncEngine, streamed outputs collected, the pool checked idle, and the process's resources (RSS,
shared-memory segments, live Ray actors) measured for leak checks."""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass

from deltaserve.cluster.config import EngineConfig
from deltaserve.cluster.entrypoints.async_engine import AsyncEngine
from deltaserve.cluster.entrypoints.client import Chunk, Final
from deltaserve.cluster.entrypoints.gateway import Gateway

CALL_TIMEOUT_S = 30


class LoopThread:
    """An asyncio loop on a thread of its own, so that tests can use blocking gRPC clients."""

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="gateway-loop", daemon=True)
        self._thread.start()

    def submit(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def run(self, coro, timeout_s: float = CALL_TIMEOUT_S):
        return self.submit(coro).result(timeout_s)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join()
        self.loop.close()


@dataclass
class Served:
    aio: LoopThread
    engine: AsyncEngine
    gateway: Gateway

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.gateway.port}"

    def stats(self) -> dict:
        return self.aio.run(self.engine.stats())


@dataclass
class Streamed:
    chunks: list[Chunk]
    final: Final

    @property
    def token_ids(self) -> list[int]:
        return [t for c in self.chunks for t in c.token_ids]

    @property
    def text(self) -> str:
        return "".join(c.text for c in self.chunks)


def collect(items) -> Streamed:
    items = list(items)
    assert isinstance(items[-1], Final) and all(isinstance(i, Chunk) for i in items[:-1])
    return Streamed(items[:-1], items[-1])


def start_served(aio: LoopThread, engine_config: EngineConfig) -> Served:
    engine = aio.run(AsyncEngine.local(engine_config))
    gateway = Gateway(engine)
    try:
        aio.run(gateway.start())
    except BaseException:
        aio.run(engine.shutdown())
        raise
    return Served(aio, engine, gateway)


def stop_served(served: Served) -> None:
    try:
        served.aio.run(served.gateway.stop(0))
    finally:
        served.aio.run(served.engine.shutdown())


def wait_for_idle_pool(served: Served, within_s: float = 1.0) -> None:
    """Every page and state slot free again, nothing running or waiting, within `within_s`."""
    deadline = time.monotonic() + within_s
    while True:
        stats = served.stats()
        idle = stats["running"] == 0 and stats["waiting"] == 0 and served.engine.num_streams == 0
        if idle and stats["free_pages"] == stats["total_pages"] and stats["free_slots"] == stats["total_slots"]:
            return
        assert time.monotonic() < deadline, f"the pool is not free {within_s} s later: {stats}"
        time.sleep(0.01)
