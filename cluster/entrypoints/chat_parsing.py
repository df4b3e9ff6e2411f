"""What a chat completion's text holds besides its answer, in OpenAI's fields: the reasoning
(`--reasoning-parser qwen3`: Qwen's `<think> ... </think>`, into `reasoning_content`) and the tool calls
(`--tool-call-parser hermes`: a JSON object in `<tool_call>` tags, as Qwen3 and the demo's template ask;
`qwen3_coder`: Qwen3-Coder's and Qwen3.5's `<function=NAME>` with `<parameter=NAME>` blocks), into
`tool_calls`. vLLM's parser names and shapes. A `tool_choice` that forces calls ("required", or one named
function) needs no parser: the output is constrained to JSON (`ForcedTools.schema`, structured output)
and read back as the calls, as vLLM does.

`ChatParser` reads one completion's text as it streams (`feed`, then `finish`) and returns what each
piece adds; a whole text goes through the same reading at once, so a stream and a whole answer always
agree. A tag split across two steps is held back until it is whole. A tool call streams as vLLM's do:
once its function's name is read (hermes: `{"name": ..., "arguments": {` ; qwen3_coder: `<function=...>`)
its id and name go out, then its arguments as they come (hermes: the JSON object's text as written;
qwen3_coder: `{`, each parameter as `"name": value` once it closes (a string's text as it comes), `}`),
so a call cut short (max_tokens) is a call with partial arguments, as OpenAI's. A block whose name is
not read first is read whole at its closing tag: a call (hermes: the arguments re-serialized), or, when
it does not parse, text of the answer.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

from deltaserve.cluster.config import TOOL_CALL_PARSERS

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
REASONING_END = THINK_CLOSE + "\n\n"  # how Qwen's templates close a reasoning block before the answer
CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
_FUNCTION = re.compile(r"<function=([^>\n]+)>(.*?)</function>", re.DOTALL)
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)</parameter>", re.DOTALL)
_JSON_TYPES = {
    "integer": int, "number": (int, float), "boolean": bool, "object": dict, "array": list, "null": type(None),
}  # fmt: skip


@dataclass(frozen=True)
class ToolCall:
    """One parsed call: OpenAI's id, the function's name, its arguments as JSON text."""

    id: str
    name: str
    arguments: str


@dataclass(frozen=True)
class ToolCallDelta:
    """A piece of tool call `index` (the completion's calls counted from 0): its first piece carries
    the id and the function's name, every piece more of the arguments' JSON text (OpenAI's stream
    shape; `merge_calls` puts the pieces together)."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


def merge_calls(deltas: list[ToolCallDelta]) -> list[ToolCall]:
    """The whole calls the pieces make, by index."""
    calls: dict[int, list] = {}
    for d in deltas:
        call = calls.setdefault(d.index, [d.id, d.name, ""])
        call[0], call[1] = call[0] or d.id, call[1] or d.name
        call[2] += d.arguments
    return [ToolCall(calls[i][0] or "", calls[i][1] or "", calls[i][2]) for i in sorted(calls)]


@dataclass
class Parsed:
    """What a piece of the text added (or, from `parse`, the whole message)."""

    content: str = ""
    reasoning: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)

    def __iadd__(self, other: Parsed) -> Parsed:
        self.content += other.content
        self.reasoning += other.reasoning
        self.tool_calls += other.tool_calls
        return self


@dataclass(frozen=True)
class ForcedTools:
    """A tool_choice that forces calls: `name` one function (the output is its arguments), or None:
    "required", one or more calls of any offered function (the output is a JSON array of {"name",
    "parameters"}). Either way the arguments stream as they come."""

    name: str | None
    schema: dict  # the JSON schema the output is held to


