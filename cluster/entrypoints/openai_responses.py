"""OpenAI's Responses API (`POST /v1/responses`, as vLLM serves it) over the chat completion path: a
request's `instructions`, `input` items (messages, function calls and their outputs, reasoning) and
`previous_response_id` become a chat (`to_chat`), rendered and generated as a chat completion is, and
its answer is read back as output items (reasoning, message, function calls): whole (`response_of`)
or as the Responses stream's typed events (`ResponseEvents`, from the chat stream's chunks). Responses
are kept (`store`, OpenAI's default) in a bounded in-memory `ResponseStore` for `previous_response_id`
and `GET /v1/responses/{id}`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable
from functools import partial
from typing import Any, Literal

from pydantic import BaseModel, Field

from . import openai_protocol as api
from .chat_parsing import answer_start, reasoning_tokens
from .openai_protocol import Strict

STORED_RESPONSES = 1024  # responses kept for previous_response_id (least recently used go first)
STORED_CHARS = 64 * 2**20  # and at most this much of their conversations' text
FINISHED_RUNS = 256  # ended background streams whose events a GET can still replay
OUTPUT_LOGPROBS = "message.output_text.logprobs"


class Reasoning(Strict):
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None


class ResponsesRequest(Strict):
    """The request body; OpenAI's fields, and vLLM's sampling extensions."""

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    previous_response_id: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    store: bool = True
    metadata: dict[str, str] | None = None
    user: str | None = None
    text: dict[str, Any] | None = None
    truncation: Literal["disabled"] | None = None
    # OpenAI's reasoning settings: effort "none" / "minimal" turns the template's thinking off (Qwen's
    # enable_thinking); other efforts think as the template does; the reasoning is returned whole, as text
    reasoning: Reasoning | None = None
    # extra output: message.output_text.logprobs adds the answer's token logprobs (top_logprobs
    # alternatives each); reasoning items carry their text, not an encrypted form
    include: list[Literal["reasoning.encrypted_content", "message.output_text.logprobs"]] | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    # run detached from the connection (store required): GET polls it, /cancel stops it, and a
    # streamed one can be replayed (GET with stream=true, from starting_after)
    background: bool = False
    # OpenAI's cache routing hint and end-user id: taken (every prompt prefix is cached already)
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    # vLLM's extensions
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    ignore_eos: bool = False
    request_id: str | None = None
    priority: int = 0
    cache_salt: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    structured_outputs: api.StructuredOutputs | None = None


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: dict[str, int]
    output_tokens: int
    output_tokens_details: dict[str, int]
    total_tokens: int


class Response(BaseModel):
    id: str
    object: str = "response"
    created_at: int
    status: str  # completed, incomplete, in_progress
    model: str
    output: list[dict[str, Any]] = Field(default_factory=list)
    usage: ResponseUsage | None = None
    incomplete_details: dict[str, str] | None = None
    error: dict[str, Any] | None = None
    instructions: str | None = None
    previous_response_id: str | None = None
    tools: list[dict[str, Any]] = Field(default_factory=list)
    tool_choice: str | dict[str, Any] = "auto"
    parallel_tool_calls: bool = True
    temperature: float | None = None
    top_p: float | None = None
    max_output_tokens: int | None = None
    metadata: dict[str, str] | None = None
    text: dict[str, Any] = Field(default_factory=lambda: {"format": {"type": "text"}})
    store: bool = True
    reasoning: dict[str, Any] | None = None
    background: bool = False
    top_logprobs: int = 0


class ResponseStore:
    """Stored responses and the chat each one ended (its messages, the answer included), least recently
    used evicted past `capacity` responses or `max_chars` characters of their conversations."""

    def __init__(self, capacity: int = STORED_RESPONSES, max_chars: int = STORED_CHARS) -> None:
        self.capacity, self.max_chars = capacity, max_chars
        self._items: OrderedDict[str, tuple[Response, list[dict]]] = OrderedDict()
        self._sizes: dict[str, int] = {}
        self.chars = 0

    def put(self, response: Response, messages: list[dict]) -> None:
        self.delete(response.id)
        size = len(json.dumps(messages, ensure_ascii=False)) + len(response.model_dump_json())
        self._items[response.id], self._sizes[response.id] = (response, messages), size
        self.chars += size
        while len(self._items) > self.capacity or (self.chars > self.max_chars and len(self._items) > 1):
            oldest, _ = self._items.popitem(last=False)
            self.chars -= self._sizes.pop(oldest)

    def get(self, response_id: str) -> tuple[Response, list[dict]] | None:
        item = self._items.get(response_id)
        if item is not None:
            self._items.move_to_end(response_id)
        return item

    def delete(self, response_id: str) -> bool:
        if self._items.pop(response_id, None) is None:
            return False
        self.chars -= self._sizes.pop(response_id)
        return True


class ResponseNotFoundError(LookupError):
    """GET / DELETE of a response id not stored (404)."""


# ---- the request as a chat --------------------------------------------------------------------
def to_chat(body: ResponsesRequest, store: ResponseStore) -> tuple[api.ChatCompletionRequest, list[dict]]:
    """The chat completion request this response request asks for, and its messages (what a later
    request's previous_response_id continues); ValueError naming the Responses field."""
    messages: list[dict] = []
    if body.instructions:
        messages.append({"role": "system", "content": body.instructions})
    if body.previous_response_id is not None:
        stored = store.get(body.previous_response_id)
        if stored is None:
            raise ValueError(f"previous_response_id: no stored response {body.previous_response_id[:80]!r}")
        if stored[0].status not in ("completed", "incomplete"):
            raise ValueError(f"previous_response_id: that response is {stored[0].status}, not finished")
        messages += [m for m in stored[1] if m.get("role") != "system"]  # instructions are not carried over
    messages += input_messages(body.input)
    if not messages:
        raise ValueError("input: must hold at least one message")
    fields: dict[str, Any] = dict(
        model=body.model,
        messages=messages,
        max_completion_tokens=body.max_output_tokens,
        temperature=body.temperature,
        top_p=body.top_p,
        stream=body.stream,
        user=body.user,
        top_k=body.top_k,
        min_p=body.min_p,
        repetition_penalty=body.repetition_penalty,
        seed=body.seed,
        ignore_eos=body.ignore_eos,
        request_id=body.request_id,
        priority=body.priority,
        cache_salt=body.cache_salt,
        chat_template_kwargs=template_kwargs(body),
        tools=chat_tools(body.tools),
        tool_choice=chat_tool_choice(body.tool_choice),
        parallel_tool_calls=body.parallel_tool_calls,
        response_format=response_format(body.text),
        structured_outputs=body.structured_outputs.model_dump(exclude_none=True, by_alias=True)
        if body.structured_outputs is not None
        else None,
        return_token_ids=True,  # the reasoning tokens are counted from the ids
    )
    if body.stream:
        fields["stream_options"] = {"include_usage": True}
    if OUTPUT_LOGPROBS in (body.include or []):
        fields.update(logprobs=True, top_logprobs=body.top_logprobs or 0)
    chat = api.ChatCompletionRequest.model_validate({k: v for k, v in fields.items() if v is not None})
    return chat, messages


def template_kwargs(body: ResponsesRequest) -> dict[str, Any] | None:
    """The chat template's kwargs: the request's, with reasoning effort none / minimal as thinking off
    (unless the kwargs say otherwise)."""
    kwargs = dict(body.chat_template_kwargs or {})
    if body.reasoning is not None and body.reasoning.effort in ("none", "minimal"):
        kwargs.setdefault("enable_thinking", False)
    return kwargs or None


def input_messages(items: str | list[dict[str, Any]]) -> list[dict]:
    """`input` as chat messages: a string is one user message; items are messages (text parts
    joined), function calls (an assistant message's tool_calls), their outputs (tool messages) and
    reasoning (the next assistant message's reasoning_content)."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    messages: list[dict] = []
    reasoning = ""
    for i, item in enumerate(items):
        where = f"input[{i}]"
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise ValueError(f"{where}.role: must be user, system, developer or assistant")
            message = {"role": role, "content": _text_of(item.get("content"), f"{where}.content")}
            if role == "assistant" and reasoning:
                message["reasoning_content"], reasoning = reasoning, ""
            messages.append(message)
        elif kind == "function_call":
            call = {
                "id": _string(item, "call_id", where),
                "type": "function",
                "function": {"name": _string(item, "name", where), "arguments": _string(item, "arguments", where)},
            }
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and not reasoning:
                last.setdefault("tool_calls", []).append(call)
            else:
                message = {"role": "assistant", "content": "", "tool_calls": [call]}
                if reasoning:
                    message["reasoning_content"], reasoning = reasoning, ""
                messages.append(message)
        elif kind == "function_call_output":
            output = item.get("output")
            text = output if isinstance(output, str) else _text_of(output, f"{where}.output")
            messages.append({"role": "tool", "tool_call_id": _string(item, "call_id", where), "content": text})
        elif kind == "reasoning":
            parts = (item.get("content") or []) + (item.get("summary") or [])
            reasoning += "".join(p.get("text", "") for p in parts if isinstance(p, dict))
        else:
            raise ValueError(
                f"{where}.type: must be message, function_call, function_call_output or reasoning,"
                f" got {str(kind)[:40]!r}"
            )
    return messages


def _string(item: dict, key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise ValueError(f"{where}.{key}: must be a string")
    return value


def _text_of(content: Any, where: str) -> str:
    """A message's content as text: a string, or text parts (input_text, output_text, text) joined."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ValueError(f"{where}: must be a string or a list of text parts")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("input_text", "output_text", "text") or not isinstance(part.get("text"), str):
            raise ValueError(
                f"{where}[{j}]: only text parts (input_text, output_text) are served, got {str(kind)[:40]!r}"
            )
        texts.append(part["text"])
    return "".join(texts)


def chat_tools(tools: list[dict] | None) -> list[dict] | None:
    """Responses' flat function tools ({"type": "function", "name", "description", "parameters"}) in
    chat completions' shape; other tool types are not served."""
    if tools is None:
        return None
    out = []
    for i, tool in enumerate(tools):
        if tool.get("type") != "function":
            raise ValueError(f"tools[{i}].type: only function tools are served, got {str(tool.get('type'))[:40]!r}")
        if not isinstance(tool.get("name"), str):
            raise ValueError(f"tools[{i}].name: must be a string")
        # the template renders the tool as JSON: its keys in the client's order
        function = {k: v for k, v in tool.items() if k in ("name", "description", "parameters") and v is not None}
        function.setdefault("parameters", {"type": "object"})
        out.append({"type": "function", "function": function})
    return out


def chat_tool_choice(choice: str | dict | None) -> str | dict | None:
    if not isinstance(choice, dict):
        return choice
    if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
        raise ValueError('tool_choice: must be "none", "auto", "required" or {"type": "function", "name": ...}')
    return {"type": "function", "function": {"name": choice["name"]}}


def response_format(text: dict | None) -> dict | None:
    """`text.format` as chat completions' response_format."""
    fmt = (text or {}).get("format")
    if fmt is None or fmt.get("type") == "text":
        return None
    if fmt.get("type") == "json_object":
        return {"type": "json_object"}
    if fmt.get("type") == "json_schema":
        if not isinstance(fmt.get("schema"), dict):
            raise ValueError("text.format.schema: must be a JSON schema object")
        return {"type": "json_schema", "json_schema": {"name": fmt.get("name", "output"), "schema": fmt["schema"]}}
    raise ValueError(f"text.format.type: must be text, json_object or json_schema, got {str(fmt.get('type'))[:40]!r}")


# errors of the chat path, in the Responses request's words
RENAMES = {
    "messages": "input",
    "max_completion_tokens": "max_output_tokens",
    "max_tokens": "max_output_tokens",
    "response_format.json_schema.schema": "text.format.schema",
    "response_format": "text.format",
    "structured_outputs": "text.format",
}


# ---- the answer as output items -----------------------------------------------------------------
def _item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


def reasoning_item(item_id: str, text: str) -> dict:
    return {"id": item_id, "type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": text}]}


