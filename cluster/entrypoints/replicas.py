"""Engine replicas behind the front doors' AsyncEngine: how each is reached, and where it runs.

`LocalReplica`: an EngineLoop in this process. `RayReplica`: a Driver actor in a placement group of
its own (`replica_bundles`: its driver in bundle 0, its TP/EP workers in the next ones: one node; on
a node without a spare CPU the driver shares rank 0's bundle), long-polled for outputs. A RayReplica
that has not answered a poll for SUSPECT_AFTER_S is suspect (time this process's event loop was held
does not count): it takes no new requests, and takes them again when it answers. It is down when Ray
reports its actor dead (its node died), when its engine loop failed, or after `replica_down_after_s`
of silence: its actor and group go, its requests in flight end with UNAVAILABLE, and `RayReplicas`
places it again, on an alive node with room (waiting for one: a node that joins), and takes requests
once `on_ready` (the AsyncEngine's adapter catch-up) has run.

Placement spreads the replicas: each group is pinned (a `ray.io/node-id` label selector) to the alive
node with the fewest replicas that has room (a node where a replica just died last); when none has
room now, an unpinned group waits for room.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Collection
from dataclasses import dataclass

from deltaserve.cluster.config import EngineConfig
from deltaserve.cluster.core.engine import ModelInfo, ReplicaInfo
from deltaserve.cluster.core.lora import LoRARequest
from deltaserve.cluster.core.prefix_cache import PrefixMirror
from deltaserve.cluster.core.request import NO_OPTIONS, RequestOptions, RequestOutput
from deltaserve.cluster.core.sampling_params import SamplingParams
from deltaserve.cluster.executors import runs_in_process

from .driver import (
    AdapterNotFoundError,
    Driver,
    DriverPlace,
    EngineLoop,
    EngineStartError,
    EngineUnavailableError,
    QueueFullError,
)

log = logging.getLogger(__name__)

POLL_WAIT_S = 0.1  # a poll returns after this long without outputs: the replica's heartbeat
SUSPECT_AFTER_S = 0.8  # no answer for this long: no new requests (the gateway stops routing within a second)
STALL_S = 0.2  # a poll wait this much past its timeout: this process did not run (its own silence, not the replica's)
PLACE_TRY_S = 2.0  # a group pinned to a node with room is ready well within this
WAIT_FOR_ROOM_S = 10.0  # then the nodes are looked at again
RECENTLY_FAILED_S = 60.0  # a node whose replica died is tried last for this long (Ray may not know it died)
START_TIMEOUT_S = 300.0
REPLACE_BACKOFF_S = (1.0, 30.0)
LONG_PROMPT_IDS = 4096  # a token-id prompt past this is checked on a thread (text prompts always are)
GROUP_REMOVAL_WAIT_S = 2.0  # a shutdown waits this long for its group's removal (milliseconds unless the GCS is gone)
NODE_ID_LABEL = "ray.io/node-id"

OutputSink = Callable[["Replica", list[RequestOutput]], None]
DownSink = Callable[["Replica", str], None]
ReadySink = Callable[["Replica"], Awaitable[None]]


class ReplicaUnreachable(RuntimeError):
    """The replica's actor could not take the call (dead or unreachable): nothing was queued there."""