def forced_tools(tool_choice, tools: list[dict] | None, parallel: bool | None = None) -> ForcedTools | None:
    """The calls a request's tool_choice forces ("required", or {"type": "function", "function":
    {"name": ...}}), None for "auto", "none" or unset; ValueError naming tool_choice when it names no
    offered function or none is offered. parallel False (OpenAI's parallel_tool_calls): one call."""
    if tool_choice in (None, "auto", "none"):
        return None
    schemas = {}  # each offered function's whole parameters schema (required fields too)
    for tool in tools or []:
        function = tool.get("function") if isinstance(tool, dict) else None
        if isinstance(function, dict) and isinstance(function.get("name"), str):
            params = function.get("parameters")
            schemas[function["name"]] = params if isinstance(params, dict) else {"type": "object"}
    if not schemas:
        raise ValueError("tool_choice: forcing a call needs `tools` with at least one function")
    if tool_choice == "required":
        one = [
            {
                "type": "object",
                "properties": {"name": {"const": name}, "parameters": schema},
                "required": ["name", "parameters"],
            }
            for name, schema in schemas.items()
        ]
        most = {"maxItems": 1} if parallel is False else {}
        return ForcedTools(None, {"type": "array", "minItems": 1, **most, "items": {"anyOf": one}})
    name = tool_choice.get("function", {}).get("name") if isinstance(tool_choice, dict) else None
    if name not in schemas:
        raise ValueError(f"tool_choice: names no function of `tools` ({', '.join(sorted(schemas))[:200]})")
    return ForcedTools(name, schemas[name])


def opens_reasoning(prompt: str) -> bool:
    """Whether the rendered prompt ends inside an open `<think>` block (Qwen's generation prompt opens
    one; with thinking off it writes an empty, closed one): the completion then starts in its reasoning."""
    return prompt.rfind(THINK_OPEN) > prompt.rfind(THINK_CLOSE)


def reasoning_tokens(token_ids: list[int], decode: Callable[[list[int]], str], in_reasoning: bool) -> int:
    """The output tokens whose text lies before the reasoning block's end (`</think>`; all of them while
    it never ended, none for an answer that did not reason). `decode`: ids -> text, special tokens kept."""
    text = decode(token_ids)
    end = text.find(THINK_CLOSE)
    if end < 0:
        return len(token_ids) if in_reasoning else 0
    low, high = 0, len(token_ids)  # the most leading tokens whose text ends at or before the tag
    while low < high:
        mid = (low + high + 1) // 2
        if len(decode(token_ids[:mid])) <= end:
            low = mid
        else:
            high = mid - 1
    return low


def answer_start(token_ids: list[int], decode: Callable[[list[int]], str], in_reasoning: bool) -> int:
    """The first output token after the reasoning block (`</think>` included in the block): 0 for an
    answer that did not reason, len(token_ids) while the block never ended. `decode` as reasoning_tokens'."""
    text = decode(token_ids)
    end = text.find(THINK_CLOSE)
    if end < 0:
        return len(token_ids) if in_reasoning else 0
    close = end + len(THINK_CLOSE)
    low, high = 0, len(token_ids)  # the fewest leading tokens whose text reaches past the tag
    while low < high:
        mid = (low + high) // 2
        if len(decode(token_ids[:mid])) >= close:
            high = mid
        else:
            low = mid + 1
    return low


def reading(reasoning_parser: str | None, tool_call_parser: str | None, prompt: str, tools: list | None) -> dict:
    """ChatParser's settings for the completions of a chat rendered as `prompt` and offered `tools`
    (None or empty: no tool calls read), under the server's parsers."""
    offered = tool_call_parser is not None and bool(tools)
    return dict(
        reasoning=reasoning_parser is not None,
        in_reasoning=opens_reasoning(prompt),
        tool_parser=tool_call_parser if offered else None,
        schemas=tool_schemas(tools),
    )


def tool_schemas(tools: list[dict] | None) -> dict[str, dict]:
    """Each offered function's parameter properties by name (OpenAI's `tools`), for typing the XML
    format's values."""
    out = {}
    for tool in tools or []:
        function = tool.get("function") if isinstance(tool, dict) else None
        if isinstance(function, dict) and isinstance(function.get("name"), str):
            params = function.get("parameters")
            props = params.get("properties") if isinstance(params, dict) else None
            out[function["name"]] = props if isinstance(props, dict) else {}
    return out


