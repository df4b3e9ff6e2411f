"""`deltaserve serve` (a subprocess on 127.0.0.1, the tiny model with the demo's chat template) through
the real `openai` client: completions and chat completions, streamed and not, give the same tokens as
gRPC and LLM.generate / LLM.chat for the same request; bad input is a 400 naming the field and the
server keeps serving; a client that leaves aborts its request (the pool frees); OpenAI's
`response_format` and vLLM's `structured_outputs` constrain the output as SamplingParams'
structured_outputs does in LLM.generate; /metrics, parsed by prometheus_client, counts exactly what a
`bench serve --backend openai` run sent and received."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest
from logprob_checks import assert_entries_close
from prometheus_client.parser import text_string_to_metric_families

import deltaserve
from deltaserve import LLM, SamplingParams, StructuredOutputsParams
from deltaserve.cli import main
from deltaserve.cluster.entrypoints.client import Chunk, Final, GenerationClient

pytestmark = pytest.mark.timeout(120)

MODEL = "tiny-chat"
STARTUP_TIMEOUT_S = 90
LONG = dict(max_tokens=400, temperature=0, extra_body={"ignore_eos": True})  # a second or more on CPU
CHAT = [{"role": "system", "content": "hello world"}, {"role": "user", "content": "the quick brown fox"}]
SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0, "maximum": 99}},
    "required": ["ok", "n"],
}
CHOICES = ["yes", "no", "maybe so"]


@dataclass
class Server:
    process: subprocess.Popen
    http_port: int
    grpc_port: int

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    def metrics(self) -> dict[tuple[str, tuple], float]:
        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        return {
            (sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in text_string_to_metric_families(text)
            for sample in family.samples
        }

    def metric(self, name: str, **labels) -> float:
        wanted = {"model_name": MODEL, "engine": "0", **labels}
        return self.metrics()[(name, tuple(sorted(wanted.items())))]


def start_server(model: Path, tmp: Path, *extra: str) -> Server:
    grpc_file, http_file = tmp / "grpc.port", tmp / "http.port"
    argv = [sys.executable, "-m", "deltaserve.cli", "serve", "--backend", "local", "--model", str(model)]
    argv += ["--host", "127.0.0.1", "--port", "0", "--http-port", "0", "--served-model-name", MODEL]
    argv += ["--port-file", str(grpc_file), "--http-port-file", str(http_file), *extra]
    process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while not (http_file.is_file() and http_file.read_text() and grpc_file.is_file() and grpc_file.read_text()):
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            raise RuntimeError(f"serve did not start: {process.communicate()[0][-2000:]}")
        time.sleep(0.2)
    return Server(process, int(http_file.read_text()), int(grpc_file.read_text()))


def stop_server(server: Server) -> None:
    server.process.send_signal(signal.SIGINT)
    try:
        server.process.wait(30)
    except subprocess.TimeoutExpired:
        server.process.kill()
        server.process.wait()


@pytest.fixture(scope="module")
def server(tiny_chat_model, tmp_path_factory) -> Iterator[Server]:
    served = start_server(tiny_chat_model, tmp_path_factory.mktemp("serve"), "--max-model-len", "512")
    yield served
    stop_server(served)
    assert served.process.returncode == 0


@pytest.fixture(scope="module")
def reference(tiny_chat_model) -> Iterator[LLM]:
    llm = LLM(str(tiny_chat_model), max_model_len=512)
    yield llm
    llm.shutdown()


@pytest.fixture
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)


def grpc_tokens(server: Server, prompt, **sampling) -> tuple[list[int], str]:
    ids, text = [], ""
    with GenerationClient(f"127.0.0.1:{server.grpc_port}") as grpc_client:
        for item in grpc_client.generate(prompt, **sampling):
            if isinstance(item, Chunk):
                ids += item.token_ids
                text += item.text
            else:
                assert isinstance(item, Final)
    return ids, text


def wait_idle(server: Server, within_s: float = 3.0) -> None:
    """Nothing running or waiting, no GDN state slot held and no KV page in use, within `within_s`."""
    deadline = time.monotonic() + within_s
    while True:
        held = (
            server.metric("vllm:num_requests_running"),
            server.metric("vllm:num_requests_waiting"),
            server.metric("deltaserve:gdn_state_slots_used"),
            server.metric("vllm:kv_cache_usage_perc"),
        )
        if held == (0, 0, 0, 0):
            return
        assert time.monotonic() < deadline, f"still held (running, waiting, slots, kv usage): {held}"
        time.sleep(0.05)


# ---- the same tokens through every door -----------------------------------------------------------
def test_completions_equal_grpc_and_llm_generate(server, client, reference):
    prompt = "the quick brown fox"
    (want,) = reference.generate(
        [prompt], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False
    )
    want_ids, want_text = want.outputs[0].token_ids, want.outputs[0].text
    whole = client.completions.create(
        model=MODEL,
        prompt=prompt,
        max_tokens=12,
        temperature=0,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    choice = whole.choices[0]
    assert (choice.token_ids, choice.text, choice.finish_reason) == (want_ids, want_text, "length")
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (len(want.prompt_token_ids), 12)
    assert whole.model == MODEL and whole.object == "text_completion"

    ids, text, finish, usage = [], "", None, None
    stream = client.completions.create(
        model=MODEL,
        prompt=prompt,
        max_tokens=12,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    for chunk in stream:
        if chunk.usage is not None:
            assert not chunk.choices  # the usage comes last, on a chunk of its own
            usage = chunk.usage
            continue
        ids += chunk.choices[0].token_ids
        text += chunk.choices[0].text
        finish = chunk.choices[0].finish_reason or finish
    assert (ids, text, finish) == (want_ids, want_text, "length")
    n = len(want.prompt_token_ids)
    assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (n, 12, n + 12)
    assert grpc_tokens(server, prompt, max_tokens=12, temperature=0, ignore_eos=True) == (want_ids, want_text)


def test_n_completions_through_every_door(server, client, reference):
    """n = 3, seeded: completion i is LLM.generate's completion i, as the choice of index i whole or
    streamed (each choice's deltas under its index, one finish reason each), chat alike (a role chunk
    per choice), and over gRPC (chunks under their index, a Final per completion)."""
    prompt, sampling = "the quick brown fox", dict(temperature=1.0, seed=9, max_tokens=8)
    extra = {"ignore_eos": True, "return_token_ids": True}
    (want,) = reference.generate([prompt], SamplingParams(**sampling, n=3, ignore_eos=True), use_tqdm=False)
    want_ids = [c.token_ids for c in want.outputs]
    assert len({tuple(i) for i in want_ids}) > 1

    whole = client.completions.create(model=MODEL, prompt=prompt, n=3, **sampling, extra_body=extra)
    assert [(c.index, c.token_ids, c.text) for c in whole.choices] == [
        (i, c.token_ids, c.text) for i, c in enumerate(want.outputs)
    ]
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (len(want.prompt_token_ids), 24)
    streamed, finishes = {i: [] for i in range(3)}, {i: [] for i in range(3)}
    for chunk in client.completions.create(model=MODEL, prompt=prompt, n=3, stream=True, **sampling, extra_body=extra):
        for c in chunk.choices:
            streamed[c.index] += c.token_ids or []
            finishes[c.index] += [c.finish_reason] if c.finish_reason else []
    assert [streamed[i] for i in range(3)] == want_ids and all(f == ["length"] for f in finishes.values())

    (chat_want,) = reference.chat(CHAT, SamplingParams(**sampling, n=2, ignore_eos=True), use_tqdm=False)
    roles, contents = {}, {0: "", 1: ""}
    for chunk in client.chat.completions.create(
        model=MODEL, messages=CHAT, n=2, stream=True, **sampling, extra_body=extra
    ):
        for c in chunk.choices:
            roles[c.index] = roles.get(c.index) or c.delta.role
            contents[c.index] += c.delta.content or ""
    assert roles == {0: "assistant", 1: "assistant"} and [contents[0], contents[1]] == [
        c.text for c in chat_want.outputs
    ]

    chunks, finals = {}, {}
    with GenerationClient(f"127.0.0.1:{server.grpc_port}") as grpc_client:
        for item in grpc_client.generate(prompt, n=3, ignore_eos=True, **sampling):
            if isinstance(item, Chunk):
                chunks.setdefault(item.index, []).extend(item.token_ids)
            else:
                finals[item.index] = item
    assert [chunks[i] for i in range(3)] == want_ids
    assert sorted(finals) == [0, 1, 2] and {f.completion_tokens for f in finals.values()} == {8}
    wait_idle(server)


def test_echo_and_a_list_of_prompts_as_lm_eval_sends_them(server, client, reference):
    """lm-eval-harness's loglikelihood request: several prompts, echo, logprobs 1, max_tokens 1. Each
    choice, in prompt order, is its prompt then its completion: the text, and the token logprobs (the
    first token's null) equal to LLM.generate's prompt_logprobs and logprobs; usage adds up."""
    prompts = ["the quick brown fox", "hello world", "the quick brown fox jumps"]
    got = client.completions.create(model=MODEL, prompt=prompts, echo=True, logprobs=1, max_tokens=1, temperature=0)
    params = SamplingParams(temperature=0, max_tokens=1, logprobs=1, prompt_logprobs=1)
    want = reference.generate(prompts, params, use_tqdm=False)
    assert [c.index for c in got.choices] == [0, 1, 2]
    for choice, w, text in zip(got.choices, want, prompts, strict=True):
        assert choice.text == text + w.outputs[0].text
        lp, n = choice.logprobs, len(w.prompt_token_ids)
        assert len(lp.tokens) == n + 1 and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        expected = [next(iter(e.values())).logprob for e in w.prompt_logprobs[1:]] + [w.outputs[0].cumulative_logprob]
        assert lp.token_logprobs[1:] == pytest.approx(expected, abs=1e-4)
        assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    assert got.usage.prompt_tokens == sum(len(w.prompt_token_ids) for w in want) and got.usage.completion_tokens == 3
    # streamed: the same choices, as the chunks of each index put together, under one id
    streamed = client.completions.create(
        model=MODEL,
        prompt=prompts,
        echo=True,
        logprobs=1,
        max_tokens=1,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    assert_streamed_equal(list(streamed), got)
    wait_idle(server)


def assert_streamed_equal(chunks, whole) -> None:
    """Chunks put together by choice index equal the whole response's choices (text, logprobs, ids,
    finish reasons) and usage; one id throughout."""
    assert len({c.id for c in chunks}) == 1
    text, lps, ids, finish = {}, {}, {}, {}
    for chunk in chunks:
        for choice in chunk.choices:
            i = choice.index
            text[i] = text.get(i, "") + choice.text
            if choice.logprobs is not None:
                entry = lps.setdefault(i, {"tokens": [], "token_logprobs": [], "text_offset": []})
                for key in entry:
                    entry[key] += getattr(choice.logprobs, key)
            ids.setdefault(i, []).extend(getattr(choice, "token_ids", None) or [])
            finish[i] = choice.finish_reason or finish.get(i)
    assert sorted(text) == [c.index for c in whole.choices]
    for choice in whole.choices:
        i = choice.index
        assert (text[i], finish[i]) == (choice.text, choice.finish_reason)
        if choice.logprobs is not None:
            assert lps[i]["tokens"] == choice.logprobs.tokens and lps[i]["text_offset"] == choice.logprobs.text_offset
            assert lps[i]["token_logprobs"] == pytest.approx(choice.logprobs.token_logprobs, abs=1e-5)
        assert ids[i] == (getattr(choice, "token_ids", None) or [])
    usage = [c.usage for c in chunks if c.usage is not None]
    assert usage and usage[-1].model_dump() == whole.usage.model_dump()


def test_a_list_of_prompts_streams_with_n_and_echo(server, client):
    """Two token-id prompts, n = 2, echo, token ids: choice i * 2 + index; each index's chunks put together
    are the whole response's choice (seeded: the same draws)."""
    body = dict(model=MODEL, prompt=[[11, 12, 13, 14], [21, 22, 23]], n=2, max_tokens=5, seed=3)
    body |= dict(echo=True, extra_body={"return_token_ids": True, "ignore_eos": True})
    whole = client.completions.create(**body)
    assert [c.index for c in whole.choices] == [0, 1, 2, 3]
    assert whole.choices[1].token_ids[:4] == [11, 12, 13, 14] and whole.choices[3].token_ids[:3] == [21, 22, 23]
    chunks = list(client.completions.create(**body, stream=True, stream_options={"include_usage": True}))
    assert_streamed_equal(chunks, whole)
    firsts = {}
    for chunk in chunks:
        for choice in chunk.choices:
            firsts.setdefault(choice.index, choice)
    assert [firsts[i].prompt_token_ids is not None for i in range(4)] == [True] * 4  # vLLM's: with the first chunk
    wait_idle(server)


