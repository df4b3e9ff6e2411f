"""Reasoning and tool calls out of a chat completion's text (`--reasoning-parser qwen3`,
`--tool-call-parser hermes | qwen3_coder`): the parser on texts in Qwen's formats, whole and cut into
every stream of pieces (the same message either way); then through the HTTP server with the real
`openai` client, the tiny model's output forced into those formats by a structured-output regex, whole
and streamed: `reasoning_content`, `tool_calls` and finish reason `tool_calls`, as vLLM gives them."""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import openai
import pytest

from deltaserve.cluster.config import EngineConfig
from deltaserve.cluster.entrypoints.chat_parsing import (
    CALL_CLOSE,
    ChatParser,
    Parsed,
    forced_tools,
    merge_calls,
    opens_reasoning,
    tool_schemas,
)
from deltaserve.cluster.entrypoints.front_doors import FrontDoors

sys.path.insert(0, str(Path(__file__).parent))
from test_http_limits import MODEL, Served  # noqa: E402

pytestmark = pytest.mark.timeout(120)

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}, "metric": {"type": "boolean"}},
        },
    },
}
HERMES_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>'
XML_CALL = (
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nNew York\n</parameter>\n<parameter=days>\n3\n"
    "</parameter>\n<parameter=metric>\ntrue\n</parameter>\n</function>\n</tool_call>"
)


def parse(text: str, pieces: list[str] | None = None, **settings) -> Parsed:
    parser = ChatParser(**settings)
    out = Parsed()
    for piece in pieces if pieces is not None else [text]:
        out += parser.feed(piece)
    out += parser.finish()
    return out


def streams(text: str, seed: int = 0) -> list[list[str]]:
    """The text whole, a character at a time, cut once at every place, and cut at random places."""
    rng = random.Random(seed)
    cuts = [[text], list(text)] + [[text[:i], text[i:]] for i in range(1, len(text))]
    for _ in range(20):
        marks = sorted(rng.sample(range(1, len(text)), min(6, len(text) - 1)))
        cuts.append([text[a:b] for a, b in zip([0, *marks], [*marks, len(text)], strict=True)])
    return cuts


def arguments(text: str):
    """The arguments' JSON value, or their text when cut short."""
    try:
        return json.loads(text)
    except ValueError:
        return text


def as_tuple(p: Parsed) -> tuple:
    calls = merge_calls(p.tool_calls)
    firsts = [d for d in p.tool_calls if d.id is not None]
    # each call's first piece names it, and only its first; calls are numbered in order
    assert [d.index for d in firsts] == list(range(len(calls))) and all(d.name for d in firsts)
    assert all(d.name is None for d in p.tool_calls if d.id is None)
    return p.content, p.reasoning, [(c.name, arguments(c.arguments)) for c in calls]


