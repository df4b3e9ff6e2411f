"""What both front doors (the gRPC gateway and the HTTP server) check, and how they report it.

A bad field is a ValueError whose message starts with the field's name ("temperature: must be >= 0,
got -1"); `classify` sorts any error raised before a request is queued into the kinds both doors map
to their status codes (gRPC's INVALID_ARGUMENT / NOT_FOUND / RESOURCE_EXHAUSTED / UNAVAILABLE, HTTP's
400 / 404 / 429 / 503), and `brief` keeps every message short: a 20 kB value is never echoed back.
"""

from __future__ import annotations

import enum
import re
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

from deltaserve.cluster.core.sampling_params import SamplingParams
from deltaserve.workers.config import short

from .driver import AdapterNotFoundError, EngineUnavailableError, QueueFullError

MAX_REQUEST_ID_LEN = 256
MAX_ERROR_CHARS = 512
MAX_CHAT_MESSAGES = 4096
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")
# keys a chat message may carry into the template (OpenAI's, plus reasoning_content as vLLM takes it)
CHAT_MESSAGE_KEYS = ("role", "content", "name", "tool_calls", "tool_call_id", "reasoning_content")

_FIELD = re.compile(r"^([A-Za-z_][\w.\[\]]*): ")


class ErrorKind(enum.Enum):
    INVALID = "invalid"  # a bad field: gRPC INVALID_ARGUMENT, HTTP 400
    NOT_FOUND = "not_found"  # an unknown model or LoRA adapter: NOT_FOUND, 404
    QUEUE_FULL = "queue_full"  # RESOURCE_EXHAUSTED, 429
    UNAVAILABLE = "unavailable"  # the engine is down: UNAVAILABLE, 503


class ModelNotFoundError(ValueError):
    """The request names a model this server does not serve."""


def classify(error: BaseException) -> ErrorKind | None:
    """The kind of an error raised before anything was queued; None for anything else (a bug)."""
    if isinstance(error, ModelNotFoundError | AdapterNotFoundError):
        return ErrorKind.NOT_FOUND
    if isinstance(error, ValueError):
        return ErrorKind.INVALID
    if isinstance(error, QueueFullError):
        return ErrorKind.QUEUE_FULL
    if isinstance(error, EngineUnavailableError):
        return ErrorKind.UNAVAILABLE
    return None


def brief(message: str, limit: int = MAX_ERROR_CHARS) -> str:
    """The message cut to `limit` characters (status details and error bodies stay small)."""
    return message if len(message) <= limit else message[: limit - 3] + "..."


def field_of(message: str) -> str | None:
    """The field a "field: why" message names."""
    match = _FIELD.match(message)
    return match.group(1) if match else None


def request_id(given: str | None) -> str:
    """The client's request id, or a fresh one."""
    if not given:
        return uuid.uuid4().hex
    if len(given) > MAX_REQUEST_ID_LEN:
        raise ValueError(f"request_id: at most {MAX_REQUEST_ID_LEN} characters, got {len(given)}")
    return given


def sampling_params(fields: Mapping[str, Any]) -> SamplingParams:
    """SamplingParams from the fields a client set (the others keep their defaults)."""
    known = SamplingParams.__dataclass_fields__
    for name in fields:
        if name not in known:
            raise ValueError(f"{short(name)}: not a sampling parameter")
    return SamplingParams(**fields)


def chat_messages(messages: Any) -> list[dict]:
    """A chat as the template sees it: plain dicts with a known role, text content (a list of text
    parts is joined by newlines), no None values. Raises ValueError naming the message and key."""
    if not isinstance(messages, Sequence) or isinstance(messages, str | bytes):
        raise ValueError("messages: must be a list of messages")
    if not messages:
        raise ValueError("messages: must hold at least one message")
    if len(messages) > MAX_CHAT_MESSAGES:
        raise ValueError(f"messages: at most {MAX_CHAT_MESSAGES}, got {len(messages)}")
    return [_chat_message(i, m) for i, m in enumerate(messages)]


def _chat_message(i: int, message: Any) -> dict:
    where = f"messages[{i}]"
    if not isinstance(message, Mapping):
        raise ValueError(f"{where}: must be an object with a role and content")
    out: dict[str, Any] = {}
    for key, value in message.items():
        if key not in CHAT_MESSAGE_KEYS:
            raise ValueError(f"{where}.{str(key)[:40]}: not a chat message field")
        if value is not None:
            out[key] = value
    role = out.get("role")
    if role not in CHAT_ROLES:
        raise ValueError(f"{where}.role: must be one of {', '.join(CHAT_ROLES)}; got {short(role)}")
    content = out.get("content")
    if isinstance(content, list):
        out["content"] = "\n".join(_text_part(f"{where}.content[{j}]", part) for j, part in enumerate(content))
    elif content is not None and not isinstance(content, str):
        raise ValueError(f"{where}.content: must be a string or a list of text parts")
    if content is None and not (role == "assistant" and out.get("tool_calls")):
        raise ValueError(f"{where}.content: required (only an assistant message with tool_calls may omit it)")
    for key in ("name", "tool_call_id", "reasoning_content"):
        if key in out and not isinstance(out[key], str):
            raise ValueError(f"{where}.{key}: must be a string")
    if "tool_calls" in out and not isinstance(out["tool_calls"], list):
        raise ValueError(f"{where}.tool_calls: must be a list")
    return out


def _text_part(where: str, part: Any) -> str:
    if not isinstance(part, Mapping) or part.get("type") != "text" or not isinstance(part.get("text"), str):
        kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
        raise ValueError(f"{where}: only text parts ({{'type': 'text', 'text': ...}}) are supported, got {short(kind)}")
    return part["text"]
