"""Where and how `serve` listens: the front doors' ports, bind address, API key and TLS files.

The default bind address is 0.0.0.0 (every interface, as vLLM's): a server meant only for this
machine takes `--host 127.0.0.1`; one reachable from elsewhere should take `--api-key` (and TLS).
Kept free of the engine's imports, so that `deltaserve serve --help` stays fast.
"""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_HOST = "0.0.0.0"
DEFAULT_GRPC_PORT = 50051
DEFAULT_HTTP_PORT = 8000


@dataclass(frozen=True)
class FrontDoors:
    """Where and how to serve; a port of None is off, 0 picks a free one."""

    host: str = DEFAULT_HOST
    grpc_port: int | None = DEFAULT_GRPC_PORT
    http_port: int | None = DEFAULT_HTTP_PORT
    metrics_port: int | None = None
    api_key: str | None = None
    ssl_keyfile: str | None = None
    ssl_certfile: str | None = None
    grace_s: float = 30.0

    def __post_init__(self) -> None:
        if self.grpc_port is None and self.http_port is None and self.metrics_port is None:
            raise ValueError("port: gRPC and HTTP are both off; nothing would serve")
        if (self.ssl_keyfile is None) != (self.ssl_certfile is None):
            raise ValueError("ssl_certfile: TLS needs both --ssl-keyfile and --ssl-certfile")

    @property
    def ports(self) -> dict[str, int]:
        """The enabled ports by name (what check_port looks at before anything starts)."""
        named = {"port": self.grpc_port, "http_port": self.http_port, "metrics_port": self.metrics_port}
        return {name: port for name, port in named.items() if port is not None}