class Replica:
    """What the AsyncEngine routes to. `in_flight`, `routed` and `adapters` (the names of the LoRA
    adapters loaded there) are the AsyncEngine's records."""

    index: int
    state: str
    node_id: str = ""
    node_ip: str = ""
    transport: str = ""
    failure: str | None = None
    mirror: PrefixMirror | None = None

    def __init__(self, index: int) -> None:
        self.index = index
        self.in_flight = 0
        self.routed = 0
        self.adapters: set[str] = set()

    def info(self) -> ReplicaInfo:
        return ReplicaInfo(
            self.index, self.state, self.node_id, self.node_ip, self.transport, self.in_flight, self.routed
        )

    def where(self) -> str:
        return f"replica {self.index} on node {self.node_ip or '?'} ({self.node_id[:12] or 'in this process'})"

    def suspect(self, why: str) -> None:
        """A call to it failed: take no new requests until it answers again (no-op in this process)."""

    async def submit(
        self, req_id: str, prompt: str | list[int], params: SamplingParams, options: RequestOptions = NO_OPTIONS
    ) -> int:
        raise NotImplementedError

    async def abort(self, req_id: str) -> None:
        raise NotImplementedError

    async def load_lora(self, name: str, path: str, lora_int_id: int) -> LoRARequest:
        raise NotImplementedError

    async def unload_lora(self, name: str) -> None:
        raise NotImplementedError

    async def tokenize(self, text: str) -> list[int]:
        raise NotImplementedError

    async def model_info(self) -> ModelInfo:
        raise NotImplementedError

    async def stats(self) -> dict:
        raise NotImplementedError

    async def shutdown(self) -> None:
        raise NotImplementedError


class LocalReplica(Replica):
    """The engine in this process (a thread runs its loop)."""

    transport = "local"

    def __init__(self, loop_engine: EngineLoop) -> None:
        super().__init__(0)
        self.loop_engine = loop_engine

    @classmethod
    async def start(cls, config: EngineConfig, on_output: OutputSink) -> LocalReplica:
        aio = asyncio.get_running_loop()
        replica: LocalReplica | None = None

        def sink(out: RequestOutput) -> None:
            aio.call_soon_threadsafe(on_output, replica, [out])

        loop_engine = await asyncio.to_thread(EngineLoop, config, sink)
        replica = cls(loop_engine)
        return replica

    @property
    def state(self) -> str:
        return "down" if self.loop_engine.failure is not None else "up"

    @property
    def failure(self) -> str | None:
        return self.loop_engine.failure

    async def submit(
        self, req_id: str, prompt: str | list[int], params: SamplingParams, options: RequestOptions = NO_OPTIONS
    ) -> int:
        if not isinstance(prompt, str) and len(prompt) <= LONG_PROMPT_IDS:
            return self.loop_engine.submit(req_id, prompt, params, options)
        # tokenizing (tens of ms for a long prompt) and checking the ids off the event loop, which every
        # other stream shares
        task = asyncio.ensure_future(asyncio.to_thread(self.loop_engine.submit, req_id, prompt, params, options))
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:  # the thread still queues it: aborted once it has
            task.add_done_callback(lambda t: t.cancelled() or t.exception() or self.loop_engine.abort(req_id))
            raise

    async def abort(self, req_id: str) -> None:
        self.loop_engine.abort(req_id)

    async def load_lora(self, name: str, path: str, lora_int_id: int) -> LoRARequest:
        return await asyncio.to_thread(self.loop_engine.load_lora, name, path, lora_int_id)

    async def unload_lora(self, name: str) -> None:
        await asyncio.to_thread(self.loop_engine.unload_lora, name)

    async def tokenize(self, text: str) -> list[int]:
        return await asyncio.to_thread(self.loop_engine.engine.tokenize, text)  # as submit's: off the event loop

    async def model_info(self) -> ModelInfo:
        return self.loop_engine.engine.model_info()

    async def stats(self) -> dict:
        return self.loop_engine.stats()

    async def shutdown(self) -> None:
        await asyncio.to_thread(self.loop_engine.stop)