def message_item(item_id: str, text: str, status: str = "completed", logprobs: list[dict] | None = None) -> dict:
    part = {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}
    content = [part] if status == "completed" else []
    return {"id": item_id, "type": "message", "role": "assistant", "status": status, "content": content}


def call_item(item_id: str, call_id: str, name: str, arguments: str, status: str = "completed") -> dict:
    return {
        "id": item_id,
        "type": "function_call",
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": status,
    }


def shell(body: ResponsesRequest, response_id: str, model: str) -> Response:
    """The response object before its output: what the request set."""
    return Response(
        id=response_id,
        created_at=int(time.time()),
        status="in_progress",
        model=model,
        instructions=body.instructions,
        previous_response_id=body.previous_response_id,
        tools=body.tools or [],
        tool_choice=body.tool_choice if body.tool_choice is not None else "auto",
        parallel_tool_calls=body.parallel_tool_calls is not False,
        temperature=body.temperature,
        top_p=body.top_p,
        max_output_tokens=body.max_output_tokens,
        metadata=body.metadata,
        text=body.text or {"format": {"type": "text"}},
        store=body.store,
        reasoning=body.reasoning.model_dump() if body.reasoning is not None else None,
        background=body.background,
        top_logprobs=body.top_logprobs or 0,
    )


