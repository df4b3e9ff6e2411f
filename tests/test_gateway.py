"""The gRPC gateway end to end: a real server on 127.0.0.1 in front of a local AsyncEngine (and once
a Ray one), real gRPC clients. Streamed outputs equal LLM.generate's; bad input gets its status and
names the field; the queue limit answers RESOURCE_EXHAUSTED; a cancelled stream frees its pages and
slot at once; a graceful stop lets in-flight streams finish."""

from __future__ import annotations

import asyncio
import contextlib
import io
import math
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import torch
from logprob_checks import assert_entries_close
from serving_harness import (
    CALL_TIMEOUT_S,
    LoopThread,
    Served,
    Streamed,
    collect,
    start_served,
    stop_served,
    wait_for_idle_pool,
)
from tiny_models import VOCAB_SIZE

from deltaserve import LLM, SamplingParams
from deltaserve.cluster.config import EngineConfig
from deltaserve.cluster.entrypoints.async_engine import AsyncEngine
from deltaserve.cluster.entrypoints.client import (
    AsyncGenerationClient,
    GenerationClient,
    generate_request,
    stream_to_terminal,
)
from deltaserve.cluster.entrypoints.gateway import Gateway, run_gateway
from deltaserve.cluster.executors.base import WorkerFailure
from deltaserve.protos import generation_pb2_grpc

pytestmark = pytest.mark.timeout(60)  # a stream that hangs fails its test instead of stalling the suite

LONG = dict(temperature=0, max_tokens=400, ignore_eos=True)  # runs for a second or more on CPU


@pytest.fixture(scope="module")
def model_path(tiny_checkpoints) -> str:
    return str(tiny_checkpoints["qwen3_next"][0])


@pytest.fixture(scope="module")
def reference(model_path) -> Iterator[LLM]:
    llm = LLM(model_path)
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def aio():
    thread = LoopThread()
    yield thread
    thread.close()


@pytest.fixture(scope="module")
def served(aio, model_path):
    served = start_served(aio, EngineConfig.from_kwargs(model=model_path))
    yield served
    stop_served(served)


@pytest.fixture
def client(served) -> Iterator[GenerationClient]:
    with GenerationClient(served.target) as client:
        yield client


@pytest.fixture
def extra_gateway(served):
    """Starts more gateways in front of the shared engine; each is stopped when the test ends."""
    started = []

    def start(**options) -> Gateway:
        gateway = Gateway(served.engine, **options)
        served.aio.run(gateway.start())
        started.append(gateway)
        return gateway

    yield start
    for gateway in started:
        served.aio.run(gateway.stop(0))


def assert_same_as_llm(streamed: Streamed, reference: LLM, prompt, sampling: dict) -> None:
    (expected,) = reference.generate([prompt], SamplingParams(**sampling), use_tqdm=False)
    completion = expected.outputs[0]
    assert streamed.token_ids == completion.token_ids
    assert streamed.text == completion.text
    final = streamed.final
    assert (final.finish_reason, final.stop_reason) == (completion.finish_reason, completion.stop_reason)
    assert (final.prompt_tokens, final.completion_tokens) == (len(expected.prompt_token_ids), len(completion.token_ids))
    assert final.cached_tokens == 0
    assert final.time_to_first_token_s is not None and final.time_to_first_token_s > 0
    if sampling.get("logprobs") is not None:
        streamed_logprobs = [lp for c in streamed.chunks for lp in c.logprobs]
        assert_logprobs_equal(streamed_logprobs, completion.logprobs)
    if sampling.get("prompt_logprobs") is not None:
        assert expected.prompt_logprobs[0] is None
        assert_logprobs_equal(final.prompt_logprobs, expected.prompt_logprobs[1:])


def assert_logprobs_equal(got, expected) -> None:
    # vLLM's shape over gRPC too: the chosen token, then the top k with their ranks and texts
    assert_entries_close(got, expected, atol=1e-5)


def prompts(n: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(3, VOCAB_SIZE, (int(length),), generator=g).tolist() for length in torch.arange(n) % 23 + 1]


