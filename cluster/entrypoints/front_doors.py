"""Where and how `serve` listens: the front doors' ports, bind address, API key, TLS files and the
HTTP API's CORS policy (browsers' cross-origin calls: any origin by default, as vLLM's).

The default bind address is 0.0.0.0 (every interface, as vLLM's): a server meant only for this
machine takes `--host 127.0.0.1`; one reachable from elsewhere should take `--api-key` (and TLS).
Kept free of the engine's imports, so that `deltaserve serve --help` stays fast.
"""

from __future__ import annotations

from dataclasses import dataclass, field

DEFAULT_HOST = "0.0.0.0"
DEFAULT_GRPC_PORT = 50051
DEFAULT_HTTP_PORT = 8000


@dataclass(frozen=True)
class Cors:
    """The HTTP API's answer to browsers' cross-origin requests (vLLM's --allowed-origins and friends);
    no origins: no CORS headers at all."""

    allowed_origins: tuple[str, ...] = ("*",)
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)
    allow_credentials: bool = False

    def __post_init__(self) -> None:
        if self.allow_credentials and "*" in self.allowed_origins:
            raise ValueError("allow_credentials: needs --allowed-origins naming the origins (not '*')")


def origins_list(text: str) -> tuple[str, ...]:
    """A flag's list of origins, methods or headers: JSON (vLLM's form, '["*"]') or comma-separated."""
    import json

    text = text.strip()
    if text.startswith("["):
        try:
            items = json.loads(text)
        except ValueError:
            raise ValueError(f"not a JSON list: {text[:80]!r}") from None
        if not isinstance(items, list) or not all(isinstance(i, str) for i in items):
            raise ValueError(f"must be a list of strings: {text[:80]!r}")
        return tuple(items)
    return tuple(part.strip() for part in text.split(",") if part.strip())


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
    cors: Cors = field(default_factory=lambda: Cors())

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
