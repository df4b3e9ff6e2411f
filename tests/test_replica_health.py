"""A Ray replica's health poll (replicas.RayReplica._poll) against a fake driver actor, no Ray cluster:
silence while this process's event loop was held is not the replica's (no false suspicion), and a
replica that really stops answering is still suspected, then takes requests again once it answers."""

from __future__ import annotations

import asyncio
import logging
import time
from types import SimpleNamespace

import pytest

pytest.importorskip("ray")

from deltaserve.cluster.entrypoints import replicas  # noqa: E402


class FakeDriver:
    """poll.remote(wait) answers (no outputs) after `wait`, unless `mute`; an answer is an awaitable as a Ray
    ObjectRef is."""

    def __init__(self) -> None:
        self.mute = False
        self.poll = SimpleNamespace(remote=self._poll)

    async def _poll(self, wait: float):
        while True:
            await asyncio.sleep(wait)
            if not self.mute:
                return SimpleNamespace(outputs=[], cache_events=[], failure=None)


def _replica(driver: FakeDriver) -> replicas.RayReplica:
    replica = replicas.RayReplica.__new__(replicas.RayReplica)  # its actor and group are the fake's
    replicas.Replica.__init__(replica, 0)
    replica.state, replica.mirror, replica.node_id, replica.node_ip = "up", None, "fake-node-id", "192.0.2.9"
    replica._driver, replica._down_after_s = driver, 30.0
    replica._on_output = lambda *a: None
    replica._on_down = lambda *a: None
    return replica


def _watch(replica: replicas.RayReplica, seconds: float) -> list[str]:
    """The replica's states, sampled every 20 ms for `seconds`."""

    async def main():
        seen = []
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            await asyncio.sleep(0.02)
            seen.append(replica.state)
        return seen

    return main()


def test_a_stalled_event_loop_does_not_make_the_replica_suspect(caplog):
    async def main():
        replica = _replica(FakeDriver())
        poller = asyncio.create_task(replica._poll())
        await asyncio.sleep(0.3)
        time.sleep(2 * replicas.SUSPECT_AFTER_S)  # a long call on this loop: no poll answer is read meanwhile
        seen = await _watch(replica, 0.5)
        poller.cancel()
        return seen

    with caplog.at_level(logging.WARNING, logger=replicas.__name__):
        seen = asyncio.run(main())
    assert set(seen) == {"up"}
    assert not [r for r in caplog.records if "has not answered" in r.getMessage()]


def test_a_silent_replica_is_suspected_then_taken_back():
    async def main():
        driver = FakeDriver()
        replica = _replica(driver)
        poller = asyncio.create_task(replica._poll())
        await asyncio.sleep(0.3)
        driver.mute = True
        silent = await _watch(replica, replicas.SUSPECT_AFTER_S + 0.6)
        driver.mute = False
        back = await _watch(replica, 0.6)
        poller.cancel()
        return silent, back

    silent, back = asyncio.run(main())
    assert silent[0] == "up" and silent[-1] == "suspect"
    assert back[-1] == "up"
