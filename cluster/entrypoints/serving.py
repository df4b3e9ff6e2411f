"""One engine behind every front door in one process: the gRPC gateway, the OpenAI-compatible HTTP
server and a metrics-only HTTP port, each optional, started together and stopped together (the
front doors first, so that in-flight requests drain, then the engine)."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from deltaserve.cluster.config import EngineConfig

from .async_engine import AsyncEngine
from .front_doors import FrontDoors

log = logging.getLogger(__name__)


@dataclass
class Stack:
    engine: AsyncEngine
    doors: FrontDoors
    gateway: object | None = None
    http: object | None = None
    metrics: object | None = None
    ports: dict[str, int] = field(default_factory=dict)  # bound: grpc, http, metrics

    async def stop(self, grace_s: float | None = None) -> str | None:
        """Drain and stop the front doors, then the engine; returns why the engine had failed, if it had."""
        grace = self.doors.grace_s if grace_s is None else grace_s
        try:
            if self.gateway is not None:
                await self.gateway.stop(grace)
            for server in (self.http, self.metrics):
                if server is not None:
                    await server.stop()
        finally:
            failed = self.engine.failed  # read before shutdown, which marks the engine closing
            await self.engine.shutdown()
        return failed


async def start_stack(config: EngineConfig, doors: FrontDoors, backend: str) -> Stack:
    """The AsyncEngine (Ray driver actor or in-process) and the front doors `doors` turns on."""
    engine = await (AsyncEngine.ray(config) if backend == "ray" else AsyncEngine.local(config))
    stack = Stack(engine, doors)
    try:
        if doors.grpc_port is not None:
            from .gateway import Gateway

            stack.gateway = Gateway(
                engine,
                host=doors.host,
                port=doors.grpc_port,
                api_key=doors.api_key,
                ssl_keyfile=doors.ssl_keyfile,
                ssl_certfile=doors.ssl_certfile,
            )
            stack.ports["grpc"] = await stack.gateway.start()
        for name, port, only in (("http", doors.http_port, False), ("metrics", doors.metrics_port, True)):
            if port is None:
                continue
            from .http_server import HttpServer

            server = HttpServer(
                engine,
                host=doors.host,
                port=port,
                api_key=doors.api_key,
                ssl_keyfile=doors.ssl_keyfile,
                ssl_certfile=doors.ssl_certfile,
                metrics_only=only,
                grace_s=doors.grace_s,
                cors=None if only else doors.cors,
            )
            setattr(stack, name, server)
            stack.ports[name] = await server.start()
    except BaseException:
        await stack.stop(0)
        raise
    if doors.api_key is None and doors.host not in ("127.0.0.1", "localhost", "::1"):
        log.warning("serving on %s without --api-key: anyone who reaches this address can use the model", doors.host)
    return stack