# ---- outputs equal LLM.generate --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "prompt, sampling",
    [
        ([5, 17, 42, 99, 7], dict(temperature=0, max_tokens=24, ignore_eos=True)),
        ("the quick brown fox", dict(temperature=0, max_tokens=24)),
        (
            "hello world, serving engines",
            dict(temperature=0.8, top_p=0.9, top_k=40, min_p=0.02, seed=1234, max_tokens=24, ignore_eos=True),
        ),
        (
            [9, 8, 7, 6, 5, 4],
            dict(temperature=1.0, seed=7, presence_penalty=0.5, repetition_penalty=1.2, max_tokens=16, logprobs=3),
        ),
        ("caf\u00e9 na\u00efve r\u00e9sum\u00e9", dict(temperature=0, max_tokens=12, prompt_logprobs=2, logprobs=0)),
    ],
    ids=["greedy-ids", "greedy-text", "seeded", "seeded-penalties-logprobs", "prompt-logprobs"],
)
def test_stream_equals_llm_generate(client, reference, prompt, sampling):
    streamed = collect(client.generate(prompt, timeout_s=CALL_TIMEOUT_S, **sampling))
    assert_same_as_llm(streamed, reference, prompt, sampling)


def test_stop_token_and_stop_string_reasons(client, reference):
    prompt = [11, 12, 13]
    (greedy,) = reference.generate(
        [prompt], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False
    )
    by_token = dict(temperature=0, max_tokens=12, ignore_eos=True, stop_token_ids=[greedy.outputs[0].token_ids[4]])
    streamed = collect(client.generate(prompt, **by_token))
    assert streamed.final.finish_reason == "stop" and streamed.final.stop_reason == by_token["stop_token_ids"][0]
    assert_same_as_llm(streamed, reference, prompt, by_token)
    text = greedy.outputs[0].text
    stop_string = text[len(text) // 2 : len(text) // 2 + 2]
    by_string = dict(temperature=0, max_tokens=12, ignore_eos=True, stop=stop_string)
    streamed = collect(client.generate(prompt, **by_string))
    assert streamed.final.stop_reason == stop_string
    assert_same_as_llm(streamed, reference, prompt, by_string)


def test_32_concurrent_streams(served, reference):
    cases = [
        (prompt, dict(temperature=0, max_tokens=12, ignore_eos=True) if i % 2 else dict(temperature=0.9, seed=i))
        for i, prompt in enumerate(prompts(32))
    ]

    async def stream_all() -> list[Streamed]:
        async with AsyncGenerationClient(served.target) as client:

            async def one(prompt, sampling) -> Streamed:
                return collect([item async for item in client.generate(prompt, timeout_s=CALL_TIMEOUT_S, **sampling)])

            # the async client's unary calls, while the streams run
            queries = asyncio.gather(client.health(), client.tokenize("hello"), client.model_info())
            streams, (health, token_ids, info) = await asyncio.gather(
                asyncio.gather(*(one(p, s) for p, s in cases)), queries
            )
            assert (health, token_ids, info.vocab_size) == ("SERVING", reference.tokenizer.encode("hello"), VOCAB_SIZE)
            return streams

    results = asyncio.run(stream_all())
    expected = reference.generate([p for p, _ in cases], [SamplingParams(**s) for _, s in cases], use_tqdm=False)
    assert [r.token_ids for r in results] == [e.outputs[0].token_ids for e in expected]
    assert [r.text for r in results] == [e.outputs[0].text for e in expected]
    assert len({r.final.request_id for r in results}) == 32  # server-made ids are unique
    wait_for_idle_pool(served)


# ---- bad input -------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "prompt, kwargs, field",
    [
        ("", {}, "prompt"),
        ([], {}, "prompt"),
        (None, {}, "prompt"),
        ([5, VOCAB_SIZE], {}, "prompt_token_ids"),
        ([5, -1], {}, "prompt_token_ids"),
        ([7] * 512, {}, "prompt"),  # max_model_len is 512
        ("hi", {"max_tokens": 0}, "max_tokens"),
        ("hi", {"max_tokens": -3}, "max_tokens"),
        ("hi", {"min_tokens": 5, "max_tokens": 2}, "min_tokens"),
        ("hi", {"temperature": -0.1}, "temperature"),
        ("hi", {"temperature": float("nan")}, "temperature"),
        ("hi", {"temperature": float("inf")}, "temperature"),
        ("hi", {"temperature": 1e300}, "temperature"),  # a finite double, inf in the sampler's float32
        ("hi", {"top_p": float("nan")}, "top_p"),
        ("hi", {"min_p": float("-inf")}, "min_p"),
        ("hi", {"repetition_penalty": float("inf")}, "repetition_penalty"),
        ("hi", {"frequency_penalty": float("nan")}, "frequency_penalty"),
        ("hi", {"stop": ["x" * 20_000]}, "stop"),  # echoed whole, the status outgrew gRPC's header limit
        ("hi", {"stop": ["x"] * 20_000}, "stop"),
        ("hi", {"stop_token_ids": [2**31 - 1] * 20_000}, "stop_token_ids"),
        ("hi", {"top_p": 0.0}, "top_p"),
        ("hi", {"top_p": 1.5}, "top_p"),
        ("hi", {"top_k": -2}, "top_k"),
        ("hi", {"min_p": 2.0}, "min_p"),
        ("hi", {"repetition_penalty": 0.0}, "repetition_penalty"),
        ("hi", {"presence_penalty": 3.0}, "presence_penalty"),
        ("hi", {"frequency_penalty": -2.5}, "frequency_penalty"),
        ("hi", {"seed": -1}, "seed"),
        ("hi", {"stop": [""]}, "stop"),
        ("hi", {"stop": ["x"] * 40}, "stop"),
        ("hi", {"stop": ["x" * 300]}, "stop"),
        ("hi", {"stop_token_ids": [VOCAB_SIZE + 3]}, "stop_token_ids"),
        ("hi", {"stop_token_ids": [3] * 40}, "stop_token_ids"),
        ("hi", {"logprobs": 50}, "logprobs"),
        ("hi", {"prompt_logprobs": -1}, "prompt_logprobs"),
        ("hi", {"n": 0}, "n"),
        ("hi", {"n": 129}, "n"),
        ("hi", {"logit_bias": {VOCAB_SIZE: 1.0}}, "logit_bias"),
        ("hi", {"request_id": "r" * 300}, "request_id"),
        ("hi", {"request_id": "r" * 20_000}, "request_id"),
    ],
)
def test_bad_input_is_invalid_argument_naming_the_field(served, client, prompt, kwargs, field):
    stub = generation_pb2_grpc.GenerationStub(client.channel)
    request = generate_request(prompt if prompt is not None else "", **kwargs)
    if prompt is None:
        request.ClearField("text")
    with pytest.raises(grpc.RpcError) as error:
        list(stub.Generate(request, timeout=CALL_TIMEOUT_S))
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error.value.details().startswith(f"{field}:"), error.value.details()
    assert len(error.value.details().encode()) < 1024
    stats = served.stats()
    assert stats["waiting"] == stats["running"] == 0 and served.engine.num_streams == 0  # nothing was queued
    streamed = collect(client.generate([5, 6], temperature=0, max_tokens=2, ignore_eos=True))
    assert streamed.final.completion_tokens == 2  # and the server keeps serving