class RayReplica(Replica):
    """A Driver actor in its placement group; a task long-polls it for outputs and watches its health."""

    def __init__(
        self,
        index: int,
        driver,
        group,
        place: DriverPlace,
        on_output: OutputSink,
        on_down: DownSink,
        config: EngineConfig,
    ) -> None:
        super().__init__(index)
        self.state = "up"
        self.node_id, self.node_ip, self.transport = place.node_id, place.node_ip, place.transport
        self.mirror = PrefixMirror() if config.data_parallel.routing == "prefix_aware" else None
        self._driver, self._group = driver, group
        self._released = False  # its actor killed and group removed
        self._on_output, self._on_down = on_output, on_down
        self._down_after_s = config.data_parallel.replica_down_after_s
        self._poller = asyncio.create_task(self._poll(), name=f"replica-{index}-poll")

    @classmethod
    async def start(
        cls,
        index: int,
        config: EngineConfig,
        group,
        on_output: OutputSink,
        on_down: DownSink,
        name: str | None = None,
    ) -> RayReplica:
        """The driver actor in bundle 0 of `group`, up (workers, weights, pools), or EngineStartError."""
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        # a bundle of its own when the group has one more than the lean layout (it shares rank 0's otherwise)
        own = len(group.bundle_specs) > len(replica_bundles(config, driver_cpu=False)) or runs_in_process(config)
        driver_bundle = group.bundle_specs[0] if own else {}
        options = {
            "max_concurrency": 64,
            "num_cpus": driver_bundle.get("CPU", 0),
            "num_gpus": driver_bundle.get("GPU", 0),
            "scheduling_strategy": PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=0),
        }
        if name:
            options.update(name=name, get_if_exists=False)
        driver = ray.remote(Driver).options(**options).remote(config)
        try:
            error = await driver.start_error.remote()  # waits for the engine (workers, weights, pools) to be up
            place = None if error is not None else await driver.where.remote()
        except BaseException:
            ray.kill(driver)
            raise
        if error is not None:
            ray.kill(driver)
            raise EngineStartError(error)
        return cls(index, driver, group, place, on_output, on_down, config)

    # ---- health --------------------------------------------------------------------------------
    async def _poll(self) -> None:
        from ray.exceptions import RayError

        pending = None
        last_answer = tick = time.monotonic()
        try:
            while self.state in ("up", "suspect"):
                if pending is None:
                    pending = asyncio.ensure_future(self._driver.poll.remote(POLL_WAIT_S))
                done, _ = await asyncio.wait({pending}, timeout=POLL_WAIT_S)
                now = time.monotonic()
                stalled = now - tick - POLL_WAIT_S
                tick = now
                if stalled > STALL_S:
                    # this event loop was held (a long call on it, a GC pause, a starved CPU): the answer
                    # may be queued behind the timeout; silence counts only while this loop ran
                    last_answer += stalled
                if not done:
                    silent = now - last_answer
                    if silent >= self._down_after_s:
                        self.down(f"no answer for {silent:.0f} s")
                    elif silent >= SUSPECT_AFTER_S and self.state == "up":
                        self.state = "suspect"
                        log.warning("%s has not answered for %.1f s: it takes no new requests", self.where(), silent)
                    continue
                answered, pending = pending, None
                try:
                    answer = answered.result()
                except RayError as e:
                    self.down(f"its actor is gone ({type(e).__name__}: {str(e).splitlines()[0][:200]})")
                    return
                except Exception as e:  # an answer that cannot be read: its requests would hang otherwise
                    self.down(f"unreadable poll answer ({type(e).__name__}: {str(e)[:200]})")
                    return
                last_answer = now
                if self.state == "suspect":
                    log.warning("%s answers again", self.where())
                    self.state = "up"
                if answer.cache_events and self.mirror is not None:
                    self.mirror.apply(answer.cache_events)
                if answer.outputs:
                    self._on_output(self, answer.outputs)
                if answer.failure is not None:
                    self.down(answer.failure)
        finally:
            if pending is not None:  # a poll left behind (shut down, or declared down): its end is nobody's news
                pending.add_done_callback(lambda f: f.cancelled() or f.exception())

    def suspect(self, why: str) -> None:
        if self.state == "up":
            self.state = "suspect"
            log.warning("%s: %s; it takes no new requests", self.where(), why)

    def down(self, reason: str) -> None:
        """Declared down: its actor and group go; the AsyncEngine fails its requests and places it again."""
        if self.state == "down":
            return
        self.state, self.failure = "down", reason
        log.error("%s is down: %s", self.where(), reason)
        self._release()
        self._on_down(self, reason)

    def _release(self) -> threading.Thread | None:
        """Kill its actor and remove its group (on a thread: see `_remove_groups`); None if done before."""
        import ray

        if self._released:
            return None
        self._released = True
        with contextlib.suppress(Exception):
            ray.kill(self._driver)
        return _remove_groups([self._group])

    # ---- calls ---------------------------------------------------------------------------------
    async def _call(self, method, *args):
        from ray.exceptions import RayError, RayTaskError

        try:
            return await method.remote(*args)
        except RayTaskError as e:  # the driver raised: its exception is the cause
            raise _unwrap(e) from None
        except RayError as e:
            raise ReplicaUnreachable(f"{self.where()}: {type(e).__name__}") from e

    async def submit(
        self, req_id: str, prompt: str | list[int], params: SamplingParams, options: RequestOptions = NO_OPTIONS
    ) -> int:
        submitted = asyncio.ensure_future(self._call(self._driver.submit, req_id, prompt, params, options))
        try:
            return await asyncio.shield(submitted)
        except asyncio.CancelledError:
            # the caller left, but the driver may still take the request: abort it once it has
            with contextlib.suppress(Exception):
                await submitted
                await self.abort(req_id)
            raise

    async def abort(self, req_id: str) -> None:
        if self.state in ("up", "suspect"):
            with contextlib.suppress(ReplicaUnreachable):
                await self._call(self._driver.abort, req_id)

    async def load_lora(self, name: str, path: str, lora_int_id: int) -> LoRARequest:
        return await self._call(self._driver.load_lora, name, path, lora_int_id)

    async def unload_lora(self, name: str) -> None:
        await self._call(self._driver.unload_lora, name)

    async def tokenize(self, text: str) -> list[int]:
        return await self._call(self._driver.tokenize, text)

    async def model_info(self) -> ModelInfo:
        return await self._call(self._driver.info)

    async def stats(self) -> dict:
        return await self._call(self._driver.stats)

    async def shutdown(self) -> None:
        self.state = "down"
        self._poller.cancel()
        if not self._released:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._call(self._driver.shutdown), 10)
        removing = self._release()
        if removing is not None:
            await asyncio.to_thread(removing.join, GROUP_REMOVAL_WAIT_S)