class ChatParser:
    """One completion's text into content, reasoning and tool calls. `reasoning`: the qwen3 reasoning
    parser is on, and `in_reasoning` whether the text starts inside the reasoning (opens_reasoning);
    `tool_parser`: a TOOL_CALL_PARSERS name (None: no tool calls parsed), `schemas`: tool_schemas."""

    def __init__(
        self,
        *,
        reasoning: bool = False,
        in_reasoning: bool = False,
        tool_parser: str | None = None,
        schemas: dict[str, dict] | None = None,
        forced: ForcedTools | None = None,
    ):
        if tool_parser is not None and tool_parser not in TOOL_CALL_PARSERS:
            raise ValueError(f"tool_call_parser: must be one of {TOOL_CALL_PARSERS}, got {tool_parser!r}")
        self._forced = forced
        self._state = "reasoning" if reasoning and in_reasoning else "start" if reasoning else "content"
        if forced is not None and forced.name is None:
            self._state = "array"  # "required": a JSON array of {"name", "parameters"}
        self._seen = ""  # "required": the text so far (what it is, if no call comes of it)
        self._tool_parser = tool_parser
        self._schemas = schemas or {}
        self._pending = ""  # text read but not yet given out (a tag may begin in it)
        self._after_think = False  # the newlines after </think> are the template's, not the answer's
        self._segment_has_text = False  # answer text since the last tool call
        self.num_tool_calls = 0
        # the call being streamed: its index, JSON scan (hermes: depth, in a string, after a backslash),
        # parameters so far, the open parameter's schema and what goes before its value (qwen3_coder)
        self._index = 0
        self._scan = (0, False, False)
        self._params = 0
        self._schema = None
        self._head = ""
        self._at_start = False

    @property
    def ends_in_calls(self) -> bool:
        """Whether a completion that stopped by itself ended for its tool calls (finish reason
        tool_calls): parsed ones, or "required"'s; a named function's ends as "stop" (vLLM's)."""
        return self.num_tool_calls > 0 and (self._forced is None or self._forced.name is None)

    def feed(self, text: str) -> Parsed:
        if self._forced is not None and self._forced.name is not None:  # the text is the arguments
            if not text:
                return Parsed()
            first = self.num_tool_calls == 0
            self.num_tool_calls = 1
            return Parsed(
                tool_calls=[
                    ToolCallDelta(0, _call_id(), self._forced.name, text) if first else ToolCallDelta(0, arguments=text)
                ]
            )
        self._pending += text
        if self._forced is not None:  # "required": the array's calls, each as its parameters come
            self._seen += text
        return self._drain(final=False)

    def finish(self) -> Parsed:
        if self._forced is not None and self._forced.name is not None:
            return Parsed()  # its pieces went out as they came
        out = self._drain(final=True)
        if self._forced is not None and not self.num_tool_calls:  # not the calls' JSON after all
            return Parsed(content=self._seen)
        return out

    def _drain(self, final: bool) -> Parsed:
        out = Parsed()
        while True:
            step = self._step(final)
            if step is None:
                return out
            out += step

    def _step(self, final: bool) -> Parsed | None:
        """Give out what the pending text settles (None: nothing more until more text arrives)."""
        text = self._pending
        if self._state in ("array", "element_tail", "array_end"):
            return self._array_step(text, final)
        if self._state == "start":  # does the completion open its own reasoning block?
            stripped = text.lstrip()
            if stripped.startswith(THINK_OPEN):
                self._pending, self._state = stripped[len(THINK_OPEN) :], "reasoning"
                return Parsed()
            if not final and THINK_OPEN.startswith(stripped):
                return None
            self._state = "content"
            return Parsed()
        if self._state == "reasoning":
            end = text.find(THINK_CLOSE)
            if end >= 0:
                self._pending, self._state, self._after_think = text[end + len(THINK_CLOSE) :], "content", True
                return Parsed(reasoning=text[:end])
            keep = 0 if final else _partial_tag(text, THINK_CLOSE)
            if len(text) == keep:
                return None
            self._pending = text[len(text) - keep :]
            return Parsed(reasoning=text[: len(text) - keep])
        if self._state == "content":
            if self._after_think:
                text = text.lstrip("\n")
                if not text and not final:
                    self._pending = ""
                    return None
                self._after_think = False
            start = text.find(CALL_OPEN) if self._tool_parser else -1
            if start >= 0:
                self._pending, self._state = text[start + len(CALL_OPEN) :], "call"
                return Parsed(content=self._segment(text[:start], ended=True))
            keep = 0 if final or not self._tool_parser else _partial_tag(text, CALL_OPEN)
            emit = text[: len(text) - keep]
            if not emit or (self._format_space(emit) and not final):
                self._pending = text
                return None  # whitespace after a call: kept only if the answer goes on
            self._pending = text[len(text) - keep :]
            return Parsed(content=self._segment(emit, ended=final))
        if self._state == "call":  # a block opened: is its function's name read first?
            head = _hermes_head(text) if self._tool_parser == "hermes" else _xml_head(text)
            if head == "wait" and CALL_CLOSE not in text and not final:
                return None
            if isinstance(head, tuple):
                name, start = head
                self._index, self._state = self.num_tool_calls, self._tool_parser
                self.num_tool_calls += 1
                self._segment_has_text = False
                if self._state == "hermes":
                    self._pending, self._scan = text[start:], (0, False, False)
                    return self._delta(_call_id(), name)
                self._pending, self._params, self._schema = text[start:], 0, self._schemas.get(name, {})
                return self._delta(_call_id(), name, "{")
            return self._whole_block(text, final)
        return self._call_step(text, final)

    def _array_step(self, text: str, final: bool) -> Parsed | None:
        """ "required"'s array: each element's name once read, then its parameters as they come (the
        hermes states stream them), then the element's closing brace."""
        if not text:
            return None
        if self._state == "array_end":
            self._pending = ""
            return None
        if self._state == "element_tail":
            end = text.find("}")
            self._pending, self._state = (text[end + 1 :], "array") if end >= 0 else ("", self._state)
            return Parsed() if end >= 0 else None
        rest = text.lstrip(" \t\r\n[,")
        if not rest:
            self._pending = ""
            return None
        head = _hermes_head(rest) if rest[0] == "{" else None
        if head == "wait":
            self._pending = "" if final else rest
            return None
        if head is None:  # the array's end (or not this shape): nothing more is a call
            self._pending, self._state = "", "array_end"
            return Parsed()
        name, start = head
        self._index = self.num_tool_calls
        self.num_tool_calls += 1
        self._pending, self._scan, self._state = rest[start:], (0, False, False), "hermes"
        return self._delta(_call_id(), name)

    def _delta(self, call_id: str | None = None, name: str | None = None, arguments: str = "") -> Parsed:
        return Parsed(tool_calls=[ToolCallDelta(self._index, call_id, name, arguments)])

    def _whole_block(self, text: str, final: bool) -> Parsed | None:
        """A block whose name was not read first: a call once it closes, if it parses; else text."""
        end = text.find(CALL_CLOSE)
        if end < 0 and not final:
            return None
        block = text[:end] if end >= 0 else text
        self._pending = text[end + len(CALL_CLOSE) :] if end >= 0 else ""
        self._state = "content"
        call = self._parse_block(block)
        if call is None:  # not a call after all: the answer's text, tags and all
            closing = CALL_CLOSE if end >= 0 else ""
            return Parsed(content=CALL_OPEN + block + closing)
        self._index = self.num_tool_calls
        self.num_tool_calls += 1
        self._segment_has_text = False
        return self._delta(call.id, call.name, call.arguments)

    def _call_step(self, text: str, final: bool) -> Parsed | None:
        """The streamed call's next piece (states: hermes, hermes_tail; qwen3_coder, xml_string,
        xml_typed, xml_tail)."""
        if not text:
            return None
        state = self._state
        if state in ("hermes_tail", "xml_tail"):  # the format's closing text, up to the block's end
            end = text.find(CALL_CLOSE)
            if end >= 0:
                self._pending, self._state = text[end + len(CALL_CLOSE) :], "content"
                return Parsed()
            self._pending = "" if final else text[len(text) - _partial_tag(text, CALL_CLOSE) :]
            return Parsed() if final else None
        if state == "hermes":  # the arguments object's text, to its closing brace
            end = text.find(CALL_CLOSE)
            if end >= 0:
                region = text[:end]
            else:
                region = text if final else text[: len(text) - _partial_tag(text, CALL_CLOSE)]
            used, closed = self._scan_json(region)
            if closed:  # then the block's end, or (a "required" array) the element's
                self._pending = text[used:]
                self._state = "element_tail" if self._forced is not None else "hermes_tail"
                return self._delta(arguments=region[:used])
            if end >= 0:  # the block ended inside the object
                self._pending, self._state = text[end + len(CALL_CLOSE) :], "content"
                return self._delta(arguments=region)
            self._pending = text[len(region) :]
            if not region:
                return None
            return self._delta(arguments=region)
        if state == "qwen3_coder":  # between parameters
            tags = (PARAM_OPEN, FUNCTION_CLOSE, CALL_CLOSE)
            p, tag = _first_tag(text, tags)
            if tag is None:  # the format's whitespace between parameters
                self._pending = "" if final else text[len(text) - _partial_any(text, tags) :]
                return Parsed() if final else None
            if tag == PARAM_OPEN:
                close = text.find(">", p)
                if close < 0:
                    if final:
                        self._pending = ""
                        return Parsed()
                    self._pending = text[p:]
                    return None
                key = text[p + len(PARAM_OPEN) : close].strip()
                self._pending = text[close + 1 :]
                sep = ", " if self._params else ""
                self._params += 1
                self._head = sep + json.dumps(key, ensure_ascii=False) + ": "
                schema = self._schema.get(key)
                if _is_text(schema):
                    self._state, self._at_start = "xml_string", True
                    return self._delta(arguments=self._head + '"')
                self._state, self._param_schema = "xml_typed", schema
                return Parsed()
            self._pending = text[p + len(tag) :]
            self._state = "xml_tail" if tag == FUNCTION_CLOSE else "content"
            return self._delta(arguments="}")
        ends = (PARAM_CLOSE, FUNCTION_CLOSE, CALL_CLOSE)
        if state == "xml_string":  # a text parameter's value, JSON-escaped as it comes
            if self._at_start:
                self._at_start = False
                if text.startswith("\n"):
                    text = self._pending = text[1:]
                    if not text:
                        return Parsed()
            p, tag = _first_tag(text, ends)
            if tag is not None:
                value = text[:p]
                value = value[:-1] if value.endswith("\n") else value
                self._pending = text[p + len(tag) :] if tag == PARAM_CLOSE else text[p:]
                self._state = "qwen3_coder"
                return self._delta(arguments=_escaped(value) + '"')
            keep = 0 if final else _partial_any(text, ends)
            body = text[: len(text) - keep]
            if body.endswith("\n") and not final:  # the value's last newline is the format's
                body = body[:-1]
            self._pending = text[len(body) :]
            if not body:
                return None
            return self._delta(arguments=_escaped(body))
        # xml_typed: a typed parameter's value, given out once it closes
        p, tag = _first_tag(text, ends)
        if tag is None:
            if final:
                self._pending = ""
                return Parsed()
            return None
        value = _typed(_strip_one_newline(text[:p]), self._param_schema)
        self._pending = text[p + len(tag) :] if tag == PARAM_CLOSE else text[p:]
        self._state = "qwen3_coder"
        return self._delta(arguments=self._head + json.dumps(value, ensure_ascii=False))

    def _scan_json(self, text: str) -> tuple[int, bool]:
        """How much of `text` belongs to the arguments object (to its closing brace) and whether it closed."""
        depth, quoted, escaped = self._scan
        for i, ch in enumerate(text):
            if quoted:
                if escaped:
                    escaped = False
                elif ch == "\\":
                    escaped = True
                elif ch == '"':
                    quoted = False
            elif ch == '"':
                quoted = True
            elif ch in "{[":
                depth += 1
            elif ch in "}]":
                depth -= 1
                if depth == 0:
                    self._scan = (0, False, False)
                    return i + 1, True
        self._scan = (depth, quoted, escaped)
        return len(text), False

    def _format_space(self, text: str) -> bool:
        """Whether `text` is whitespace that opens the text after a tool call (the format's, not the
        answer's, unless more of the answer follows it before the next call)."""
        return self.num_tool_calls > 0 and not self._segment_has_text and not text.strip()

    def _segment(self, text: str, ended: bool) -> str:
        """Answer text read after the last tool call; a segment of whitespace alone is dropped."""
        if ended and self._format_space(text):
            return ""
        self._segment_has_text = self._segment_has_text or bool(text.strip())
        return text

    def _parse_block(self, block: str) -> ToolCall | None:
        if self._tool_parser == "hermes":
            try:
                value = json.loads(block)
            except ValueError:
                return None
            if not isinstance(value, dict) or not isinstance(value.get("name"), str):
                return None
            args = value.get("arguments", value.get("parameters", {}))
            text = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
            return ToolCall(_call_id(), value["name"], text)
        match = _FUNCTION.search(block)
        if match is None:
            return None
        name = match.group(1).strip()
        props = self._schemas.get(name, {})
        args = {}
        for param in _PARAMETER.finditer(match.group(2)):
            key = param.group(1).strip()
            args[key] = _typed(_strip_one_newline(param.group(2)), props.get(key))
        return ToolCall(_call_id(), name, json.dumps(args, ensure_ascii=False))