@pytest.mark.parametrize("method", ["Generate", "Tokenize", "GetModelInfo"])
def test_bytes_that_are_not_the_message_are_invalid_argument(served, client, method):
    """grpc answers INTERNAL (a server fault) when a request does not parse; the client sent it."""
    path = f"/deltaserve.v1.Generation/{method}"
    call = client.channel.unary_stream(path) if method == "Generate" else client.channel.unary_unary(path)
    text_field = {"Generate": b"\x12", "Tokenize": b"\x0a"}.get(method)
    invalid_utf8 = [text_field + b"\x02\xc3\x28"] if text_field else []  # the text field, not UTF-8
    for garbage in [b"\xff\xff\xff", *invalid_utf8]:  # a truncated tag
        with pytest.raises(grpc.RpcError) as error:
            result = call(garbage, timeout=CALL_TIMEOUT_S)
            list(result) if method == "Generate" else None
        assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT, error.value.details()
        assert error.value.details().startswith("request: not a valid ")
    assert collect(client.generate([5, 6], max_tokens=2, ignore_eos=True)).final.completion_tokens == 2


@pytest.mark.parametrize("temperature", [1e-40, 5e-324, 9e-6])
def test_temperature_below_1e_5_streams_the_greedy_tokens(client, reference, temperature):
    sampling = dict(temperature=temperature, max_tokens=12, ignore_eos=True)
    prompt = [61 + int(-math.log10(temperature)) % 200, 17, 42]  # a prompt of its own: no prefix-cache hit
    streamed = collect(client.generate(prompt, timeout_s=CALL_TIMEOUT_S, **sampling))
    assert_same_as_llm(streamed, reference, prompt, dict(sampling, temperature=0))