def _unwrap(e: BaseException) -> BaseException:
    """A Ray task error carries the driver's exception as its cause: surface that one."""
    cause = getattr(e, "cause", None)
    if isinstance(cause, ValueError | QueueFullError | EngineUnavailableError | AdapterNotFoundError):
        return cause
    return e


# ---- placement -------------------------------------------------------------------------------------
def replica_bundles(config: EngineConfig, *, driver_cpu: bool = True) -> list[dict[str, float]]:
    """One replica's placement group: bundle 0 the driver's (a CPU: its loop is the critical path; the
    model's GPU too when the model runs in the driver), then one bundle per worker rank. Without
    `driver_cpu` (a node with no CPU to spare) a driver that runs no model shares rank 0's bundle."""
    from deltaserve.cluster.executors.ray import worker_bundles

    if runs_in_process(config):
        return [{"CPU": 1.0, "GPU": 1.0} if config.load.device.startswith("cuda") else {"CPU": 1.0}]
    return [{"CPU": 1.0}, *worker_bundles(config)] if driver_cpu else worker_bundles(config)


@dataclass(frozen=True)
class NodeView:
    node_id: str
    ip: str
    resources: dict[str, float]


def alive_nodes() -> list[NodeView]:
    import ray

    return [
        NodeView(n["NodeID"], n["NodeManagerAddress"], dict(n.get("Resources", {}))) for n in ray.nodes() if n["Alive"]
    ]


