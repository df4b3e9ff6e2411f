"""The front doors in one process (start_stack on a loop thread, the tiny chat model): the queue limit
is 429 over HTTP, the API key and TLS hold over HTTP and gRPC, and an engine that is down is 503
(health too) while /metrics still answers."""

from __future__ import annotations

import asyncio
import datetime
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import grpc
import httpx
import openai
import pytest

from deltaserve.cluster.config import EngineConfig
from deltaserve.cluster.entrypoints.client import GenerationClient
from deltaserve.cluster.entrypoints.front_doors import FrontDoors
from deltaserve.cluster.entrypoints.serving import Stack, start_stack

pytestmark = pytest.mark.timeout(120)

MODEL = "tiny-chat"
KEY = "s3cret-key"


class Served:
    """A Stack on an asyncio loop of its own thread (the test's clients block)."""

    def __init__(self, config: EngineConfig, doors: FrontDoors, backend: str = "local"):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="http-limits-loop", daemon=True)
        self.thread.start()
        try:
            self.stack: Stack = self.run(start_stack(config, doors, backend))
        except BaseException:
            self.close()
            raise

    def run(self, coro, timeout_s: float = 60):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    def url(self, scheme: str = "http") -> str:
        return f"{scheme}://127.0.0.1:{self.stack.ports['http']}"

    def stop(self) -> None:
        try:
            self.run(self.stack.stop(0))
        finally:
            self.close()

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join()
        self.loop.close()


def config(model, **settings) -> EngineConfig:
    return EngineConfig.from_kwargs(model=str(model), served_model_name=MODEL, max_model_len=512, **settings)


@pytest.fixture(scope="module")
def narrow(tiny_chat_model) -> Iterator[Served]:
    """One sequence at a time and one waiting place: a burst overflows the queue."""
    doors = FrontDoors(host="127.0.0.1", grpc_port=None, http_port=0, grace_s=1)
    served = Served(config(tiny_chat_model, max_num_seqs=1, max_waiting_requests=1), doors)
    yield served
    served.stop()


def test_a_full_queue_is_429_and_counted(narrow):
    client = openai.OpenAI(base_url=narrow.url() + "/v1", api_key="unused", max_retries=0, timeout=60)

    def one(i: int) -> str:
        try:
            client.completions.create(
                model=MODEL, prompt="hello", max_tokens=30, temperature=0, extra_body={"ignore_eos": True}
            )
            return "ok"
        except openai.RateLimitError as e:
            assert e.body["type"] == "rate_limit_exceeded" and "queue is full" in e.body["message"]
            return "429"

    with ThreadPoolExecutor(8) as pool:
        outcomes = list(pool.map(one, range(8)))
    assert outcomes.count("ok") >= 1 and outcomes.count("429") >= 1, outcomes
    metrics = httpx.get(narrow.url() + "/metrics").text
    refused = f'deltaserve:requests_refused_total{{engine="0",model_name="{MODEL}",reason="queue_full"}}'
    assert f"{refused} {float(outcomes.count('429'))}" in metrics
    # once the burst is over, requests are served again
    assert client.completions.create(model=MODEL, prompt="hello", max_tokens=2).choices[0].text is not None


def test_an_engine_that_is_down_is_503(tiny_chat_model):
    served = Served(config(tiny_chat_model), FrontDoors(host="127.0.0.1", grpc_port=None, http_port=0, grace_s=1))
    try:
        assert httpx.get(served.url() + "/health").status_code == 200
        served.run(served.stack.engine.shutdown())  # the HTTP server stays up in front of a stopped engine
        response = httpx.post(served.url() + "/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        assert response.status_code == 503
        assert response.json()["error"]["type"] == "service_unavailable"
        response = httpx.post(
            served.url() + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]}
        )
        assert response.status_code == 503
        assert httpx.get(served.url() + "/health").status_code == 503
        metrics = httpx.get(served.url() + "/metrics")
        assert metrics.status_code == 200 and "vllm:request_success_total" in metrics.text
        assert "vllm:num_requests_running" not in metrics.text  # the engine's gauges need the engine
    finally:
        served.run(served.stack.http.stop())
        served.close()