def test_duplicate_live_request_id(client, reference):
    sampling = dict(temperature=0, max_tokens=150, ignore_eos=True)
    items = client.generate([3, 4, 5], request_id="same-id", **sampling)
    first = next(items)
    with pytest.raises(grpc.RpcError) as error:
        list(client.generate([6], request_id="same-id", max_tokens=2))
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error.value.details().startswith("request_id:")
    streamed = collect([first, *items])  # the live request's stream is untouched
    assert streamed.final.request_id == "same-id"
    assert_same_as_llm(streamed, reference, [3, 4, 5], sampling)
    again = collect(client.generate([6], request_id="same-id", max_tokens=2))  # reusable once finished
    assert again.final.request_id == "same-id"


def test_oversized_message_is_resource_exhausted(served, extra_gateway):
    small = extra_gateway(max_message_bytes=64 * 1024)
    with GenerationClient(f"127.0.0.1:{small.port}") as client:
        with pytest.raises(grpc.RpcError) as error:
            list(client.generate("x" * 100_000, max_tokens=2))
        assert error.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert client.tokenize("hello") == served.aio.run(served.engine.tokenize("hello"))


def test_queue_limit_is_resource_exhausted(aio, model_path):
    limited = start_served(aio, EngineConfig.from_kwargs(model=model_path, max_num_seqs=1, max_waiting_requests=2))
    try:
        with GenerationClient(limited.target) as client, ThreadPoolExecutor(2) as readers:
            running = client.generate([3, 4, 5], **LONG)
            next(running)  # it holds the only sequence slot
            waiting = [
                readers.submit(collect, client.generate([i + 3], temperature=0, max_tokens=3, ignore_eos=True))
                for i in range(2)
            ]
            deadline = time.monotonic() + 5
            while limited.stats()["waiting"] < 2:
                assert time.monotonic() < deadline, limited.stats()
                time.sleep(0.01)
            with pytest.raises(grpc.RpcError) as error:
                list(client.generate([9], max_tokens=2, timeout_s=5))
            assert error.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "queue is full" in error.value.details()
            running.close()  # frees the slot: the waiting ones run to completion
            assert [w.result(CALL_TIMEOUT_S).final.completion_tokens for w in waiting] == [3, 3]
    finally:
        stop_served(limited)


# ---- cancellation, health, info ---------------------------------------------------------------------


@pytest.mark.parametrize("how", ["cancel", "close_channel"])
def test_leaving_a_stream_frees_its_pages_and_slot(served, how):
    client = GenerationClient(served.target)
    items = client.generate([5] * 40, **LONG)
    next(items)
    next(items)
    assert served.stats()["running"] == 1
    if how == "cancel":
        items.close()
        client.close()
    else:
        client.close()  # the client goes away with its stream still open
    wait_for_idle_pool(served, within_s=1.0)


def test_health_model_info_and_tokenize(served, client, reference):
    assert client.health() == "SERVING"
    assert client.health("deltaserve.v1.Generation") == "SERVING"
    info = client.model_info()
    stats = served.stats()
    assert (info.model, info.model_type, info.family) == (reference.config.load.model, "qwen3_next", "qwen3_next")
    assert (info.vocab_size, info.max_model_len, list(info.eos_token_ids)) == (VOCAB_SIZE, 512, [2])
    assert (info.parallel.tensor_parallel_size, info.parallel.expert_parallel) == (1, False)
    assert (info.pool.kv_pages, info.pool.max_num_seqs) == (stats["total_pages"], stats["total_slots"])
    assert (info.pool.block_size, info.pool.kv_tokens) == (16, stats["total_pages"] * 16)
    assert (info.dtype, info.device) == ("float32", "cpu")  # the dtype in use, not "auto"
    text = "hello world, caf\u00e9"
    assert client.tokenize(text) == reference.tokenizer.encode(text)
    assert client.tokenize("") == []