REASONING = dict(reasoning=True, in_reasoning=True)
PARIS = ("get_weather", {"city": "Paris", "days": 3})
NEW_YORK = {"city": "New York", "days": 3, "metric": True}
BAD_JSON = "<tool_call>\n{not json}\n</tool_call> then text"
UNCLOSED = "<tool_call>\n<function=f>\n<parameter=a>\n1"
CASES = [
    # (text, parser settings, content, reasoning, calls)
    ("Let me think.\n</think>\n\nThe answer is 4.", REASONING, "The answer is 4.", "Let me think.\n", []),
    ("<think>hmm</think>\n\nyes", dict(reasoning=True), "yes", "hmm", []),
    ("no tags at all", dict(reasoning=True), "no tags at all", "", []),
    ("cut off while thinking", REASONING, "", "cut off while thinking", []),
    ("a < b </think> c", dict(), "a < b </think> c", "", []),
    (f"Checking.\n{HERMES_CALL}\n{HERMES_CALL}\n", dict(tool_parser="hermes"), "Checking.\n", "", [PARIS] * 2),
    (BAD_JSON, dict(tool_parser="hermes"), BAD_JSON, "", []),
    # whitespace after a call is the format's, unless the answer goes on after it (before the next call)
    (f"{HERMES_CALL} x {HERMES_CALL}\n", dict(tool_parser="hermes"), " x ", "", [PARIS] * 2),
    (f"x\n{HERMES_CALL}", dict(), f"x\n{HERMES_CALL}", "", []),
    (
        f"plan\n</think>\n\n{XML_CALL}",
        dict(REASONING, tool_parser="qwen3_coder", schemas=tool_schemas([WEATHER])),
        "",
        "plan\n",
        [("get_weather", NEW_YORK)],
    ),
    (
        XML_CALL,
        dict(tool_parser="qwen3_coder"),
        "",
        "",
        [("get_weather", {k: str(v).lower() if k != "city" else v for k, v in NEW_YORK.items()})],
    ),
    # cut short inside a call: a call with the arguments so far (OpenAI's at max_tokens)
    (UNCLOSED, dict(tool_parser="qwen3_coder"), "", "", [("f", '{"a": "1')]),
    ('<tool_call>\n{"name": "f", "arguments": {"s": "a}\\"b", "n": [1, {', dict(tool_parser="hermes"), "", "",
     [("f", '{"s": "a}\\"b", "n": [1, {')]),
    # a block whose name does not come first is read whole (hermes: a string of arguments too)
    ('<tool_call>{"arguments": {"x": 1}, "name": "f"}</tool_call>', dict(tool_parser="hermes"), "", "",
     [("f", {"x": 1})]),
    ('<tool_call>{"name": "f", "arguments": "{\\"x\\": 2}"}</tool_call>', dict(tool_parser="hermes"), "", "",
     [("f", {"x": 2})]),
    # a string parameter's text escaped as JSON; parameters of no schema are text
    ("<tool_call><function=f><parameter=q>\nsay \"hi\"\n\n</parameter><parameter=n>7</parameter></function>",
     dict(tool_parser="qwen3_coder"), "", "", [("f", {"q": 'say "hi"\n', "n": "7"})]),
    ("<tool_call><function=f></function></tool_call>", dict(tool_parser="qwen3_coder"), "", "", [("f", {})]),
]  # fmt: skip


@pytest.mark.parametrize("case", range(len(CASES)))
def test_every_stream_of_the_text_gives_the_whole_message(case):
    text, settings, content, reasoning, calls = CASES[case]
    want = (content, reasoning, calls)
    assert as_tuple(parse(text, **settings)) == want
    for pieces in streams(text, seed=case):
        assert as_tuple(parse(text, pieces, **settings)) == want, pieces


def test_a_call_streams_its_arguments_as_they_come():
    """The name goes out as soon as it is read, the arguments piece by piece before the block closes."""
    for text, settings, name in [
        (HERMES_CALL, dict(tool_parser="hermes"), "get_weather"),
        (XML_CALL, dict(tool_parser="qwen3_coder", schemas=tool_schemas([WEATHER])), "get_weather"),
    ]:
        parser = ChatParser(**settings)
        steps = [parser.feed(ch) for ch in text]
        steps.append(parser.finish())
        named = next(i for i, step in enumerate(steps) if step.tool_calls)
        assert steps[named].tool_calls[0].name == name and named <= text.index(name) + len(name) + len(
            '", "arguments": {'
        )
        pieces = [i for i, step in enumerate(steps) for d in step.tool_calls if d.arguments]
        assert len(pieces) > 3 and pieces[-1] < len(text) - len(CALL_CLOSE) + 1
    # the XML format's string parameter streams its text before </parameter>
    parser = ChatParser(tool_parser="qwen3_coder", schemas=tool_schemas([WEATHER]))
    got = parser.feed("<tool_call>\n<function=get_weather>\n<parameter=city>\nNew Yo")
    assert "".join(d.arguments for d in got.tool_calls) == '{"city": "New Yo'


def test_a_prompt_that_opens_the_reasoning_and_tool_schemas():
    assert opens_reasoning("<|im_start|>assistant\n<think>\n")
    assert not opens_reasoning("<|im_start|>assistant\n<think>\n\n</think>\n\n")  # thinking off
    assert not opens_reasoning("<|im_start|>assistant\n")
    assert tool_schemas([WEATHER, {"type": "function"}, "junk"]) == {
        "get_weather": WEATHER["function"]["parameters"]["properties"]
    }
    calls = merge_calls(parse(HERMES_CALL * 2, tool_parser="hermes").tool_calls)
    assert len({c.id for c in calls}) == 2 and all(c.id.startswith("call_") for c in calls)


@pytest.fixture(scope="module")
def served(tiny_chat_model):
    doors = FrontDoors(host="127.0.0.1", grpc_port=0, http_port=0, grace_s=1)
    settings = dict(served_model_name=MODEL, max_model_len=2048, reasoning_parser="qwen3", tool_call_parser="hermes")
    server = Served(EngineConfig.from_kwargs(model=str(tiny_chat_model), **settings), doors)
    yield server
    server.stop()


