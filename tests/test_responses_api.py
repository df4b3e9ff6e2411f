"""OpenAI's Responses API (`POST /v1/responses`) through the real `openai` client: a response is the
chat completion of the same conversation (instructions, messages, function calls and their outputs)
read back as output items (reasoning, message, function calls) with usage in the Responses shape
(reasoning tokens counted to `</think>`); streamed, its events put together are the whole response;
`previous_response_id` continues a stored response exactly as resending its history does; bad input
is a 400 naming the Responses field."""

from __future__ import annotations

import json
import re
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

from deltaserve.cluster.config import EngineConfig
from deltaserve.cluster.entrypoints.front_doors import FrontDoors

sys.path.insert(0, str(Path(__file__).parent))
from test_http_limits import MODEL, Served  # noqa: E402

pytestmark = pytest.mark.timeout(120)

TOOL = {
    "type": "function",
    "name": "get_weather",
    "description": "the weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
}
CHAT_TOOL = {"type": "function", "function": {k: v for k, v in TOOL.items() if k != "type"}}
CALL = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
THOUGHT = "I should call it.\n"
TEXT = f"{THOUGHT}</think>\n\n<tool_call>\n{CALL}\n</tool_call>"
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}


def regex(text: str) -> dict:
    pattern = text.replace("{", r"\{").replace("}", r"\}").replace(".", r"\.")
    return {"structured_outputs": {"regex": pattern}, "chat_template_kwargs": {"enable_thinking": True}}


@pytest.fixture(scope="module")
def served(tiny_chat_model):
    doors = FrontDoors(host="127.0.0.1", grpc_port=None, http_port=0, grace_s=1)
    settings = dict(served_model_name=MODEL, max_model_len=2048, reasoning_parser="qwen3", tool_call_parser="hermes")
    server = Served(EngineConfig.from_kwargs(model=str(tiny_chat_model), **settings), doors)
    yield server
    server.stop()


@pytest.fixture
def client(served) -> openai.OpenAI:
    return openai.OpenAI(base_url=served.url() + "/v1", api_key="unused", max_retries=0, timeout=60)


def test_a_text_answer_is_the_chat_completion(client):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"}]
    chat = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=9, temperature=0, extra_body=NO_THINKING
    )
    got = client.responses.create(
        model=MODEL, instructions="be brief", input="hello there", max_output_tokens=9, temperature=0,
        extra_body=NO_THINKING,
    )  # fmt: skip
    assert got.object == "response" and got.id.startswith("resp_") and got.model == MODEL
    assert [item.type for item in got.output] == ["message"]
    assert got.output_text == chat.choices[0].message.content and got.output[0].role == "assistant"
    usage = got.usage
    assert (usage.input_tokens, usage.output_tokens) == (chat.usage.prompt_tokens, chat.usage.completion_tokens)
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    assert usage.output_tokens_details.reasoning_tokens == 0
    # nine tokens of noise end at max_output_tokens
    assert chat.choices[0].finish_reason == "length"
    assert (got.status, got.incomplete_details.reason) == ("incomplete", "max_output_tokens")


def test_reasoning_and_a_function_call_whole_and_streamed(client, served):
    """The constrained tiny model reasons, then calls a function: a reasoning item and a function
    call item, its reasoning tokens those before `</think>` (the chat's own ids); the stream's items
    and its completed response are the whole response's."""
    request = dict(model=MODEL, input="weather in Paris?", tools=[TOOL], max_output_tokens=200, temperature=0)
    got = client.responses.create(**request, extra_body=regex(TEXT))
    assert got.status == "completed" and [item.type for item in got.output] == ["reasoning", "function_call"]
    reasoning, call = got.output
    assert [part.text for part in reasoning.content] == [THOUGHT]
    assert (call.name, json.loads(call.arguments), call.status) == ("get_weather", {"city": "Paris"}, "completed")
    assert call.call_id.startswith("call_") and call.id.startswith("fc_")

    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "weather in Paris?"}], tools=[CHAT_TOOL],
        max_tokens=200, temperature=0, extra_body={**regex(TEXT), "return_token_ids": True},
    )  # fmt: skip
    ids = chat.choices[0].token_ids  # the leading tokens whose text is the thought's
    text = [
        httpx.post(f"{served.url()}/detokenize", json={"tokens": ids[:m]}).json()["prompt"] for m in range(len(ids))
    ]
    thought = max(m for m in range(len(ids)) if THOUGHT.startswith(text[m]))
    assert text[thought] == THOUGHT and got.usage.output_tokens_details.reasoning_tokens == thought
    assert got.usage.output_tokens == chat.usage.completion_tokens

    events = list(client.responses.create(**request, stream=True, extra_body=regex(TEXT)))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    reasoning_text = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert reasoning_text == THOUGHT
    done = [e.item for e in events if e.type == "response.output_item.done"]
    final = events[-1].response
    assert [i.model_dump(exclude={"id", "call_id"}) for i in done] == [
        i.model_dump(exclude={"id", "call_id"}) for i in got.output
    ]
    assert [i.model_dump() for i in final.output] == [i.model_dump() for i in done]
    cached = {"input_tokens_details"}  # the second run of the prompt finds it cached
    assert final.usage.model_dump(exclude=cached) == got.usage.model_dump(exclude=cached)
    assert final.usage.input_tokens_details.cached_tokens > 0
    args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert json.loads(args) == {"city": "Paris"}