def test_model_info_reports_the_prefix_cache(client):
    """GetModelInfo's prefix cache: a prompt sent again reuses its cached blocks, and the counts move
    by exactly what the two requests' usage says."""
    prompt = torch.randint(3, VOCAB_SIZE, (53,), generator=torch.Generator().manual_seed(53)).tolist()
    before = client.model_info().prefix_cache
    finals = [collect(client.generate(prompt, max_tokens=2, temperature=0)).final for _ in range(2)]
    after = client.model_info().prefix_cache
    assert after.enabled and after.snapshot_slots > 0 and after.blocks_cached >= 53 // 16
    assert finals[0].cached_tokens == 0 and finals[1].cached_tokens > 0
    assert (after.queries - before.queries, after.query_tokens - before.query_tokens) == (2, 2 * 53)
    assert (after.hits - before.hits, after.hit_tokens - before.hit_tokens) == (1, finals[1].cached_tokens)
    assert after.hit_rate == pytest.approx(after.hit_tokens / after.query_tokens)


def test_engine_down_is_unavailable_and_not_serving(aio, model_path):
    doomed = start_served(aio, EngineConfig.from_kwargs(model=model_path))
    try:
        aio.run(doomed.engine.shutdown())
        with GenerationClient(doomed.target) as client:
            assert client.health() == "NOT_SERVING"
            with pytest.raises(grpc.RpcError) as error:
                list(client.generate("hi", max_tokens=2))
            assert error.value.code() == grpc.StatusCode.UNAVAILABLE
            with pytest.raises(grpc.RpcError) as error:
                client.tokenize("hi")
            assert error.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        aio.run(doomed.gateway.stop(0))


def test_request_failed_by_the_engine_ends_unavailable(served, client, monkeypatch):
    executor = served.engine._replicas[0].loop_engine.engine.executor

    def worker_dies(plan):
        raise WorkerFailure("worker 1 died")

    items = client.generate([4, 5, 6], **LONG)
    next(items)
    monkeypatch.setattr(executor, "execute", worker_dies)
    monkeypatch.setattr(executor, "execute_async", worker_dies)  # the async-scheduling engine launches with it
    with pytest.raises(grpc.RpcError) as error:
        list(items)
    monkeypatch.undo()
    assert error.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "worker 1 died" in error.value.details()
    wait_for_idle_pool(served)
    assert collect(client.generate([4, 5, 6], max_tokens=2)).final.completion_tokens == 2


# ---- stopping ----------------------------------------------------------------------------------------------


def test_graceful_stop_lets_in_flight_streams_finish(served, extra_gateway, reference):
    second = extra_gateway()
    sampling = dict(temperature=0, max_tokens=150, ignore_eos=True)
    with GenerationClient(f"127.0.0.1:{second.port}") as client:
        items = client.generate([8, 9], **sampling)
        first = next(items)
        stopping = served.aio.submit(second.stop(grace_s=20))
        assert new_calls_refused(f"127.0.0.1:{second.port}")
        streamed = collect([first, *items])
        stopping.result(CALL_TIMEOUT_S)
    assert_same_as_llm(streamed, reference, [8, 9], sampling)


def new_calls_refused(target: str) -> bool:
    """Whether a new call is refused within a few seconds (UNAVAILABLE; CANCELLED when it raced the
    server's shutdown)."""
    deadline = time.monotonic() + 5
    with GenerationClient(target) as late:
        while time.monotonic() < deadline:
            try:
                late.health(timeout_s=1)
            except grpc.RpcError as e:
                return e.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)
            time.sleep(0.01)
    return False


def test_stop_cancels_streams_still_running_after_grace(served, extra_gateway):
    second = extra_gateway()
    with GenerationClient(f"127.0.0.1:{second.port}") as client:
        items = client.generate([8, 9], **LONG)
        next(items)
        served.aio.run(second.stop(grace_s=0.1))
        with pytest.raises(grpc.RpcError) as error:
            list(items)
        assert error.value.code() == grpc.StatusCode.UNAVAILABLE  # grpc's "Cancelling all calls"
    wait_for_idle_pool(served)


def test_run_gateway_serves_until_cancelled(served):
    ports = []

    async def start():
        started = asyncio.Event()

        def on_started(port: int) -> None:
            ports.append(port)
            started.set()

        task = asyncio.create_task(run_gateway(served.engine, on_started=on_started))
        await started.wait()
        return task

    async def cancel(task):
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    task = served.aio.run(start())
    try:
        with GenerationClient(f"127.0.0.1:{ports[0]}") as client:
            assert client.health() == "SERVING"
    finally:
        served.aio.run(cancel(task))
    assert new_calls_refused(f"127.0.0.1:{ports[0]}")


