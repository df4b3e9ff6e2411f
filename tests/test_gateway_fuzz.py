"""A property-based fuzz of the gRPC gateway (hypothesis): arbitrary GenerateRequest and TokenizeRequest
messages (numbers at and past every edge, huge and empty repeated fields, no prompt) and random bytes
as a message. The rule: every call ends OK or with a documented status (never UNKNOWN or INTERNAL,
never a hung stream); an error message stays under 1 kB, and a bad-input error names its field first;
afterwards the server serves the same greedy tokens as before, with every page and slot free.

Bounded: DELTASERVE_FUZZ_EXAMPLES examples per property (default 150), each call under a deadline."""

from __future__ import annotations

import math
import os
import time

import grpc
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from serving_harness import (
    RELATED_FIELDS,
    LoopThread,
    collect,
    edge_values,
    error_problem,
    generate_requests,
    one_bad_field,
    start_served,
    stop_served,
    texts,
    wait_for_idle_pool,
)
from tiny_models import VOCAB_SIZE

from deltaserve.cluster.config import EngineConfig
from deltaserve.cluster.entrypoints.client import GenerationClient, generate_request
from deltaserve.protos import generation_pb2 as pb
from deltaserve.protos import generation_pb2_grpc

EXAMPLES = int(os.environ.get("DELTASERVE_FUZZ_EXAMPLES", "150"))
CALL_DEADLINE_S = 20  # max_model_len 64 keeps any valid generation well under it
# the statuses protos/generation.proto documents (OK aside)
DOCUMENTED = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNAVAILABLE}
FLOAT32_MAX = float(np.finfo(np.float32).max)
PROBES = [[5, 6, 7], [40, 41, 42, 43, 44], [100] * 20]  # greedy prompts checked before and after

pytestmark = pytest.mark.timeout(600)
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    database=None,  # nothing written into the checkout
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.function_scoped_fixture],
)


class Tally:
    def __init__(self):
        self.calls = 0
        self.codes: dict[str, int] = {}
        self.started = time.monotonic()

    def add(self, code: grpc.StatusCode) -> None:
        self.calls += 1
        self.codes[code.name] = self.codes.get(code.name, 0) + 1


@pytest.fixture(scope="module")
def served(tiny_checkpoints):
    aio = LoopThread()
    served = start_served(aio, EngineConfig.from_kwargs(model=str(tiny_checkpoints["qwen3_next"][0]), max_model_len=64))
    yield served
    stop_served(served)
    aio.close()


@pytest.fixture(scope="module")
def client(served):
    with GenerationClient(served.target) as client:
        yield client


@pytest.fixture(scope="module")
def tally():
    return Tally()


def greedy_tokens(client: GenerationClient) -> list[list[int]]:
    return [
        collect(client.generate(p, temperature=0, max_tokens=8, ignore_eos=True, timeout_s=CALL_DEADLINE_S)).token_ids
        for p in PROBES
    ]


@pytest.fixture(scope="module")
def before(client) -> list[list[int]]:
    return greedy_tokens(client)


def call_ends_by_the_rule(
    call, tally: Tally, *, streaming: bool, refused: bool = False, fields: set[str] | None = None
) -> None:
    """`refused`: the request must not be served (a float NaN, inf or beyond float32). `fields`: the
    only names a bad-input error may give."""
    try:
        result = call()
        if streaming:
            for _ in result:
                pass
        tally.add(grpc.StatusCode.OK)
        assert not refused, "served a request with a non-finite number"
    except grpc.RpcError as e:
        code, details = e.code(), e.details() or ""
        tally.add(code)
        assert code != grpc.StatusCode.DEADLINE_EXCEEDED, "the call hung"
        assert code in DOCUMENTED, f"{code.name}: {details[:300]}"
        problem = error_problem(code == grpc.StatusCode.INVALID_ARGUMENT, details)
        assert problem is None, f"{code.name}: {problem}"
        if fields is not None:
            assert code == grpc.StatusCode.INVALID_ARGUMENT and details.split(":")[0] in fields, details[:300]


