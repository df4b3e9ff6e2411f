"""The HTTP API's CORS policy (`serve --allowed-origins ...`, vLLM's flags): a browser's preflight from
an allowed origin is answered before the API key is asked for, with the origin, methods and headers
allowed; another origin gets no allowance; answers carry the allowance; any origin by default, none
with an empty list; the flags parse JSON lists or commas, and credentials need named origins."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from deltaserve.cli import build_parser
from deltaserve.cluster.entrypoints.front_doors import Cors, FrontDoors, origins_list
from deltaserve.cluster.entrypoints.http_server import HttpServer

APP = "https://app.example"
PREFLIGHT = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization,content-type"}


class _Engine:
    """What the routes below touch of an engine: /health's answer."""

    async def healthy(self) -> bool:
        return True


def client(cors: Cors | None, api_key: str | None = None) -> TestClient:
    return TestClient(HttpServer(_Engine(), api_key=api_key, cors=cors).app)


def test_an_allowed_origin_is_answered_and_another_is_not():
    http = client(Cors((APP,), ("GET", "POST"), ("authorization", "content-type")), api_key="secret")
    ok = http.options("/v1/chat/completions", headers={"Origin": APP, **PREFLIGHT})
    assert ok.status_code == 200, ok.text  # before the key: a preflight carries none
    assert ok.headers["access-control-allow-origin"] == APP
    assert "POST" in ok.headers["access-control-allow-methods"]
    assert "authorization" in ok.headers["access-control-allow-headers"].lower()
    other = http.options("/v1/chat/completions", headers={"Origin": "https://evil.example", **PREFLIGHT})
    assert other.status_code == 400 and "access-control-allow-origin" not in other.headers
    refused = http.get("/v1/models", headers={"Origin": APP})  # the key is still required
    assert refused.status_code == 401 and refused.headers["access-control-allow-origin"] == APP
    health = http.get("/health", headers={"Origin": APP})
    assert health.status_code == 200 and health.headers["access-control-allow-origin"] == APP


def test_any_origin_by_default_and_none_when_off():
    assert FrontDoors().cors == Cors()
    anyone = client(FrontDoors().cors).get("/health", headers={"Origin": "https://anywhere.example"})
    assert anyone.headers["access-control-allow-origin"] == "*"
    off = client(Cors(allowed_origins=())).get("/health", headers={"Origin": APP})
    assert off.status_code == 200 and "access-control-allow-origin" not in off.headers


def test_the_flags():
    assert origins_list('["https://a.example", "https://b.example"]') == ("https://a.example", "https://b.example")
    assert origins_list("https://a.example, https://b.example") == ("https://a.example", "https://b.example")
    assert origins_list("[]") == ()
    with pytest.raises(ValueError, match="not a JSON list"):
        origins_list("[oops")
    with pytest.raises(ValueError, match="^allow_credentials: needs --allowed-origins"):
        Cors(allow_credentials=True)
    args = build_parser(["serve"]).parse_args(["serve", "--allowed-origins", APP, "--allow-credentials"])
    assert (args.allowed_origins, args.allow_credentials) == ((APP,), True)
    with pytest.raises(SystemExit):
        build_parser(["serve"]).parse_args(["serve", "--allowed-origins", "[1, 2]"])