def test_chat_equals_grpc_chat_and_llm_chat(server, client, reference):
    (want,) = reference.chat(CHAT, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True), use_tqdm=False)
    want_ids, want_text = want.outputs[0].token_ids, want.outputs[0].text
    whole = client.chat.completions.create(
        model=MODEL,
        messages=CHAT,
        max_completion_tokens=10,
        temperature=0,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    choice = whole.choices[0]
    assert (choice.message.role, choice.message.content, choice.token_ids) == ("assistant", want_text, want_ids)
    assert whole.usage.prompt_tokens == len(want.prompt_token_ids)
    assert whole.prompt_token_ids == want.prompt_token_ids  # the template rendered as LLM.chat renders it

    roles, text, ids = [], "", []
    for chunk in client.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=10, temperature=0, stream=True, extra_body={"ignore_eos": True}
    ):
        delta = chunk.choices[0].delta
        roles.append(delta.role)
        text += delta.content or ""
    assert roles[0] == "assistant" and text == want_text
    ids, text = grpc_tokens(server, CHAT, max_tokens=10, temperature=0, ignore_eos=True)
    assert (ids, text) == (want_ids, want_text)


def test_sampling_fields_reach_the_engine(client, reference):
    """Seeded sampling with penalties and top_p, then a stop string taken from that output: the same as
    LLM.generate's."""
    prompt = "hello world, hello there!"
    fields = dict(temperature=0.9, top_p=0.8, seed=11, presence_penalty=0.5, frequency_penalty=0.3)
    (free,) = reference.generate([prompt], SamplingParams(**fields, max_tokens=20, ignore_eos=True), use_tqdm=False)
    got = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=20, extra_body={"ignore_eos": True}, **fields
    )
    assert got.choices[0].text == free.outputs[0].text
    stop = free.outputs[0].text[6:8]
    params = SamplingParams(**fields, max_tokens=20, stop=[stop], ignore_eos=True)
    want = reference.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    got = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=20, stop=stop, extra_body={"ignore_eos": True}, **fields
    ).choices[0]
    assert (got.text, got.finish_reason, got.stop_reason) == (want.text, "stop", stop)
    assert len(got.text) <= 6
    # logit_bias (OpenAI's, token ids as keys): as LLM.generate's, through HTTP and gRPC
    bias = {"77": 100.0, "12": -5.0}
    want = reference.generate(
        [prompt], SamplingParams(**fields, max_tokens=5, logit_bias={77: 100.0, 12: -5.0}), use_tqdm=False
    )[0].outputs[0]
    assert want.token_ids == [77] * 5
    got = client.completions.create(model=MODEL, prompt=prompt, max_tokens=5, logit_bias=bias, **fields)
    assert got.choices[0].text == want.text