def forced(pattern: str) -> dict:
    return {"structured_outputs": {"regex": pattern}, "chat_template_kwargs": {"enable_thinking": True}}


def test_reasoning_and_tool_calls_over_http(served):
    client = openai.OpenAI(base_url=served.url() + "/v1", api_key="unused", max_retries=0, timeout=60)
    messages = [{"role": "user", "content": "weather in Paris?"}]
    call = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
    text = f"I should call it.\n</think>\n\n<tool_call>\n{call}\n</tool_call>"
    pattern = text.replace("{", r"\{").replace("}", r"\}").replace(".", r"\.")
    whole = client.chat.completions.create(
        model=MODEL, messages=messages, tools=[WEATHER], max_tokens=200, temperature=0, extra_body=forced(pattern)
    )
    (choice,) = whole.choices
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert choice.message.reasoning_content == "I should call it.\n"
    (call,) = choice.message.tool_calls
    assert (call.type, call.function.name, json.loads(call.function.arguments)) == (
        "function",
        "get_weather",
        {"city": "Paris"},
    )

    # OpenAI's usage detail: the output tokens before </think> (the thought's, not the call's)
    thought = whole.usage.completion_tokens_details.reasoning_tokens
    assert 0 < thought < whole.usage.completion_tokens

    reasoning, content, calls, finish, usage = "", "", [], None, None
    stream = client.chat.completions.create(
        model=MODEL, messages=messages, tools=[WEATHER], max_tokens=200, temperature=0, stream=True,
        extra_body=forced(pattern), stream_options={"include_usage": True},
    )  # fmt: skip
    for chunk in stream:
        usage = chunk.usage or usage
        for c in chunk.choices:
            delta = c.delta.model_dump()
            reasoning += delta.get("reasoning_content") or ""
            content += c.delta.content or ""
            calls += c.delta.tool_calls or []
            finish = c.finish_reason or finish
    assert (reasoning, content, finish) == ("I should call it.\n", "", "tool_calls")
    assert usage.completion_tokens_details.reasoning_tokens == thought
    # OpenAI's stream shape: the first piece has the id, type and name, the rest more arguments
    assert len(calls) > 2 and calls[0].id.startswith("call_") and calls[0].type == "function"
    assert all(t.index == 0 and t.id is None and t.function.name is None for t in calls[1:])
    assert (calls[0].function.name, json.loads("".join(t.function.arguments for t in calls))) == (
        "get_weather",
        {"city": "Paris"},
    )

    # without tools offered the call stays text; thinking off leaves no reasoning
    plain = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=200, temperature=0,
        extra_body={"structured_outputs": {"regex": "Sunny\\."}, "chat_template_kwargs": {"enable_thinking": False}},
    )  # fmt: skip
    message = plain.choices[0].message
    assert plain.usage.completion_tokens_details.reasoning_tokens == 0
    assert (message.content, message.reasoning_content, message.tool_calls, plain.choices[0].finish_reason) == (
        "Sunny.",
        None,
        [],
        "stop",
    )


def test_reasoning_and_tool_calls_over_grpc(served):
    """A chat over gRPC is read as the HTTP server reads it: each chunk's reasoning, content and tool
    call pieces, the final's tool_calls flag and reasoning tokens; `text` stays the raw text."""
    from deltaserve.cluster.entrypoints.client import Chunk, GenerationClient

    messages = [{"role": "user", "content": "weather in Paris?"}]
    call = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
    text = f"I should call it.\n</think>\n\n<tool_call>\n{call}\n</tool_call>"
    pattern = text.replace("{", r"\{").replace("}", r"\}").replace(".", r"\.")
    client = openai.OpenAI(base_url=served.url() + "/v1", api_key="unused", max_retries=0, timeout=60)
    http = client.chat.completions.create(
        model=MODEL, messages=messages, tools=[WEATHER], max_tokens=200, temperature=0, extra_body=forced(pattern)
    )
    with GenerationClient(f"127.0.0.1:{served.stack.ports['grpc']}") as grpc_client:
        items = list(
            grpc_client.generate(
                messages, tools=[WEATHER], chat_template_kwargs={"enable_thinking": True}, max_tokens=200,
                temperature=0, structured_outputs={"regex": pattern},
            )
        )  # fmt: skip
    chunks, final = [i for i in items if isinstance(i, Chunk)], items[-1]
    assert "".join(c.text for c in chunks) == text
    assert "".join(c.reasoning for c in chunks) == "I should call it.\n" and "".join(c.content for c in chunks) == ""
    pieces = [p for c in chunks for p in c.tool_calls]
    assert pieces[0].id.startswith("call_") and pieces[0].name == "get_weather" and len(pieces) > 2
    assert all(p.index == 0 and not p.id and not p.name for p in pieces[1:])
    assert json.loads("".join(p.arguments for p in pieces)) == {"city": "Paris"}
    assert (final.finish_reason, final.tool_calls) == ("stop", True)
    assert final.reasoning_tokens == http.usage.completion_tokens_details.reasoning_tokens > 0
    # a plain text prompt is not read as a chat
    with GenerationClient(f"127.0.0.1:{served.stack.ports['grpc']}") as grpc_client:
        plain = list(grpc_client.generate("hello", max_tokens=3, temperature=0))
    assert all(c.content == c.reasoning == "" and not c.tool_calls for c in plain[:-1])