def finished(response: Response, output: list[dict], finish_reason: str | None, usage: ResponseUsage) -> Response:
    incomplete = finish_reason == "length"
    return response.model_copy(
        update={
            "status": "incomplete" if incomplete else "completed",
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
            "output": output,
            "usage": usage,
        }
    )


def usage_of(usage: api.Usage, reasoning: Callable[[], int]) -> ResponseUsage:
    """The chat's usage in the Responses shape; `reasoning()` counts the reasoning tokens where the chat
    path did not (no --reasoning-parser)."""
    cached = usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details is not None else 0
    details = usage.completion_tokens_details
    return ResponseUsage(
        input_tokens=usage.prompt_tokens,
        input_tokens_details={"cached_tokens": cached},
        output_tokens=usage.completion_tokens,
        output_tokens_details={"reasoning_tokens": details.reasoning_tokens if details else reasoning()},
        total_tokens=usage.total_tokens,
    )


def response_of(
    response: Response,
    chat: api.ChatCompletionResponse,
    decode: Callable[[list[int]], str],
    in_reasoning: bool,
    reasoning_parsed: bool = False,
) -> Response:
    """The whole answer (a chat completion's one choice) as the finished response. reasoning_parsed: the
    server reads reasoning apart (its tokens' logprobs are then not the answer's)."""
    choice = chat.choices[0]
    message = choice.message
    output = []
    if message.reasoning_content:
        output.append(reasoning_item(_item_id("rs"), message.reasoning_content))
    if message.content:
        entries = choice.logprobs.content if choice.logprobs is not None else None
        logprobs = []
        if entries:
            start = answer_start(choice.token_ids or [], decode, in_reasoning) if reasoning_parsed else 0
            logprobs = [e.model_dump() for e in entries[start:]]
        output.append(message_item(_item_id("msg"), message.content, logprobs=logprobs))
    for call in message.tool_calls:
        output.append(call_item(_item_id("fc"), call.id, call.function.name, call.function.arguments))
    reasoning = partial(reasoning_tokens, choice.token_ids or [], decode, in_reasoning)
    return finished(response, output, choice.finish_reason, usage_of(chat.usage, reasoning))