def test_a_function_output_continues_as_the_chat_does(client, served):
    """The second turn (the call and its output as input items, or previous_response_id) renders the
    chat the chat completion renders, and answers it the same; stored responses can be read and deleted."""
    first = client.responses.create(
        model=MODEL, input="weather in Paris?", tools=[TOOL], max_output_tokens=200, temperature=0,
        extra_body=regex(TEXT),
    )  # fmt: skip
    call = first.output[1]
    output = {"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21 C"}
    history = [
        {"role": "user", "content": "weather in Paris?"},
        {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": THOUGHT}]},
        {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
        output,
    ]  # fmt: skip
    again = dict(model=MODEL, tools=[TOOL], max_output_tokens=6, temperature=0, extra_body=NO_THINKING)
    resent = client.responses.create(input=history, **again)
    chained = client.responses.create(input=[output], previous_response_id=first.id, **again)

    messages = [
        {"role": "user", "content": "weather in Paris?"},
        {"role": "assistant", "content": "", "reasoning_content": THOUGHT, "tool_calls": [
            {"id": call.call_id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}
        ]},
        {"role": "tool", "tool_call_id": call.call_id, "content": "sunny, 21 C"},
    ]  # fmt: skip
    chat = client.chat.completions.create(
        model=MODEL, messages=messages, tools=[CHAT_TOOL], max_tokens=6, temperature=0, extra_body=NO_THINKING
    )
    tokens = httpx.post(f"{served.url()}/tokenize", json={"messages": messages, "tools": [CHAT_TOOL], **NO_THINKING})
    for got in (resent, chained):
        assert got.usage.input_tokens == chat.usage.prompt_tokens == tokens.json()["count"]
        assert got.output_text == chat.choices[0].message.content
    assert chained.previous_response_id == first.id

    stored = httpx.get(f"{served.url()}/v1/responses/{first.id}").json()
    assert stored["id"] == first.id and stored["output"][1]["call_id"] == call.call_id
    assert httpx.delete(f"{served.url()}/v1/responses/{first.id}").json()["deleted"] is True
    assert httpx.get(f"{served.url()}/v1/responses/{first.id}").status_code == 404
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(input=[output], previous_response_id=first.id, **again)
    assert e.value.body["message"].startswith("previous_response_id: ")
    unstored = client.responses.create(model=MODEL, input="hi", max_output_tokens=2, store=False)
    assert httpx.get(f"{served.url()}/v1/responses/{unstored.id}").status_code == 404


def test_reasoning_effort_none_turns_thinking_off(client):
    """OpenAI's reasoning.effort "none" (or "minimal") is the template's thinking off: the chat
    completion with enable_thinking false; `include` is taken (nothing extra is produced)."""
    messages = [{"role": "user", "content": "hello there"}]
    chat = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=6, temperature=0, extra_body=NO_THINKING
    )
    got = client.responses.create(
        model=MODEL, input="hello there", max_output_tokens=6, temperature=0, reasoning={"effort": "none"},
        include=["reasoning.encrypted_content"],
    )  # fmt: skip
    assert got.output_text == chat.choices[0].message.content and got.reasoning.effort == "none"
    assert got.usage.input_tokens == chat.usage.prompt_tokens
    thinking = client.responses.create(model=MODEL, input="hello there", max_output_tokens=6, temperature=0)
    assert thinking.usage.input_tokens != got.usage.input_tokens  # the template's open think block


def test_a_json_schema_format(client):
    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}},
        "required": ["ok"],
        "additionalProperties": False,
    }
    got = client.responses.create(
        model=MODEL, input="ok?", max_output_tokens=40, temperature=0, extra_body=NO_THINKING,
        text={"format": {"type": "json_schema", "name": "answer", "schema": schema}},
    )  # fmt: skip
    assert set(json.loads(got.output_text)) == {"ok"}