def _total(bundles: list[dict[str, float]]) -> Counter:
    need = Counter()
    for bundle in bundles:
        need.update(bundle)
    return need


def fits(resources: dict[str, float], bundles: list[dict[str, float]]) -> bool:
    """Whether a node of these total resources can hold every bundle (what it has free is tried)."""
    return all(resources.get(name, 0.0) >= amount for name, amount in _total(bundles).items())


async def _ready(group, timeout_s: float) -> bool:
    try:
        await asyncio.wait_for(asyncio.wrap_future(group.ready().future()), timeout_s)
        return True
    except asyncio.TimeoutError:
        return False


async def place_group(
    config: EngineConfig, *, spread: Counter, last: Collection[str] = (), timeout_s: float | None = None
):
    """A ready STRICT_PACK placement group for one replica, and its node id: pinned to the alive node
    with the fewest replicas (`spread`) that has room, the nodes in `last` (where a replica just died:
    Ray may not know yet that the node is gone) tried last; when none has room, a group that waits for
    room anywhere. The driver's own CPU is left out on a node too small for it. TimeoutError after
    timeout_s (None: wait on)."""
    import ray
    from ray.util.placement_group import placement_group, placement_group_table

    full, lean = replica_bundles(config), replica_bundles(config, driver_cpu=False)
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while True:
        nodes = await asyncio.to_thread(alive_nodes)
        candidates = [(n, full if fits(n.resources, full) else lean) for n in nodes if fits(n.resources, lean)]
        candidates.sort(key=lambda c: (c[0].node_id in last, spread[c[0].node_id], c[0].ip, c[0].node_id))
        for node, bundles in candidates:
            group = placement_group(
                bundles, strategy="STRICT_PACK", bundle_label_selector=[{NODE_ID_LABEL: node.node_id}] * len(bundles)
            )
            if await _ready(group, PLACE_TRY_S):
                return group, node.node_id
            ray.util.remove_placement_group(group)
        bundles = full if any(fits(n.resources, full) for n in nodes) or not candidates else lean
        group = placement_group(bundles, strategy="STRICT_PACK")
        wait = WAIT_FOR_ROOM_S if deadline is None else min(WAIT_FOR_ROOM_S, max(0.0, deadline - time.monotonic()))
        if await _ready(group, wait):
            table = await asyncio.to_thread(placement_group_table, group)
            return group, table["bundles_to_node_id"][0]
        ray.util.remove_placement_group(group)
        if deadline is not None and time.monotonic() >= deadline:
            need = ", ".join(f"{k}: {v:g}" for k, v in sorted(_total(lean).items()))
            raise TimeoutError(f"no node has room for a replica ({{{need}}} on one node) after {timeout_s:.0f} s")