def test_logprobs_equal_llm_generate(client, reference):
    prompt = "serving engines stream tokens"
    (want,) = reference.generate([prompt], SamplingParams(temperature=0, max_tokens=6, logprobs=2), use_tqdm=False)
    entries = want.outputs[0].logprobs
    legacy = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0, logprobs=2)
    lp = legacy.choices[0].logprobs
    assert lp.tokens == [next(iter(e.values())).decoded_token for e in entries]
    assert lp.token_logprobs == pytest.approx([next(iter(e.values())).logprob for e in entries], abs=1e-5)
    for top, entry in zip(lp.top_logprobs, entries, strict=True):
        ranked = sorted(entry.values(), key=lambda x: x.rank)[:2]
        assert top == pytest.approx({x.decoded_token: x.logprob for x in ranked}, abs=1e-5)
    assert lp.text_offset[0] == 0

    (chat_want,) = reference.chat(CHAT, SamplingParams(temperature=0, max_tokens=4, logprobs=3), use_tqdm=False)
    got = client.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=4, temperature=0, logprobs=True, top_logprobs=3
    ).choices[0]
    rebuilt = []
    for token in got.logprobs.content:
        assert token.bytes == list(token.token.encode())
        top = [t for t in token.top_logprobs]
        assert len(top) == 3
        rebuilt.append(token)
    want_entries = chat_want.outputs[0].logprobs
    assert [t.token for t in rebuilt] == [next(iter(e.values())).decoded_token for e in want_entries]
    assert [t.logprob for t in rebuilt] == pytest.approx(
        [next(iter(e.values())).logprob for e in want_entries], abs=1e-5
    )