BAD = [
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input[0].content[0]"),
    ({"input": [{"type": "item_reference", "id": "x"}]}, "input[0].type"),
    ({"input": [{"role": "robot", "content": "hi"}]}, "input[0].role"),
    ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "input[0].call_id"),
    ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "hi", "temperature": -1}, "temperature"),
    ({"input": "hi", "text": {"format": {"type": "yaml"}}}, "text.format.type"),
    ({"input": "hi", "tool_choice": {"type": "function"}}, "tool_choice"),
    ({"input": "hi", "previous_response_id": "resp_nope"}, "previous_response_id"),
    ({"input": "hi", "frobnicate": 1}, "frobnicate"),
    ({"input": "hi", "reasoning": {"effort": "extreme"}}, "reasoning.effort"),
    ({"input": "hi", "include": ["file_search_call.results"]}, "include[0]"),
    ({"input": "the quick brown fox " * 600}, "input"),  # over max_model_len
    ({"input": []}, "input"),
]


@pytest.mark.parametrize("body, field", BAD, ids=[f for _, f in BAD])
def test_bad_input_is_400_naming_the_field(served, body, field):
    response = httpx.post(f"{served.url()}/v1/responses", json={"model": MODEL, **body})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["message"].startswith(f"{field}: ") and error["param"] == field, error
    assert len(error["message"]) < 600


def test_the_store_evicts_the_least_recently_used():
    from deltaserve.cluster.entrypoints.openai_responses import Response, ResponseStore

    def response(i: int) -> Response:
        return Response(id=f"resp_{i}", created_at=0, status="completed", model="m")

    store = ResponseStore(capacity=3, max_chars=10**6)
    for i in range(4):
        store.put(response(i), [{"role": "user", "content": f"turn {i}"}])
    assert store.get("resp_0") is None and store.get("resp_1") is not None  # 1 is now the most recent
    store.put(response(4), [])
    assert [store.get(f"resp_{i}") is not None for i in range(5)] == [False, True, False, True, True]
    big = ResponseStore(capacity=100, max_chars=2000)
    for i in range(5):
        big.put(response(i), [{"role": "user", "content": "x" * 600}])
    assert big.chars <= 2000 and big.get("resp_4") is not None and big.get("resp_0") is None
    assert big.delete("resp_4") and not big.delete("resp_4") and big.get("resp_4") is None


ANSWER = f"{THOUGHT}</think>\n\nIt is sunny."
LOGPROBS = dict(include=["message.output_text.logprobs"], top_logprobs=2)


def same_logprobs(a: list[dict], b: list[dict]) -> bool:
    """The same tokens and alternatives, their logprobs to float32 noise (a cached prefix changes the
    passes' shapes)."""

    def close(x: dict, y: dict) -> bool:
        return (x["token"], x["bytes"]) == (y["token"], y["bytes"]) and abs(x["logprob"] - y["logprob"]) < 1e-4

    return len(a) == len(b) and all(
        close(x, y) and len(x["top_logprobs"]) == len(y["top_logprobs"])
        and all(close(u, v) for u, v in zip(x["top_logprobs"], y["top_logprobs"], strict=True))
        for x, y in zip(a, b, strict=True)
    )  # fmt: skip