def output_messages(output: list[dict]) -> list[dict]:
    """A response's output as the chat messages a later turn continues from."""
    return input_messages(output) if output else []


class ResponseEvents:
    """The Responses stream's events from a chat stream's chunks: each output item added, its deltas,
    its end, then response.completed (or incomplete) with the whole response."""

    def __init__(
        self,
        response: Response,
        decode: Callable[[list[int]], str],
        in_reasoning: bool,
        reasoning_parsed: bool = False,
    ) -> None:
        self.response = response
        self.decode = decode
        self.in_reasoning = in_reasoning
        self.reasoning_parsed = reasoning_parsed
        self.output: list[dict] = []
        self._entries: list[dict] = []  # every output token's logprobs so far, when asked
        self._answer_start: int | None = None  # the first token after the reasoning, once known
        self._given = 0  # entries handed to output_text deltas (or passed over as reasoning)
        self._item_logprobs: list[dict] = []  # the open message's
        self.sequence = 0
        self._open: dict | None = None  # the item whose deltas are arriving
        self._text = ""
        self._token_ids: list[int] = []
        self._finish: str | None = None

    def _event(self, kind: str, **fields: Any) -> str:
        body = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(body, ensure_ascii=False)}\n\n"

    def start(self) -> list[str]:
        return [
            self._event("response.created", response=self.response.model_dump()),
            self._event("response.in_progress", response=self.response.model_dump()),
        ]

    def _close(self) -> list[str]:
        item, self._open = self._open, None
        if item is None:
            return []
        index, text = len(self.output), self._text
        events = []
        if item["type"] == "function_call":
            item_id, name = item["id"], item["name"]
            item = call_item(item_id, item["call_id"], name, text)
            events.append(
                self._event(
                    "response.function_call_arguments.done",
                    item_id=item_id,
                    output_index=index,
                    name=name,
                    arguments=text,
                )
            )
        elif item["type"] == "reasoning":
            item = reasoning_item(item["id"], text)
            part = {"type": "reasoning_text", "text": text}
            events.append(
                self._event(
                    "response.reasoning_text.done", item_id=item["id"], output_index=index, content_index=0, text=text
                )
            )
            events.append(
                self._event(
                    "response.content_part.done", item_id=item["id"], output_index=index, content_index=0, part=part
                )
            )
        else:
            item = message_item(item["id"], text, logprobs=self._item_logprobs)
            self._item_logprobs = []
            part = item["content"][0]
            events.append(
                self._event(
                    "response.output_text.done",
                    item_id=item["id"],
                    output_index=index,
                    content_index=0,
                    text=text,
                    logprobs=part["logprobs"],
                )
            )
            events.append(
                self._event(
                    "response.content_part.done", item_id=item["id"], output_index=index, content_index=0, part=part
                )
            )
        events.append(self._event("response.output_item.done", output_index=index, item=item))
        self.output.append(item)
        return events

    def _text_delta(self, kind: str, delta: str) -> list[str]:
        events = []
        if self._open is not None and self._open["type"] != kind:
            events += self._close()
        index = len(self.output)
        if self._open is None:
            item_id = _item_id("rs" if kind == "reasoning" else "msg")
            self._open, self._text = {"id": item_id, "type": kind}, ""
            added = reasoning_item(item_id, "") if kind == "reasoning" else message_item(item_id, "", "in_progress")
            added["content"] = []
            part = {"type": "reasoning_text", "text": ""}
            if kind != "reasoning":
                part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            events.append(self._event("response.output_item.added", output_index=index, item=added))
            events.append(
                self._event(
                    "response.content_part.added", item_id=item_id, output_index=index, content_index=0, part=part
                )
            )
        self._text += delta
        name = "response.reasoning_text.delta" if kind == "reasoning" else "response.output_text.delta"
        extra = {} if kind == "reasoning" else {"logprobs": self._answer_logprobs()}
        events.append(
            self._event(name, item_id=self._open["id"], output_index=index, content_index=0, delta=delta, **extra)
        )
        return events

    def _answer_logprobs(self) -> list[dict]:
        """The logprobs of the answer's tokens that arrived since the last output_text delta (none of the
        reasoning's: they start after `</think>` when the server reads reasoning apart)."""
        if not self._entries:
            return []
        if self._answer_start is None:
            reasoned = self.reasoning_parsed
            self._answer_start = answer_start(self._token_ids, self.decode, self.in_reasoning) if reasoned else 0
        new = self._entries[max(self._given, self._answer_start) :]
        self._given = len(self._entries)
        self._item_logprobs += new
        return new

    def _call_delta(self, call: api.DeltaToolCall) -> list[str]:
        """A tool call's piece: its first (with the call's id) opens a function_call item."""
        events: list[str] = []
        index = len(self.output)
        if call.id is not None:
            events += self._close()
            item_id = _item_id("fc")
            name = call.function.name if call.function is not None else ""
            self._open = {"id": item_id, "type": "function_call", "call_id": call.id, "name": name}
            self._text = ""
            added = call_item(item_id, call.id, name, "", "in_progress")
            events.append(self._event("response.output_item.added", output_index=index, item=added))
        arguments = call.function.arguments if call.function is not None else ""
        if arguments and self._open is not None and self._open["type"] == "function_call":
            self._text += arguments
            item_id = self._open["id"]
            events.append(
                self._event(
                    "response.function_call_arguments.delta", item_id=item_id, output_index=index, delta=arguments
                )
            )
        return events

    def chunk(self, chunk: api.ChatCompletionChunk) -> list[str]:
        """A chat chunk's events (its usage-only last chunk: none)."""
        events: list[str] = []
        for choice in chunk.choices:
            delta = choice.delta
            self._token_ids += choice.token_ids or []
            if choice.logprobs is not None and choice.logprobs.content:
                self._entries += [e.model_dump() for e in choice.logprobs.content]
            if delta.reasoning_content:
                events += self._text_delta("reasoning", delta.reasoning_content)
            if delta.content:
                events += self._text_delta("message", delta.content)
            for call in delta.tool_calls or []:
                events += self._call_delta(call)
            if choice.finish_reason is not None:
                self._finish = choice.finish_reason
                if self._open is not None and self._open["type"] == "message" and len(self._entries) > self._given:
                    events += self._text_delta("message", "")  # the last tokens' logprobs (a stop token's)
        return events

    def end(self, usage: api.Usage | None) -> tuple[list[str], Response]:
        """The last events (response.completed, or response.incomplete when cut at max_output_tokens)
        and the finished response."""
        events = self._close()
        reasoning = partial(reasoning_tokens, self._token_ids, self.decode, self.in_reasoning)
        zero = api.Usage(prompt_tokens=0, total_tokens=0)
        done = finished(self.response, self.output, self._finish, usage_of(usage or zero, reasoning))
        kind = "response.incomplete" if done.status == "incomplete" else "response.completed"
        events.append(self._event(kind, response=done.model_dump()))
        return events, done

    def failed(self, message: str) -> str:
        error = {"code": "server_error", "message": message[:512]}
        failed = self.response.model_copy(update={"status": "failed", "error": error, "output": self.output})
        return self._event("response.failed", response=failed.model_dump())