def test_unknown_parsers_name_the_setting():
    with pytest.raises(ValueError, match="^reasoning_parser: "):
        EngineConfig.from_kwargs(reasoning_parser="deepseek_r1")
    with pytest.raises(ValueError, match="^tool_call_parser: "):
        EngineConfig.from_kwargs(tool_call_parser="mistral")


def test_forced_tool_choice_schemas_and_errors():
    named = forced_tools({"type": "function", "function": {"name": "get_weather"}}, [WEATHER])
    assert named.name == "get_weather" and named.schema == WEATHER["function"]["parameters"]
    required = forced_tools("required", [WEATHER])
    assert required.name is None and required.schema["type"] == "array" and required.schema["minItems"] == 1
    assert "maxItems" not in required.schema and forced_tools("required", [WEATHER], False).schema["maxItems"] == 1
    assert forced_tools("auto", [WEATHER]) is None and forced_tools("none", [WEATHER]) is None
    with pytest.raises(ValueError, match="^tool_choice: names no function"):
        forced_tools({"type": "function", "function": {"name": "nope"}}, [WEATHER])
    with pytest.raises(ValueError, match="^tool_choice: forcing a call needs `tools`"):
        forced_tools("required", None)
    # what the constrained output reads back as
    # a named function's arguments stream as the constrained text comes (a piece per feed)
    pieces = parse('{"city": "Rome"}', ['{"ci', 'ty": "Ro', 'me"}'], forced=named).tool_calls
    assert [(d.index, d.name, d.arguments) for d in pieces] == [
        (0, "get_weather", '{"ci'),
        (0, None, 'ty": "Ro'),
        (0, None, 'me"}'),
    ]
    (call,) = merge_calls(parse('{"city": "Rome"}', forced=named).tool_calls)
    assert (call.name, json.loads(call.arguments)) == ("get_weather", {"city": "Rome"})
    two = '[{"name":"get_weather","parameters":{"city":"Oslo"}},{"name":"get_weather","parameters":{"city":"R"}}]'
    for pieces in streams(two, seed=3)[:40]:  # every cut of the stream: the same two calls
        calls = merge_calls(parse(two, pieces, forced=required).tool_calls)
        assert [(c.name, json.loads(c.arguments)) for c in calls] == [
            ("get_weather", {"city": "Oslo"}),
            ("get_weather", {"city": "R"}),
        ], pieces
    # each call's name goes out once read, its parameters as they come
    parser = ChatParser(forced=required)
    assert [
        (d.index, d.name, d.arguments) for d in parser.feed('[{"name":"get_weather","parameters":{"ci').tool_calls
    ] == [
        (0, "get_weather", ""),
        (0, None, '{"ci'),
    ]
    # cut short: a call with the arguments so far; before any name is read, the text
    (call,) = merge_calls(parse('[{"name": "get_weather", "parameters": {"ci', forced=required).tool_calls)
    assert (call.name, call.arguments) == ("get_weather", '{"ci')
    assert parse('[{"name": "get_we', forced=required) == Parsed(content='[{"name": "get_we')
    (call,) = merge_calls(parse('{"city": "Ro', forced=named).tool_calls)
    assert (call.name, call.arguments) == ("get_weather", '{"city": "Ro')


