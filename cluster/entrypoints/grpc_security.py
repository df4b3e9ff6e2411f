"""The gRPC side of `--api-key` and TLS: the server's credentials and key check, the client's.

The key travels as call metadata `authorization: Bearer <key>` (as the HTTP server takes it); a call
without it ends UNAUTHENTICATED. grpc.health.v1 stays open, as /health does over HTTP.
"""

from __future__ import annotations

import hmac
from pathlib import Path

import grpc

HEALTH_PREFIX = "/grpc.health.v1.Health/"


def server_credentials(keyfile: str, certfile: str) -> grpc.ServerCredentials:
    return grpc.ssl_server_credentials([(Path(keyfile).read_bytes(), Path(certfile).read_bytes())])


def channel_credentials(root_certificates: str | None) -> grpc.ChannelCredentials:
    """TLS trusting `root_certificates` (a PEM file), or the system's roots when None."""
    roots = Path(root_certificates).read_bytes() if root_certificates else None
    return grpc.ssl_channel_credentials(root_certificates=roots)


def auth_metadata(api_key: str | None) -> tuple[tuple[str, str], ...] | None:
    return (("authorization", f"Bearer {api_key}"),) if api_key else None


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, api_key: str):
        self._expected = f"Bearer {api_key}".encode()

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None or details.method.startswith(HEALTH_PREFIX):
            return handler
        given = dict(details.invocation_metadata or ()).get("authorization", "")
        if isinstance(given, str) and hmac.compare_digest(given.encode(), self._expected):
            return handler
        return _refusal(handler)


def _refusal(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    async def refuse(request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, "authorization: a valid 'Bearer <api key>' is required")

    serializers = dict(
        request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer
    )
    if handler.unary_stream is not None:
        return grpc.unary_stream_rpc_method_handler(refuse, **serializers)
    return grpc.unary_unary_rpc_method_handler(refuse, **serializers)