def test_grpc_logprobs_are_vllm_shaped(server, reference):
    params = dict(temperature=0, max_tokens=5, logprobs=2)
    (want,) = reference.generate(["hello there"], SamplingParams(**params), use_tqdm=False)
    with GenerationClient(f"127.0.0.1:{server.grpc_port}") as grpc_client:
        chunks = [c for c in grpc_client.generate("hello there", **params) if isinstance(c, Chunk)]
    assert_entries_close([e for c in chunks for e in c.logprobs], want.outputs[0].logprobs)


def test_tokenize_and_detokenize_as_the_engine_does(server, client, reference):
    """/tokenize gives the ids a completion's prompt runs on (a chat's: the chat completion's own
    prompt_token_ids), /detokenize their text back; bad input is a 400 naming the field."""
    text = "the quick brown fox <|im_end|> jumps"
    got = httpx.post(f"{server.url}/tokenize", json={"prompt": text, "return_token_strs": True}).json()
    ids = reference.tokenizer.encode(text)
    assert (got["tokens"], got["count"], got["max_model_len"]) == (ids, len(ids), 512)
    assert "".join(got["token_strs"]) == text
    assert httpx.post(f"{server.url}/detokenize", json={"tokens": ids, "model": MODEL}).json() == {"prompt": text}

    ask = {"return_token_ids": True}
    chat = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=1, extra_body=ask)
    got = httpx.post(f"{server.url}/tokenize", json={"messages": CHAT}).json()
    assert got["tokens"] == chat.prompt_token_ids and got["count"] == chat.usage.prompt_tokens
    no_prompt = httpx.post(f"{server.url}/tokenize", json={"messages": CHAT, "add_generation_prompt": False}).json()
    assert no_prompt["tokens"] == got["tokens"][: no_prompt["count"]] and no_prompt["count"] < got["count"]

    for route, body, field in [
        ("tokenize", {}, "prompt"),
        ("tokenize", {"prompt": "a", "messages": CHAT}, "prompt"),
        ("tokenize", {"messages": [{"role": "robot", "content": "hi"}]}, "messages[0].role"),
        ("detokenize", {"tokens": [5, 10**9]}, "tokens"),
        ("detokenize", {"tokens": [5], "model": "nope"}, "model"),
    ]:
        response = httpx.post(f"{server.url}/{route}", json=body)
        assert response.status_code in (400, 404), response.text
        assert response.json()["error"]["message"].startswith(field), response.text
    assert httpx.get(f"{server.url}/version").json() == {"version": deltaserve.__version__}