class RayReplicas:
    """`data_parallel_size` RayReplicas spread over the cluster's nodes; one that goes down is placed again."""

    def __init__(
        self,
        config: EngineConfig,
        on_output: OutputSink,
        on_down: DownSink,
        name: str | None = None,
        on_ready: ReadySink | None = None,
    ):
        self.config = config
        self.slots: list[Replica] = []
        self._on_output, self._on_down, self._on_ready = on_output, on_down, on_ready
        self._name = name
        self._failed: dict[str, float] = {}  # node id -> when a replica on it died
        self._tasks: set[asyncio.Task] = set()
        self._generation = Counter()
        self._closing = False

    def _actor_name(self, index: int) -> str | None:
        if not self._name:
            return None
        gen = self._generation[index]
        only = self.config.data_parallel.data_parallel_size == 1 and gen == 0
        return self._name if only else f"{self._name}-{index}.{gen}"

    async def start(self) -> None:
        """Place every replica (spread over the nodes) and start them all; EngineStartError if any fails."""
        size = self.config.data_parallel.data_parallel_size
        placed: list[tuple[object, str]] = []
        try:
            for _ in range(size):
                spread = Counter(node for _, node in placed)
                try:
                    placed.append(await place_group(self.config, spread=spread, timeout_s=START_TIMEOUT_S))
                except TimeoutError as e:
                    raise EngineStartError(f"data_parallel_size: replica {len(placed)} of {size}: {e}") from None
            started = await asyncio.gather(
                *(
                    RayReplica.start(i, self.config, group, self._on_output, self._on_down, self._actor_name(i))
                    for i, (group, _) in enumerate(placed)
                ),
                return_exceptions=True,
            )
        except BaseException:
            _remove_groups(group for group, _ in placed)
            raise
        failed = [e for e in started if isinstance(e, BaseException)]
        if failed:
            await asyncio.gather(*(r.shutdown() for r in started if isinstance(r, RayReplica)))
            _remove_groups(group for group, _ in placed)
            raise failed[0]
        self.slots = list(started)
        for replica in self.slots:
            log.info("%s is up (plans by %s)", replica.where(), replica.transport)
            if replica.state == "down":  # went down before it was in service
                self.replace(replica)

    def replace(self, replica: Replica) -> None:
        """Place a replica again in the slot of one that went down."""
        if self._closing:
            return
        if replica.node_id:
            self._failed[replica.node_id] = time.monotonic()
        if replica.index >= len(self.slots) or self.slots[replica.index] is not replica:
            return  # not in service yet: whoever is starting it retries
        task = asyncio.create_task(self._replace(replica.index), name=f"replica-{replica.index}-place")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _replace(self, index: int) -> None:
        old = self.slots[index]
        old.state, old.node_id, old.node_ip, old.transport = "placing", "", "", ""
        delay = REPLACE_BACKOFF_S[0]
        while not self._closing:
            now = time.monotonic()
            failed = {node for node, when in self._failed.items() if now - when < RECENTLY_FAILED_S}
            spread = Counter(r.node_id for r in self.slots if r.state in ("up", "suspect"))
            group = None
            try:
                group, _ = await place_group(self.config, spread=spread, last=failed)
                self._generation[index] += 1
                replica = await RayReplica.start(
                    index, self.config, group, self._on_output, self._on_down, self._actor_name(index)
                )
            except asyncio.CancelledError:
                if group is not None:
                    _remove_groups([group])
                raise
            except Exception as e:
                if group is not None:
                    _remove_groups([group])
                log.error("replica %d could not be placed again (%s); retrying in %.0f s", index, e, delay)
                await asyncio.sleep(delay)
                delay = min(2 * delay, REPLACE_BACKOFF_S[1])
                continue
            try:
                if self._on_ready is not None and not self._closing:
                    await self._on_ready(replica)
            except BaseException:
                await replica.shutdown()
                raise
            if self._closing:
                await replica.shutdown()
                return
            if replica.state not in ("up", "suspect"):  # went down while catching up: not in service yet
                log.error("replica %d went down before it took requests; retrying in %.0f s", index, delay)
                await asyncio.sleep(delay)
                delay = min(2 * delay, REPLACE_BACKOFF_S[1])
                continue
            self.slots[index] = replica  # no await since on_ready: nothing it caught up on can change first
            log.warning("%s is up again (plans by %s)", replica.where(), replica.transport)
            return

    async def shutdown(self) -> None:
        self._closing = True
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await asyncio.gather(*(r.shutdown() for r in self.slots if isinstance(r, RayReplica)), return_exceptions=True)


def _remove_groups(groups) -> threading.Thread:
    """Remove placement groups on a daemon thread: the call blocks for as long as the cluster's GCS does
    not answer (a stop that takes the local cluster down with it), and nothing may wait on that."""
    import ray

    groups = list(groups)

    def remove() -> None:
        for group in groups:
            with contextlib.suppress(Exception):
                ray.util.remove_placement_group(group)

    thread = threading.Thread(target=remove, name="remove-placement-groups", daemon=True)
    thread.start()
    return thread