def non_finite(fields: dict) -> bool:
    """Whether a float field is NaN, inf or beyond float32 (what the sampler computes in)."""
    return any(isinstance(v, float) and not (math.isfinite(v) and abs(v) <= FLOAT32_MAX) for v in fields.values())


def as_message(prompt, request_id: str, fields: dict) -> pb.GenerateRequest:
    request = generate_request(prompt if prompt is not None else "", request_id=request_id, **fields)
    if prompt is None:
        request.ClearField("text")
    return request


@FUZZ
@given(generate_requests(VOCAB_SIZE))
def test_generate_requests_end_by_the_rule(served, client, before, tally, case):
    stub = generation_pb2_grpc.GenerationStub(client.channel)
    request = as_message(*case)
    call = lambda: stub.Generate(request, timeout=CALL_DEADLINE_S)  # noqa: E731
    call_ends_by_the_rule(call, tally, streaming=True, refused=non_finite(case[2]))


@pytest.mark.parametrize("name, value", edge_values(), ids=lambda v: str(v)[:20])
def test_every_edge_value_of_every_field(served, client, before, tally, name, value):
    """A valid request with one field at an edge is served, or refused naming that field; non-finite
    floats are refused."""
    stub = generation_pb2_grpc.GenerationStub(client.channel)
    request = as_message([5, 6, 7], "", {"max_tokens": 2, name: value})
    call = lambda: stub.Generate(request, timeout=CALL_DEADLINE_S)  # noqa: E731
    named = {name} | RELATED_FIELDS.get(name, set())
    call_ends_by_the_rule(call, tally, streaming=True, refused=non_finite({name: value}), fields=named)


@FUZZ
@given(one_bad_field(VOCAB_SIZE))
def test_one_bad_field_is_the_one_named(served, client, before, tally, case):
    """A valid request with one field at or past its edge is served, or refused naming that field."""
    prompt, name, fields = case
    stub = generation_pb2_grpc.GenerationStub(client.channel)
    request = as_message(prompt, "", fields)
    call = lambda: stub.Generate(request, timeout=CALL_DEADLINE_S)  # noqa: E731
    named = {name} | RELATED_FIELDS.get(name, set())
    call_ends_by_the_rule(call, tally, streaming=True, refused=non_finite({name: fields[name]}), fields=named)


@FUZZ
@given(texts())
def test_tokenize_requests_end_by_the_rule(served, client, before, tally, text):
    stub = generation_pb2_grpc.GenerationStub(client.channel)
    call_ends_by_the_rule(
        lambda: stub.Tokenize(pb.TokenizeRequest(text=text), timeout=CALL_DEADLINE_S), tally, streaming=False
    )


@FUZZ
@given(st.sampled_from(["Generate", "Tokenize", "GetModelInfo"]), st.binary(max_size=300))
def test_random_bytes_end_by_the_rule(served, client, before, tally, method, data):
    path = f"/deltaserve.v1.Generation/{method}"
    streaming = method == "Generate"
    call = client.channel.unary_stream(path) if streaming else client.channel.unary_unary(path)
    call_ends_by_the_rule(lambda: call(data, timeout=CALL_DEADLINE_S), tally, streaming=streaming)


def test_after_the_fuzz_the_server_serves_the_same_tokens(served, client, before, tally, report):
    assert greedy_tokens(client) == before
    wait_for_idle_pool(served, within_s=5.0)
    assert tally.calls >= 4 * EXAMPLES * 0.9 + len(edge_values())  # hypothesis ran (nearly) every example
    codes = ", ".join(f"{name} {n}" for name, n in sorted(tally.codes.items()))
    elapsed = time.monotonic() - tally.started
    report(f"gateway fuzz: {tally.calls} examples tried in {elapsed:.0f} s ({codes}); the same greedy tokens after")