PARAM_OPEN, PARAM_CLOSE, FUNCTION_CLOSE = "<parameter=", "</parameter>", "</function>"


def _hermes_head(text: str) -> tuple[str, int] | str | None:
    """(name, where the arguments object starts) once a block's text reads `{"name": "...",
    "arguments": {` (or "parameters"); "wait" while it still may; None when it is another shape."""
    i, n, name = 0, len(text), ""
    for token in ("{", '"name"', ":", "NAME", ",", "ARGS", ":", "{"):
        while i < n and text[i].isspace():
            i += 1
        if i >= n:
            return "wait"
        if token == "NAME":
            if text[i] != '"':
                return None
            j = i + 1
            while j < n and text[j] not in '"\\\n':
                j += 1
            if j >= n:
                return "wait"
            if text[j] != '"':
                return None
            name, i = text[i + 1 : j], j + 1
            continue
        options = ('"arguments"', '"parameters"') if token == "ARGS" else (token,)
        rest = text[i:]
        hit = next((o for o in options if rest.startswith(o)), None)
        if hit is None:
            return "wait" if any(o.startswith(rest) for o in options) else None
        i += len(hit)
    return name, i - 1


def _xml_head(text: str) -> tuple[str, int] | str | None:
    """(name, where its parameters start) once a block's text reads `<function=NAME>`; "wait" while it
    still may; None when it is another shape."""
    rest = text.lstrip()
    opening = "<function="
    if not rest.startswith(opening):
        return "wait" if opening.startswith(rest) else None
    close = rest.find(">")
    bad = next((i for i, ch in enumerate(rest) if ch in "\n<" and i >= len(opening)), -1)
    if close < 0:
        return "wait" if bad < 0 else None
    if 0 <= bad < close:
        return None
    return rest[len(opening) : close].strip(), len(text) - len(rest) + close + 1