def test_models_and_an_unknown_model(server, client):
    (card,) = client.models.list().data
    assert (card.id, card.max_model_len, card.owned_by) == (MODEL, 512, "deltaserve")
    with pytest.raises(openai.NotFoundError) as error:
        client.completions.create(model="gpt-4", prompt="hi", max_tokens=2)
    assert error.value.body["param"] == "model" and error.value.body["code"] == "model_not_found"
    assert httpx.get(f"{server.url}/health").status_code == 200


# ---- structured output -----------------------------------------------------------------------------------
def constrained(**constraint) -> dict:
    return dict(structured_outputs=StructuredOutputsParams(**constraint))


def test_response_format_equals_llm_chat_with_structured_outputs(client, reference):
    greedy = dict(temperature=0, max_tokens=80)  # the schema's object closes after 55 tokens
    for response_format, constraint in [
        ({"type": "json_schema", "json_schema": {"name": "r", "schema": SCHEMA, "strict": True}}, {"json": SCHEMA}),
        ({"type": "json_object"}, {"json_object": True}),  # the random model stays inside a string: length
    ]:
        (want,) = reference.chat(CHAT, SamplingParams(**greedy, **constrained(**constraint)), use_tqdm=False)
        got = client.chat.completions.create(
            model=MODEL, messages=CHAT, response_format=response_format, extra_body={"return_token_ids": True}, **greedy
        ).choices[0]
        assert (got.token_ids, got.message.content) == (want.outputs[0].token_ids, want.outputs[0].text)
        assert got.finish_reason == want.outputs[0].finish_reason
        if got.finish_reason == "stop":
            jsonschema.validate(json.loads(got.message.content), SCHEMA)
        assert response_format["type"] == "json_object" or got.finish_reason == "stop"


