"""AsyncEngine: the asyncio face of the engine that every front door (gRPC gateway, HTTP server) uses.

Behind it are one or more engine replicas (`replicas.py`) and a router (`router.py`): `local` runs one
EngineLoop in this process; `ray` runs `data_parallel_size` Driver actors, each with its worker group
on one node, spread over the Ray cluster, collecting outputs with one long-poll call per batch. Each
request goes to the replica the router picks (least loaded, or prefix-aware) among those answering; a
replica that cannot take the call passes the request to another. Streams are asyncio queues keyed by
request id; a stream whose consumer goes away aborts its request, which frees its pages and slot on
the next loop turn. When a replica goes down its requests in flight end with EngineUnavailableError
(UNAVAILABLE) and the others keep serving while it is placed again.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import AsyncIterator
from pathlib import Path

from deltaserve.cluster.config import EngineConfig
from deltaserve.cluster.core.engine import ModelInfo, ReplicaInfo
from deltaserve.cluster.core.request import RequestOutput
from deltaserve.cluster.core.sampling_params import SamplingParams

from .driver import EngineUnavailableError, QueueFullError
from .replicas import LocalReplica, RayReplicas, Replica, ReplicaUnreachable
from .router import make_router

log = logging.getLogger(__name__)

__all__ = ["AsyncEngine", "EngineUnavailableError", "QueueFullError"]

SERVING = ("up", "suspect")


class AsyncEngine:
    def __init__(self, backend: str, config: EngineConfig):
        self.backend = backend
        self.config = config
        self._replicas: list[Replica] = []
        self._ray: RayReplicas | None = None
        self._router = None
        self._streams: dict[str, asyncio.Queue] = {}
        self._owner: dict[str, Replica] = {}  # request id -> the replica running it
        self._submitting: set[str] = set()  # handed to a replica that has not answered yet
        self._tokenizer = None  # the prefix-aware router's, for text prompts (loaded on first use)
        self._closing = False

    # ---- construction --------------------------------------------------------------------------
    @classmethod
    async def local(cls, config: EngineConfig) -> AsyncEngine:
        """The engine in this process (a thread runs its loop)."""
        if config.data_parallel.data_parallel_size > 1:
            raise ValueError("data_parallel_size: the local backend runs one engine in this process; replicas need Ray")
        engine = cls("local", config)
        replica = await LocalReplica.start(config, engine._dispatch)
        engine._replicas = [replica]
        engine._router = make_router(config.data_parallel.routing, (await replica.model_info()).block_size)
        return engine

    @classmethod
    async def ray(cls, config: EngineConfig, *, name: str | None = None) -> AsyncEngine:
        """`data_parallel_size` Driver actors on the current Ray cluster (ray.init must have run), each
        with its workers on one node; raises EngineStartError (the cause in one line) if one fails."""
        engine = cls("ray", config)
        engine._ray = RayReplicas(config, engine._dispatch, engine._replica_down, name)
        await engine._ray.start()
        engine._replicas = engine._ray.slots
        try:
            block_size = (await engine._replicas[0].model_info()).block_size
        except BaseException:
            await engine._ray.shutdown()
            raise
        engine._router = make_router(config.data_parallel.routing, block_size)
        return engine

    # ---- outputs -------------------------------------------------------------------------------
    def _dispatch(self, replica: Replica, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            if self._owner.get(out.request_id) is not replica:
                continue  # aborted, or its replica was declared down meanwhile
            if out.finished:
                self._release(out.request_id)
            q = self._streams.get(out.request_id)
            if q is not None:
                q.put_nowait(out)

    def _release(self, req_id: str) -> None:
        replica = self._owner.pop(req_id, None)
        if replica is not None:
            replica.in_flight -= 1

    def _replica_down(self, replica: Replica, reason: str) -> None:
        """Its requests in flight end UNAVAILABLE; it is placed again (on a node with room)."""
        error = EngineUnavailableError(f"{replica.where()} failed: {reason}")
        # a request still being handed over is not lost: its submit fails over to another replica
        lost = [req_id for req_id, owner in self._owner.items() if owner is replica and req_id not in self._submitting]
        for req_id in lost:
            self._release(req_id)
            q = self._streams.get(req_id)
            if q is not None:
                q.put_nowait(error)
        if lost:
            log.error("%d request(s) in flight on %s end UNAVAILABLE", len(lost), replica.where())
        if self._ray is not None and not self._closing:
            self._ray.replace(replica)

    # ---- requests ------------------------------------------------------------------------------
    async def submit(self, req_id: str, prompt: str | list[int], params: SamplingParams) -> int:
        """Queue a request on the replica the router picks (ValueError / QueueFullError /
        EngineUnavailableError before queueing)."""
        self._check_up()
        if req_id in self._streams:  # replacing the queue would cut the live request's stream off
            raise ValueError(f"request_id: {req_id!r} is already in use")
        self._streams[req_id] = asyncio.Queue()
        tried: set[int] = set()
        try:
            while True:
                replica = self._route(prompt, tried)
                # owned before the call: its first outputs may come back before the call returns
                self._owner[req_id] = replica
                replica.in_flight += 1
                self._submitting.add(req_id)
                try:
                    num_prompt_tokens = await replica.submit(req_id, prompt, params)
                except ReplicaUnreachable as e:
                    self._release(req_id)
                    tried.add(replica.index)
                    replica.suspect(str(e))
                    continue
                except BaseException:
                    self._release(req_id)
                    raise
                finally:
                    self._submitting.discard(req_id)
                if replica.state not in SERVING:  # taken, then its replica went down: lost with it
                    self._release(req_id)
                    raise EngineUnavailableError(f"{replica.where()} failed: {replica.failure}")
                replica.routed += 1
                return num_prompt_tokens
        except BaseException:
            self._streams.pop(req_id, None)
            raise

    def _route(self, prompt: str | list[int], tried: set[int]) -> Replica:
        """The replica for a request: among those answering (suspect ones only when no other is)."""
        for states in (("up",), ("suspect",)):
            candidates = [r for r in self._replicas if r.state in states and r.index not in tried]
            if candidates:
                ids = self._token_ids(prompt) if self._router.needs_token_ids else None
                return candidates[self._router.choose(candidates, ids)]
        raise EngineUnavailableError(self._why_down())

    def _token_ids(self, prompt: str | list[int]) -> list[int] | None:
        if not isinstance(prompt, str):
            return list(prompt) if isinstance(prompt, list | tuple) else None
        if self._tokenizer is None:
            from deltaserve.cluster.core.tokenizer import Tokenizer

            model = self.config.load.model
            if model is None or not (Path(model) / "tokenizer.json").is_file():
                return None
            self._tokenizer = Tokenizer(model)
        return self._tokenizer.encode(prompt)

    async def stream(self, req_id: str) -> AsyncIterator[RequestOutput]:
        """Outputs of a submitted request until it finishes; leaving early aborts it."""
        q = self._streams[req_id]
        finished = False
        try:
            while True:
                item = await q.get()
                if isinstance(item, Exception):
                    raise item
                yield item
                if item.finished:
                    finished = True
                    return
        finally:
            self._streams.pop(req_id, None)
            if not finished:
                await self.abort(req_id)

    async def generate(self, req_id: str, prompt: str | list[int], params: SamplingParams):
        await self.submit(req_id, prompt, params)
        async for out in self.stream(req_id):
            yield out

    async def abort(self, req_id: str) -> None:
        replica = self._owner.get(req_id)
        if replica is None:
            return
        self._release(req_id)
        if replica.state in SERVING:
            await replica.abort(req_id)

    # ---- queries -------------------------------------------------------------------------------
    def _serving(self) -> list[Replica]:
        self._check_up()
        up = [r for r in self._replicas if r.state == "up"]
        return up or [r for r in self._replicas if r.state in SERVING]

    async def tokenize(self, text: str) -> list[int]:
        return await self._serving()[0].tokenize(text)

    async def info(self) -> ModelInfo:
        """The model (from a replica that answers), with every replica's place and load."""
        info = await self._serving()[0].model_info()
        return dataclasses.replace(
            info, data_parallel_size=self.config.data_parallel.data_parallel_size, replicas=self.replica_infos()
        )

    def replica_infos(self) -> tuple[ReplicaInfo, ...]:
        return tuple(r.info() for r in self._replicas)

    async def stats(self) -> dict:
        """The serving replicas' counts added up, and each replica's own under `replicas`."""
        serving = self._serving()
        each = await asyncio.gather(*(r.stats() for r in serving), return_exceptions=True)
        total: dict = {}
        per_replica = []
        for replica, stats in zip(serving, each, strict=True):
            if isinstance(stats, BaseException):
                continue
            for key, value in stats.items():
                total[key] = total.get(key, 0) + value
            per_replica.append({"index": replica.index, **stats})
        total["replicas"] = per_replica
        return total

    async def healthy(self) -> bool:
        return not self._closing and any(r.state in SERVING for r in self._replicas)

    def _check_up(self) -> None:
        if self._closing:
            raise EngineUnavailableError("the engine is shutting down")
        if not any(r.state in SERVING for r in self._replicas):
            raise EngineUnavailableError(self._why_down())

    def _why_down(self) -> str:
        failures = [r.failure for r in self._replicas if r.failure]
        placing = sum(r.state == "placing" for r in self._replicas)
        why = failures[-1] if failures else "no replica is up"
        return why + (f" ({placing} replica(s) being placed again)" if placing else "")

    @property
    def num_streams(self) -> int:
        return len(self._streams)

    async def shutdown(self) -> None:
        self._closing = True
        if self._ray is not None:
            await self._ray.shutdown()
        else:
            await asyncio.gather(*(r.shutdown() for r in self._replicas))