# ---- background responses -----------------------------------------------------------------------
class BackgroundRun:
    """A background response in flight: its task and, when streamed, its events so far, which any
    number of readers follow from a sequence number (`follow`)."""

    def __init__(self, streamed: bool = False) -> None:
        self.streamed = streamed  # its events are kept (a streamed response); else there are none
        self.events: list[str] = []
        self.ended = False
        self.task: asyncio.Task | None = None
        self._changed = asyncio.Condition()

    async def add(self, event: str) -> None:
        async with self._changed:
            self.events.append(event)
            self._changed.notify_all()

    async def end(self) -> None:
        async with self._changed:
            self.ended = True
            self._changed.notify_all()

    def _ready(self, i: int) -> bool:
        return i < len(self.events) or self.ended

    async def follow(self, after: int = -1) -> AsyncIterator[str]:
        """The events numbered after `after`, then each new one until the run ends (a reader that
        leaves does not stop the run)."""
        i = max(0, after + 1)
        while True:
            async with self._changed:
                await self._changed.wait_for(partial(self._ready, i))
                batch = self.events[i:]
            for event in batch:
                yield event
            i += len(batch)
            if not batch and self.ended:
                return


class BackgroundRuns:
    """The server's background responses by id: those running, and the last FINISHED_RUNS that ended
    (a streamed one's events stay replayable)."""

    def __init__(self, keep: int = FINISHED_RUNS) -> None:
        self.keep = keep
        self._runs: OrderedDict[str, BackgroundRun] = OrderedDict()

    def start(
        self, response_id: str, work: Callable[[BackgroundRun], Awaitable[None]], streamed: bool = False
    ) -> BackgroundRun:
        """Run `work(run)` detached; the run ends (and readers stop waiting) however the work ends."""
        run = BackgroundRun(streamed)

        async def body() -> None:
            try:
                await work(run)
            finally:
                await run.end()
                self._trim()

        self._runs[response_id] = run
        run.task = asyncio.ensure_future(body())
        return run

    def get(self, response_id: str) -> BackgroundRun | None:
        return self._runs.get(response_id)

    def running(self, response_id: str) -> bool:
        run = self._runs.get(response_id)
        return run is not None and not run.ended

    async def cancel(self, response_id: str) -> None:
        """Stop a running one and wait until its work has unwound (its request aborted)."""
        run = self._runs.get(response_id)
        if run is None or run.task is None or run.task.done():
            return
        run.task.cancel()
        with contextlib.suppress(BaseException):
            await run.task

    async def cancel_all(self) -> None:
        for response_id in list(self._runs):
            await self.cancel(response_id)

    def _trim(self) -> None:
        ended = [rid for rid, run in self._runs.items() if run.ended]
        for rid in ended[: max(0, len(ended) - self.keep)]:
            del self._runs[rid]