def test_structured_outputs_field_equals_llm_generate_streamed(client, reference):
    """vLLM's `structured_outputs` body field, on completions, sampled and streamed."""
    sampling = dict(temperature=1.0, seed=5, max_tokens=20)
    for constraint in ({"choice": CHOICES}, {"regex": r"[a-z]{2,6}-[0-9]{2}"}):
        (want,) = reference.generate(["hello"], SamplingParams(**sampling, **constrained(**constraint)), use_tqdm=False)
        text = ""
        for chunk in client.completions.create(
            model=MODEL, prompt="hello", stream=True, extra_body={"structured_outputs": constraint}, **sampling
        ):
            text += chunk.choices[0].text
        assert text == want.outputs[0].text
    assert text != "" and want.outputs[0].finish_reason == "stop"


# ---- bad input ------------------------------------------------------------------------------------------
BAD = [
    ("completions", b'{"model": "tiny-chat", "prompt": "hi", "max_tokens": 4', "body"),  # malformed JSON
    ("completions", {"prompt": "hi", "temperature": "hot"}, "temperature"),  # a wrong type
    ("completions", {"prompt": "hi", "max_tokenz": 4}, "max_tokenz"),  # an unknown field
    ("completions", {"prompt": "hi", "temperature": -1}, "temperature"),  # SamplingParams refuses it
    ("completions", {"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ("completions", {"prompt": "hi", "n": 0}, "n"),
    ("completions", {"prompt": "hi", "n": 129}, "n"),
    ("completions", {"prompt": "hi", "logit_bias": {"x": 1}}, "logit_bias"),
    ("completions", {"prompt": "hi", "logit_bias": {"3": 500}}, "logit_bias"),
    ("completions", {"prompt": [7] * 600}, "prompt"),  # over max_model_len
    ("completions", {"prompt": [400]}, "prompt_token_ids"),  # outside the vocabulary
    ("completions", {"prompt": "hi", "stop": ["x" * 20000]}, "stop"),  # a long value is not echoed
    ("chat/completions", {"messages": []}, "messages"),  # an empty chat
    ("chat/completions", {"messages": [{"role": "robot", "content": "hi"}]}, "messages[0].role"),
    ("chat/completions", {"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ("chat/completions", {"messages": [{"role": "user", "content": "the quick brown fox " * 200}]}, "messages"),
    ("chat/completions", {"messages": CHAT, "logprobs": True, "top_logprobs": 99}, "top_logprobs"),
    ("chat/completions", {"messages": CHAT, "chat_template_kwargs": {"messages": []}}, "chat_template_kwargs"),
    ("chat/completions", {"messages": CHAT, "stream_options": {"include_usage": True}}, "stream_options"),
    ("completions", {"prompt": "hi", "request_id": "r" * 300}, "request_id"),
    ("completions", {"prompt": "hi", "priority": 1}, "priority"),  # the server schedules fcfs
    ("chat/completions", {"messages": CHAT, "priority": 2**40}, "priority"),
    ("completions", {"prompt": "hi", "cache_salt": "s" * 300}, "cache_salt"),
    ("chat/completions", {"messages": CHAT, "response_format": {"type": "xml"}}, "response_format.type"),
    ("chat/completions", {"messages": CHAT, "response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    (
        "chat/completions",
        {"messages": CHAT, "response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "strin"}}}},
        "response_format.json_schema.schema",
    ),
    ("completions", {"prompt": "hi", "structured_outputs": {"regexp": "a+"}}, "structured_outputs.regexp"),
    ("completions", {"prompt": "hi", "structured_outputs": {"regex": "(unclosed"}}, "structured_outputs.regex"),
    ("completions", {"prompt": "hi", "structured_outputs": {}}, "structured_outputs"),
    (
        "completions",
        {"prompt": "hi", "structured_outputs": {"choice": ["a"]}, "response_format": {"type": "json_object"}},
        "structured_outputs",
    ),
]


@pytest.mark.parametrize("route, body, field", BAD, ids=[f"{r}-{f}-{i}" for i, (r, _, f) in enumerate(BAD)])
def test_bad_input_is_400_naming_the_field(server, client, route, body, field):
    url = f"{server.url}/v1/{route}"
    if isinstance(body, bytes):
        response = httpx.post(url, content=body, headers={"content-type": "application/json"})
    else:
        response = httpx.post(url, json={"model": MODEL, **body})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["param"], error["type"]) == (field, "invalid_request_error")
    assert error["message"].startswith(f"{field}: ") and len(error["message"]) < 600
    # and the server keeps serving
    assert client.completions.create(model=MODEL, prompt="hi", max_tokens=2).choices[0].finish_reason


def test_cache_salt_keeps_prefix_cache_entries_apart(server, client):
    """A prompt again under its salt reuses its cached blocks; under another salt, or none, it does
    not (vLLM's `cache_salt`); gRPC's field the same."""
    prompt = [5 + (i * 7) % 250 for i in range(150)]

    def cached(salt: str | None) -> int:
        extra = {} if salt is None else {"cache_salt": salt}
        out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, extra_body=extra)
        return out.usage.prompt_tokens_details.cached_tokens

    assert cached("tenant-a") == 0
    assert cached("tenant-a") >= 128
    assert cached("tenant-b") == 0
    assert cached(None) == 0
    with GenerationClient(f"127.0.0.1:{server.grpc_port}") as grpc_client:
        finals = [list(grpc_client.generate(prompt, max_tokens=2, cache_salt=s))[-1] for s in ("tenant-b", "c")]
    assert [f.cached_tokens for f in finals] == [finals[0].cached_tokens, 0] and finals[0].cached_tokens >= 128


def test_grpc_chat_checks_the_same_way(server):
    import grpc

    with GenerationClient(f"127.0.0.1:{server.grpc_port}") as grpc_client:
        for messages, field in [
            ([{"role": "robot", "content": "hi"}], "messages[0].role"),
            ([{"role": "user", "content": "the quick brown fox " * 200}], "prompt"),
        ]:
            with pytest.raises(grpc.RpcError) as error:
                list(grpc_client.generate(messages, max_tokens=2))
            assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert error.value.details().startswith(f"{field}: ")
        for options, field in [({"priority": 3}, "priority"), ({"cache_salt": "s" * 257}, "cache_salt")]:
            with pytest.raises(grpc.RpcError) as error:
                list(grpc_client.generate("hi", max_tokens=2, **options))
            assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert error.value.details().startswith(f"{field}: ")


def test_openai_client_raises_bad_request(client):
    with pytest.raises(openai.BadRequestError) as error:
        client.chat.completions.create(model=MODEL, messages=[], max_tokens=2)
    assert error.value.body["param"] == "messages"


# ---- leaving early ---------------------------------------------------------------------------------------
def test_a_client_that_leaves_a_stream_aborts_its_request(server, client):
    aborted = server.metric("vllm:request_success_total", finished_reason="abort")
    generated = server.metric("vllm:generation_tokens_total")
    stream = client.completions.create(model=MODEL, prompt="hello", stream=True, **LONG)
    for i, _ in enumerate(stream):
        if i == 2:
            break
    stream.close()  # the connection goes; the server aborts the request
    wait_idle(server)
    assert server.metric("vllm:request_success_total", finished_reason="abort") == aborted + 1
    assert server.metric("vllm:generation_tokens_total") - generated < 400


@pytest.mark.parametrize(
    "body, requests",
    [({"prompt": "hello", "n": 3}, 1), ({"prompt": ["hello", "world", "again"]}, 3)],
    ids=["n-completions", "list-of-prompts"],
)
def test_a_client_that_leaves_a_stream_of_several_aborts_them_all(server, client, body, requests):
    """n completions (one request) or a list of prompts (a request each): a client that leaves the
    stream aborts every one of them, and every page and state slot is freed."""
    aborted = server.metric("vllm:request_success_total", finished_reason="abort")
    stream = client.completions.create(model=MODEL, stream=True, **body, **LONG)
    for i, _ in enumerate(stream):
        if i == 6:
            break
    stream.close()
    wait_idle(server)
    assert server.metric("vllm:request_success_total", finished_reason="abort") == aborted + requests


def test_a_client_that_leaves_a_whole_request_aborts_it(server):
    aborted = server.metric("vllm:request_success_total", finished_reason="abort")
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 400, "temperature": 0, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/v1/completions", json=body, timeout=httpx.Timeout(10, read=0.3))
    wait_idle(server)
    assert server.metric("vllm:request_success_total", finished_reason="abort") == aborted + 1


# ---- metrics after a benchmark ------------------------------------------------------------------------------
def test_metrics_count_what_bench_serve_sent_and_received(server, tmp_path):
    before = server.metrics()
    report = tmp_path / "bench.json"
    argv = ["bench", "serve", "--backend", "openai", "--target", server.url, "--num-prompts", "8"]
    argv += ["--max-concurrency", "3", "--input-len", "9", "--output-len", "5", "--num-warmups", "0"]
    assert main([*argv, "--json", str(report), "--save-requests"]) == 0
    import json

    result = json.loads(report.read_text())
    assert (result["completed"], result["failed"]) == (8, 0)
    assert (result["total_input_tokens"], result["total_output_tokens"]) == (8 * 9, 8 * 5)
    assert all(r["completion_tokens"] == 5 and r["finish_reason"] == "length" for r in result["requests"])
    after = server.metrics()

    def grew(name: str, **labels) -> float:
        key = (name, tuple(sorted({"model_name": MODEL, "engine": "0", **labels}.items())))
        return after[key] - before.get(key, 0.0)

    assert grew("vllm:request_success_total", finished_reason="length") == 8
    assert grew("vllm:prompt_tokens_total") == result["total_input_tokens"]
    assert grew("vllm:generation_tokens_total") == result["total_output_tokens"]
    assert grew("vllm:e2e_request_latency_seconds_count") == 8
    assert grew("vllm:time_to_first_token_seconds_count") == 8
    assert grew("vllm:inter_token_latency_seconds_count") == 8 * 4  # each stream's gaps between its 5 tokens
    assert grew("vllm:request_queue_time_seconds_count") == 8
    assert after[("vllm:num_requests_running", (("engine", "0"), ("model_name", MODEL)))] == 0


def test_serve_refuses_bad_front_door_settings(tiny_chat_model):
    def serve(*flags: str) -> subprocess.CompletedProcess:
        argv = [sys.executable, "-m", "deltaserve.cli", "serve", "--backend", "local", "--model", str(tiny_chat_model)]
        return subprocess.run([*argv, *flags], capture_output=True, text=True, timeout=60, env=os.environ)

    for flags, field in [
        (("--port", "off", "--http-port", "off"), "port"),
        (("--ssl-keyfile", "/nonexistent.key", "--ssl-certfile", "/nonexistent.pem"), "ssl_keyfile"),
        (("--chat-template", "/nonexistent.jinja"), "chat_template"),
        (("--port", "0", "--http-port", "abc"), "--http-port"),
    ]:
        done = serve(*flags)
        assert done.returncode == 2, (flags, done.stderr)
        assert field in done.stderr.strip().splitlines()[-1], (flags, done.stderr)