# ---- API key and TLS --------------------------------------------------------------------------------
def self_signed(tmp_path) -> tuple[str, str]:
    """A key and a certificate for 127.0.0.1 / localhost, made here (nothing leaves the machine)."""
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    key_path, cert_path = tmp_path / "key.pem", tmp_path / "cert.pem"
    key_path.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return str(key_path), str(cert_path)


def test_api_key_and_tls_over_http_and_grpc(tiny_chat_model, tmp_path):
    keyfile, certfile = self_signed(tmp_path)
    doors = FrontDoors(
        host="127.0.0.1", grpc_port=0, http_port=0, api_key=KEY, ssl_keyfile=keyfile, ssl_certfile=certfile, grace_s=1
    )
    served = Served(config(tiny_chat_model), doors)
    try:
        url = served.url("https")
        with pytest.raises(httpx.ConnectError):  # a certificate the client does not trust
            httpx.get(url + "/health")
        with pytest.raises(httpx.HTTPError):  # plain HTTP on a TLS port
            httpx.get(served.url("http") + "/health")
        body = {"prompt": "hi", "max_tokens": 3}
        no_key = httpx.post(url + "/v1/completions", json=body, verify=certfile)
        assert no_key.status_code == 401 and no_key.json()["error"]["type"] == "authentication_error"
        wrong = httpx.post(url + "/v1/completions", json=body, verify=certfile, headers={"Authorization": "Bearer x"})
        assert wrong.status_code == 401
        assert httpx.get(url + "/health", verify=certfile).status_code == 200  # health and metrics stay open
        assert httpx.get(url + "/metrics", verify=certfile).status_code == 200
        client = openai.OpenAI(
            base_url=url + "/v1", api_key=KEY, max_retries=0, http_client=httpx.Client(verify=certfile)
        )
        assert client.completions.create(model=MODEL, prompt="hi", max_tokens=3).usage.completion_tokens == 3

        target = f"localhost:{served.stack.ports['grpc']}"
        with GenerationClient(target, root_certificates=certfile) as plain:
            with pytest.raises(grpc.RpcError) as error:
                list(plain.generate("hi", max_tokens=2))
            assert error.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert plain.health() == "SERVING"
        with GenerationClient(target, root_certificates=certfile, api_key=KEY) as keyed:
            items = list(keyed.generate("hi", max_tokens=2))
            assert items[-1].completion_tokens == 2
    finally:
        served.stop()


@pytest.mark.ray
def test_http_in_front_of_the_ray_driver(ray_session, tiny_chat_model):
    """Under `serve` the engine runs in a Ray driver actor: the HTTP server streams from it, and /metrics
    (served by this process) carries the engine's gauges gathered there and the queue time it measured."""
    doors = FrontDoors(host="127.0.0.1", grpc_port=None, http_port=0, grace_s=1)
    served = Served(config(tiny_chat_model), doors, backend="ray")
    try:
        client = openai.OpenAI(base_url=served.url() + "/v1", api_key="unused", max_retries=0, timeout=60)
        chunks = list(
            client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4, stream=True
            )
        )
        assert chunks[0].choices[0].delta.role == "assistant"
        assert chunks[-1].choices[0].finish_reason in ("stop", "length")
        text = httpx.get(served.url() + "/metrics").text
        labels = f'{{engine="0",model_name="{MODEL}"}}'
        for line in (
            f"vllm:num_requests_running{labels} 0.0",
            f"vllm:request_queue_time_seconds_count{labels} 1.0",
            f"deltaserve:gdn_state_slots_used{labels} 0.0",
        ):
            assert line in text, line
        assert f"vllm:prefix_cache_queries_total{labels}" in text
    finally:
        served.stop()