def test_forced_tool_choice_over_http(served):
    """tool_choice "required" or one named function: the output is held to the calls' JSON (the tiny
    random model writes whatever the schema allows) and comes back as the calls, whole and streamed;
    bad choices are 400 naming tool_choice."""
    client = openai.OpenAI(base_url=served.url() + "/v1", api_key="unused", max_retries=0, timeout=60)
    messages = [{"role": "user", "content": "weather?"}]
    strict = {"type": "function", "function": {**WEATHER["function"], "parameters": {
        "type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"],
        "additionalProperties": False,
    }}}  # fmt: skip
    named = {"type": "function", "function": {"name": "get_weather"}}
    for choice, finish in ((named, "stop"), ("required", "tool_calls")):
        request = dict(
            model=MODEL, messages=messages, tools=[strict], tool_choice=choice, max_tokens=100, temperature=0,
            parallel_tool_calls=False,
        )  # fmt: skip
        (c,) = client.chat.completions.create(**request).choices
        assert c.finish_reason == finish and not c.message.content
        calls = [(t.function.name, t.function.arguments) for t in c.message.tool_calls]
        assert [(name, json.loads(args)["city"] in ("Paris", "Rome")) for name, args in calls] == [
            ("get_weather", True)
        ]
        streamed = []
        for chunk in client.chat.completions.create(**request, stream=True):
            streamed += [t for ch in chunk.choices for t in ch.delta.tool_calls or []]
        whole = {}  # the pieces put together by index (the arguments stream as they come)
        for t in streamed:
            name, arguments = whole.get(t.index, (None, ""))
            whole[t.index] = (name or t.function.name, arguments + t.function.arguments)
        assert list(whole.values()) == calls
        assert len(streamed) > 1 and streamed[0].function.name == "get_weather"  # the arguments came in pieces
    for bad in ({"type": "function", "function": {"name": "nope"}}, "sometimes"):
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=MODEL, messages=messages, tools=[strict], tool_choice=bad)
        assert "tool_choice" in e.value.body["message"]


def test_a_constrained_answer_after_free_reasoning_over_http(served):
    """Under --reasoning-parser a constraint holds the answer after the reasoning block: the greedy tiny
    model's first tokens are free reasoning (the same as without the constraint, and otherwise than a
    JSON object would start), not JSON forced from the first token; with thinking off the answer is the
    JSON."""
    client = openai.OpenAI(base_url=served.url() + "/v1", api_key="unused", max_retries=0, timeout=60)
    messages = [{"role": "user", "content": "a point?"}]
    schema = {
        "type": "object",
        "properties": {"x": {"enum": [1, 2, 3]}},
        "required": ["x"],
        "additionalProperties": False,
    }
    point = {"json": schema, "disable_any_whitespace": True}
    thinking = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=6, temperature=0, extra_body={"structured_outputs": point}
    )
    free = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, temperature=0)
    (c,) = thinking.choices
    assert c.finish_reason == "length" and not c.message.content
    assert c.message.reasoning_content == free.choices[0].message.reasoning_content  # the same free tokens
    assert not c.message.reasoning_content.lstrip().startswith("{")
    off = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=60, temperature=0,
        extra_body={"structured_outputs": point, "chat_template_kwargs": {"enable_thinking": False}},
    )  # fmt: skip
    message = off.choices[0].message
    assert message.reasoning_content is None and json.loads(message.content)["x"] in (1, 2, 3)


FRAGMENTS = [
    "<think>", "</think>", "<tool_call>", "</tool_call>", "<", "</", "think", "tool", "\n", "\n\n", " ", "a", "{",
    "}", '{"name": "f", "arguments": {"x": 1}}', "<function=f>", "</function>", "<parameter=x>", "</parameter>",
    '{"name": "g", "arguments": {"s": "', '"', "\\", "]", "[", "<parameter=y>\n", "é",
]  # fmt: skip


@pytest.mark.parametrize("seed", range(60))
def test_random_texts_stream_as_they_parse_whole(seed):
    """Texts made of the formats' pieces in any order, under random settings: any cut of the stream
    gives the whole text's message."""
    rng = random.Random(seed)
    text = "".join(rng.choice(FRAGMENTS) for _ in range(rng.randint(1, 30)))
    settings = dict(
        reasoning=rng.random() < 0.7,
        in_reasoning=rng.random() < 0.5,
        tool_parser=rng.choice([None, "hermes", "qwen3_coder"]),
    )
    want = as_tuple(parse(text, **settings))
    for pieces in streams(text, seed=seed)[:12]:
        assert as_tuple(parse(text, pieces, **settings)) == want, (text, pieces, settings)