def _first_tag(text: str, tags: tuple[str, ...]) -> tuple[int, str | None]:
    """The earliest of `tags` in `text` (position, tag), or (-1, None)."""
    found = [(text.find(t), t) for t in tags]
    found = [f for f in found if f[0] >= 0]
    return min(found) if found else (-1, None)


def _partial_any(text: str, tags: tuple[str, ...]) -> int:
    return max(_partial_tag(text, t) for t in tags)


def _is_text(schema) -> bool:
    """Whether a parameter's value is a JSON string (its schema says string, or says no one type)."""
    kind = schema.get("type") if isinstance(schema, dict) else None
    return kind in (None, "string") or isinstance(kind, list)


def _escaped(text: str) -> str:
    """Text as the inside of a JSON string (pieces escape as the whole does)."""
    return json.dumps(text, ensure_ascii=False)[1:-1]


def _partial_tag(text: str, tag: str) -> int:
    """How many characters at the end of `text` could begin `tag` (to be held back)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


def _strip_one_newline(value: str) -> str:
    value = value[1:] if value.startswith("\n") else value
    return value[:-1] if value.endswith("\n") else value


def _typed(value: str, schema) -> object:
    """A parameter's text as its schema's type (strings, and anything that does not parse, stay text)."""
    kind = schema.get("type") if isinstance(schema, dict) else None
    if kind in (None, "string") or isinstance(kind, list):
        return value
    try:
        parsed = json.loads(value)
    except ValueError:
        return value
    ok = _JSON_TYPES.get(kind)
    if ok is None or (kind in ("integer", "number") and isinstance(parsed, bool)):
        return value
    return parsed if isinstance(parsed, ok) else value


def _call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"