def test_output_text_logprobs_are_the_answers_tokens(client):
    """include message.output_text.logprobs: the answer's tokens' logprobs (top_logprobs alternatives
    each) are the chat completion's for the tokens after `</think>`, whole, streamed in the deltas and
    in output_text.done; the reasoning's tokens are not among them."""
    request = dict(model=MODEL, input="weather?", max_output_tokens=80, temperature=0, **LOGPROBS)
    got = client.responses.create(**request, extra_body=regex(ANSWER))
    assert [item.type for item in got.output] == ["reasoning", "message"] and got.output_text == "It is sunny."
    lps = [lp.model_dump() for lp in got.output[1].content[0].logprobs]
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "weather?"}], max_tokens=80, temperature=0,
        logprobs=True, top_logprobs=2, extra_body=regex(ANSWER),
    )  # fmt: skip
    entries = [e.model_dump() for e in chat.choices[0].logprobs.content]
    first = len(entries) - len(lps)
    assert lps and same_logprobs(lps, entries[first:])
    assert "".join(e["token"] for e in entries[:first]) == THOUGHT + "</think>"  # the rest: the reasoning's
    assert "".join(e["token"] for e in lps) == f"\n\n{got.output_text}<|im_end|>"  # the stop token's too, as chat
    assert all(len(e["top_logprobs"]) == 2 for e in lps)
    events = list(client.responses.create(**request, stream=True, extra_body=regex(ANSWER)))
    streamed = [lp.model_dump() for e in events if e.type == "response.output_text.delta" for lp in e.logprobs]
    done = next(e for e in events if e.type == "response.output_text.done")
    assert same_logprobs(streamed, lps) and [lp.model_dump() for lp in done.logprobs] == streamed
    plain = client.responses.create(model=MODEL, input="weather?", max_output_tokens=80, extra_body=regex(ANSWER))
    assert plain.output[1].content[0].logprobs == []  # not asked: none


def _finished(client: openai.OpenAI, response_id: str, timeout_s: float = 60):
    deadline = time.monotonic() + timeout_s
    while True:
        got = client.responses.retrieve(response_id)
        if got.status not in ("queued", "in_progress") or time.monotonic() > deadline:
            return got
        time.sleep(0.05)


def test_background_responses_poll_stream_and_replay(client):
    """background: the POST returns the queued response at once; polled, it ends as the foreground
    answer; streamed, its events are a foreground stream's, and a GET with stream=true replays them
    after any sequence number."""
    request = dict(model=MODEL, input="hello there", max_output_tokens=9, temperature=0, extra_body=NO_THINKING)
    want = client.responses.create(**request)
    queued = client.responses.create(**request, background=True)
    assert (queued.status, queued.background, queued.output) == ("queued", True, [])
    got = _finished(client, queued.id)
    assert (got.status, got.output_text, got.background) == (want.status, want.output_text, True)
    assert got.usage.output_tokens == want.usage.output_tokens
    events = list(client.responses.create(**request, background=True, stream=True))
    kinds = [e.type for e in events]
    assert kinds[0] == "response.created" and kinds[-1] == f"response.{want.status}"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[-1].response.output_text == want.output_text
    response_id = events[0].response.id
    assert client.responses.retrieve(response_id).output_text == want.output_text
    replay = list(client.responses.retrieve(response_id, stream=True, starting_after=2))
    assert [e.model_dump() for e in replay] == [e.model_dump() for e in events[3:]]


def test_a_background_response_is_cancelled_and_its_request_leaves(client, served):
    """cancel stops a running background response (status cancelled, again on a second cancel) and its
    request leaves the engine; a foreground response cannot be cancelled, a background one must be
    stored, and a running one cannot be continued."""
    long = dict(model=MODEL, input="go on", max_output_tokens=1500, extra_body={**NO_THINKING, "ignore_eos": True})
    queued = client.responses.create(**long, background=True)
    follow_up = {"model": MODEL, "input": "and then?", "previous_response_id": queued.id}
    busy = httpx.post(f"{served.url()}/v1/responses", json=follow_up)
    assert busy.status_code == 400 and busy.json()["error"]["param"] == "previous_response_id"
    assert client.responses.cancel(queued.id).status == "cancelled"
    assert client.responses.retrieve(queued.id).status == "cancelled"
    assert client.responses.cancel(queued.id).status == "cancelled"
    deadline = time.monotonic() + 10
    running = re.compile(r"^vllm:num_requests_running\{[^}]*\} 0\.0$", re.M)
    while not running.search(httpx.get(f"{served.url()}/metrics").text):
        assert time.monotonic() < deadline, "the cancelled request still runs"
        time.sleep(0.05)
    fg = client.responses.create(model=MODEL, input="hi", max_output_tokens=2, extra_body=NO_THINKING)
    refused = httpx.post(f"{served.url()}/v1/responses/{fg.id}/cancel")
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "response_id"
    unstored = httpx.post(f"{served.url()}/v1/responses", json={"model": MODEL, "input": "hi", "background": True,
                                                                "store": False})  # fmt: skip
    assert unstored.status_code == 400 and unstored.json()["error"]["param"] == "background"
    again = httpx.get(f"{served.url()}/v1/responses/{fg.id}", params={"stream": "true"})
    assert again.status_code == 400 and again.json()["error"]["param"] == "stream"
    client.responses.create(**long, background=True)  # left running: the server's stop cancels it