def test_stream_to_terminal(served, reference):
    out, err = io.StringIO(), io.StringIO()
    sampling = dict(temperature=0, max_tokens=10, ignore_eos=True)
    assert stream_to_terminal(served.target, "hello there", out=out, err=err, **sampling) == 0
    (expected,) = reference.generate(["hello there"], SamplingParams(**sampling), use_tqdm=False)
    assert out.getvalue() == expected.outputs[0].text + "\n"
    assert err.getvalue().startswith("[length] ") and "+ 10 completion tokens" in err.getvalue()
    out, err = io.StringIO(), io.StringIO()
    assert stream_to_terminal(served.target, "hello", out=out, err=err, top_p=2.0) == 1
    assert err.getvalue().startswith("error: INVALID_ARGUMENT: top_p:")
    out, err = io.StringIO(), io.StringIO()  # the CLI's --priority reaches the server (fcfs refuses it)
    assert stream_to_terminal(served.target, "hello", out=out, err=err, priority=2, cache_salt="s") == 1
    assert err.getvalue().startswith("error: INVALID_ARGUMENT: priority:")
    # n > 1: completion 0 streams, the others follow under their index, a summary line each
    out, err = io.StringIO(), io.StringIO()
    sampled = dict(temperature=1.0, seed=4, max_tokens=6, ignore_eos=True, n=3)
    assert stream_to_terminal(served.target, "hello there", out=out, err=err, **sampled) == 0
    (expected,) = reference.generate(["hello there"], SamplingParams(**sampled), use_tqdm=False)
    texts = [c.text for c in expected.outputs]
    assert out.getvalue() == f"{texts[0]}\n[completion 1]\n{texts[1]}\n[completion 2]\n{texts[2]}\n"
    lines = err.getvalue().splitlines()
    assert [line.split("]")[0] for line in lines] == ["[completion 0", "[completion 1", "[completion 2"]
    assert all("+ 6 completion tokens" in line for line in lines)


# ---- the Ray backend ---------------------------------------------------------------------------------------


async def cancel_while_submitting(engine: AsyncEngine) -> None:
    """A client that leaves while the driver actor is still taking its request (the actor call is in
    flight once the task has run a step): the request must be aborted, not run to max_tokens."""
    submitting = asyncio.create_task(engine.submit("left-early", [3, 4], SamplingParams(**LONG)))
    await asyncio.sleep(0)
    submitting.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await submitting


@pytest.mark.ray
def test_ray_backend_streams_end_to_end(ray_session, aio, model_path, reference):
    engine = aio.run(AsyncEngine.ray(EngineConfig.from_kwargs(model=model_path)), timeout_s=120)
    gateway = Gateway(engine)
    try:
        aio.run(gateway.start())
        sampling = dict(temperature=0.7, seed=5, max_tokens=20, ignore_eos=True, logprobs=1)
        with GenerationClient(f"127.0.0.1:{gateway.port}") as client:
            assert client.health() == "SERVING"
            streamed = collect(client.generate("the lazy dog", timeout_s=CALL_TIMEOUT_S, **sampling))
        assert_same_as_llm(streamed, reference, "the lazy dog", sampling)
        aio.run(cancel_while_submitting(engine))
        wait_for_idle_pool(Served(aio, engine, gateway))
    finally:
        try:
            aio.run(gateway.stop(0))
        finally:
            aio.run(engine.shutdown())


def test_model_info_reports_speculative_decoding(aio, model_path, client):
    """GetModelInfo carries the speculative setting and its acceptance counters; without it, none."""
    assert not client.model_info().HasField("speculative")
    setting = {"method": "mtp", "num_speculative_tokens": 2}
    spec = start_served(aio, EngineConfig.from_kwargs(model=model_path, speculative_config=setting))
    try:
        with GenerationClient(spec.target) as spec_client:
            assert len(list(spec_client.generate([5, 6, 7], max_tokens=6, temperature=0))) > 0
            info = spec_client.model_info().speculative
            assert (info.method, info.num_speculative_tokens) == ("mtp", 2)
            assert info.num_drafts > 0 and info.num_draft_tokens == 2 * info.num_drafts
            assert len(info.accepted_per_position) == 2
            assert info.mean_acceptance_length == 1 + info.num_accepted_tokens / info.num_drafts
    finally:
        stop_served(spec)
