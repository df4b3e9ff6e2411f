"""Python clients of the gateway (sync for the CLI, asyncio for benchmarks) and `stream_to_terminal`.

    with GenerationClient("127.0.0.1:50051") as client:
        for item in client.generate("Hello", max_tokens=32, temperature=0):
            if isinstance(item, Chunk):
                print(item.text, end="")

`generate` takes a text prompt, a list of token ids or a chat (a list of {"role", "content"} messages,
rendered by the server's chat template) and any SamplingParams field as a keyword (None means the
server's default); it yields a Chunk per engine step and a Final last. Logprobs come in vLLM's shape
({token id: Logprob}, the chosen token first). Errors are grpc.RpcError (`.code()`, `.details()`
naming the bad field). Leaving the iteration early cancels the call, which aborts the request on the
server. `api_key` sends `authorization: Bearer <key>`; `tls=True` (or `root_certificates`, a PEM
file) connects over TLS. With n > 1 the completions' chunks interleave (`index` on each) and every
completion ends with its own Final.
"""

from __future__ import annotations

import sys
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from contextlib import closing
from dataclasses import dataclass, field
from typing import TextIO

import grpc
from google.protobuf import struct_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc

from deltaserve.cluster.core.request import Logprob
from deltaserve.protos import generation_pb2 as pb
from deltaserve.protos import generation_pb2_grpc

from .grpc_security import auth_metadata, channel_credentials

DEFAULT_MAX_MESSAGE_BYTES = 4 * 2**20

_FINISH_REASONS = {
    pb.FINISH_REASON_STOP: "stop",
    pb.FINISH_REASON_LENGTH: "length",
    pb.FINISH_REASON_ABORT: "abort",
}


@dataclass(frozen=True)
class ToolCallPiece:
    """A piece of tool call `index`: the first has the id and name, each more of the arguments' JSON."""

    index: int
    id: str
    name: str
    arguments: str


@dataclass
class Chunk:
    """What one engine step added: token ids, the text delta and (when asked) their logprobs; for a
    chat prompt also what it adds to the answer, the reasoning and the tool calls (the server's
    parsers)."""

    token_ids: list[int]
    text: str
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    index: int = 0  # the completion (n > 1)
    content: str = ""
    reasoning: str = ""
    tool_calls: list[ToolCallPiece] = field(default_factory=list)


@dataclass
class Final:
    """The end of a generation."""

    request_id: str
    finish_reason: str  # stop, length or abort
    stop_reason: int | str | None  # the stop token id or stop string; None for EOS and length
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    time_to_first_token_s: float | None
    # when asked: entry i is prompt token i + 1 given the tokens before it (completion 0's final)
    prompt_logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    index: int = 0  # the completion (n > 1: a Final for each, the stream ends after the n-th)
    tool_calls: bool = False  # a chat's completion that stopped after its tool calls
    reasoning_tokens: int = 0  # a chat's output tokens before </think> (under --reasoning-parser)


class _Connection:
    """One channel to the gateway (over TLS with `tls` or `root_certificates`) and its stubs."""

    _channels = grpc  # grpc.aio for the asyncio client

    def __init__(
        self,
        target: str,
        *,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        api_key: str | None = None,
        tls: bool = False,
        root_certificates: str | None = None,
    ):
        options = _channel_options(max_message_bytes)
        if tls or root_certificates:
            credentials = channel_credentials(root_certificates)
            self.channel = self._channels.secure_channel(target, credentials, options=options)
        else:
            self.channel = self._channels.insecure_channel(target, options=options)
        self._metadata = auth_metadata(api_key)
        self._stub = generation_pb2_grpc.GenerationStub(self.channel)
        self._health = health_pb2_grpc.HealthStub(self.channel)


class GenerationClient(_Connection):
    """A blocking client over one channel; close it (or use it as a context manager) when done."""

    def generate(
        self,
        prompt: str | Sequence[int] | Sequence[dict],
        *,
        request_id: str = "",
        timeout_s: float | None = None,
        lora_name: str = "",
        priority: int = 0,
        cache_salt: str = "",
        **sampling,
    ) -> Iterator[Chunk | Final]:
        """Chunks as they arrive, then the Final; `timeout_s` bounds the whole stream; `lora_name`: a
        loaded adapter to run on; `priority`: lower first (a server under --scheduling-policy priority);
        `cache_salt`: share the prefix cache only with requests of this salt."""
        request = generate_request(
            prompt, request_id, lora_name=lora_name, priority=priority, cache_salt=cache_salt, **sampling
        )
        call = self._stub.Generate(request, timeout=timeout_s, metadata=self._metadata)
        try:
            for response in call:
                yield from_response(response)
        finally:
            call.cancel()  # a no-op once the call has ended; otherwise the server aborts the request

    def tokenize(self, text: str, *, timeout_s: float | None = None) -> list[int]:
        return list(
            self._stub.Tokenize(pb.TokenizeRequest(text=text), timeout=timeout_s, metadata=self._metadata).token_ids
        )

    def model_info(self, *, timeout_s: float | None = None) -> pb.ModelInfo:
        return self._stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=timeout_s, metadata=self._metadata)

    def load_lora_adapter(self, name: str, path: str, *, timeout_s: float | None = None) -> pb.LoraAdapter:
        request = pb.LoadLoraAdapterRequest(lora_name=name, lora_path=path)
        return self._stub.LoadLoraAdapter(request, timeout=timeout_s, metadata=self._metadata)

    def unload_lora_adapter(self, name: str, *, timeout_s: float | None = None) -> None:
        request = pb.UnloadLoraAdapterRequest(lora_name=name)
        self._stub.UnloadLoraAdapter(request, timeout=timeout_s, metadata=self._metadata)

    def list_lora_adapters(self, *, timeout_s: float | None = None) -> list[pb.LoraAdapter]:
        request = pb.ListLoraAdaptersRequest()
        return list(self._stub.ListLoraAdapters(request, timeout=timeout_s, metadata=self._metadata).adapters)

    def health(self, service: str = "", *, timeout_s: float | None = None) -> str:
        """SERVING or NOT_SERVING (grpc.health.v1); "" is the whole server."""
        response = self._health.Check(
            health_pb2.HealthCheckRequest(service=service), timeout=timeout_s, metadata=self._metadata
        )
        return health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> GenerationClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class AsyncGenerationClient(_Connection):
    """The asyncio twin of GenerationClient (create it inside the event loop that uses it)."""

    _channels = grpc.aio

    async def generate(
        self,
        prompt: str | Sequence[int] | Sequence[dict],
        *,
        request_id: str = "",
        timeout_s: float | None = None,
        lora_name: str = "",
        priority: int = 0,
        cache_salt: str = "",
        **sampling,
    ) -> AsyncIterator[Chunk | Final]:
        request = generate_request(
            prompt, request_id, lora_name=lora_name, priority=priority, cache_salt=cache_salt, **sampling
        )
        call = self._stub.Generate(request, timeout=timeout_s, metadata=self._metadata)
        try:
            async for response in call:
                yield from_response(response)
        finally:
            call.cancel()

    async def tokenize(self, text: str, *, timeout_s: float | None = None) -> list[int]:
        return list(
            (
                await self._stub.Tokenize(pb.TokenizeRequest(text=text), timeout=timeout_s, metadata=self._metadata)
            ).token_ids
        )

    async def model_info(self, *, timeout_s: float | None = None) -> pb.ModelInfo:
        return await self._stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=timeout_s, metadata=self._metadata)

    async def health(self, service: str = "", *, timeout_s: float | None = None) -> str:
        response = await self._health.Check(
            health_pb2.HealthCheckRequest(service=service), timeout=timeout_s, metadata=self._metadata
        )
        return health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)

    async def close(self) -> None:
        await self.channel.close()

    async def __aenter__(self) -> AsyncGenerationClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()


def stream_to_terminal(
    target: str,
    prompt: str | Sequence[int] | Sequence[dict],
    *,
    out: TextIO = sys.stdout,
    err: TextIO = sys.stderr,
    connection: dict | None = None,
    **sampling,
) -> int:
    """Print the text as it arrives on `out` and a summary line on `err`; returns an exit status
    (0, or 1 after printing the gRPC error). `connection`: GenerationClient's api_key / tls options.
    n > 1: completion 0 streams, the others print after it, each under a `[completion i]` line."""
    start = time.perf_counter()
    texts: dict[int, str] = {}
    finals: dict[int, Final] = {}
    with (
        GenerationClient(target, **(connection or {})) as client,
        closing(client.generate(prompt, **sampling)) as items,
    ):
        try:
            for item in items:
                if isinstance(item, Final):
                    finals[item.index] = item
                elif item.index == 0:
                    out.write(item.text)
                    out.flush()
                else:
                    texts[item.index] = texts.get(item.index, "") + item.text
        except grpc.RpcError as e:
            out.write("\n")
            print(f"error: {e.code().name}: {e.details()}", file=err)
            return 1
    elapsed = time.perf_counter() - start
    out.write("\n")
    for index in sorted(i for i in finals if i):
        out.write(f"[completion {index}]\n{texts.get(index, '')}\n")
    out.flush()
    for index in sorted(finals):
        label = f"[completion {index}] " if len(finals) > 1 else ""
        print(label + summary_line(finals[index], elapsed), file=err)
    return 0


def summary_line(final: Final, elapsed_s: float) -> str:
    reason = final.finish_reason if final.stop_reason is None else f"{final.finish_reason} ({final.stop_reason!r})"
    ttft = "-" if final.time_to_first_token_s is None else f"{final.time_to_first_token_s:.3f} s"
    rate = final.completion_tokens / elapsed_s if elapsed_s > 0 else 0.0
    return (
        f"[{reason}] {final.prompt_tokens} prompt + {final.completion_tokens} completion tokens"
        f" ({final.cached_tokens} cached), first token {ttft}, {elapsed_s:.2f} s, {rate:.1f} tokens/s"
    )


def generate_request(
    prompt: str | Sequence[int] | Sequence[dict],
    request_id: str = "",
    *,
    lora_name: str = "",
    priority: int = 0,
    cache_salt: str = "",
    tools: Sequence[dict] | None = None,
    chat_template_kwargs: dict | None = None,
    **sampling,
) -> pb.GenerateRequest:
    """The GenerateRequest for a prompt (text, token ids or chat messages; a chat's `tools` and
    `chat_template_kwargs` as OpenAI and vLLM write them), the adapter to run on ("" the base model),
    its priority and prefix-cache salt, and SamplingParams keywords (None: the server's default)."""
    chat = bool(prompt) and not isinstance(prompt, str) and isinstance(prompt[0], dict)
    if (tools or chat_template_kwargs) and not chat:
        raise ValueError("tools and chat_template_kwargs go with a chat prompt (a list of messages)")
    sampling = {name: value for name, value in sampling.items() if value is not None}
    if isinstance(sampling.get("stop"), str):
        sampling["stop"] = [sampling["stop"]]
    request = pb.GenerateRequest(
        request_id=request_id,
        sampling_params=pb.SamplingParams(**sampling),
        lora_name=lora_name,
        priority=priority,
        cache_salt=cache_salt,
    )
    if isinstance(prompt, str):
        request.text = prompt
    elif chat:
        request.chat.CopyFrom(chat_message(prompt, tools=tools, chat_template_kwargs=chat_template_kwargs))
    else:
        request.token_ids.ids.extend(prompt)
        request.token_ids.SetInParent()  # an empty id list still selects token_ids (and is rejected)
    return request


def from_response(response: pb.GenerateResponse) -> Chunk | Final:
    if response.HasField("chunk"):
        chunk = response.chunk
        return Chunk(
            list(chunk.token_ids),
            chunk.text,
            [_token_logprobs(lp) for lp in chunk.logprobs],
            chunk.index,
            chunk.content,
            chunk.reasoning,
            [ToolCallPiece(c.index, c.id, c.name, c.arguments) for c in chunk.tool_calls],
        )
    final = response.final
    stop_kind = final.WhichOneof("stop_reason")
    return Final(
        request_id=response.request_id,
        finish_reason=_FINISH_REASONS[final.finish_reason],
        stop_reason=None if stop_kind is None else getattr(final, stop_kind),
        prompt_tokens=final.usage.prompt_tokens,
        completion_tokens=final.usage.completion_tokens,
        cached_tokens=final.usage.cached_tokens,
        time_to_first_token_s=final.time_to_first_token_s if final.HasField("time_to_first_token_s") else None,
        prompt_logprobs=[_token_logprobs(lp) for lp in final.prompt_logprobs],
        index=final.index,
        tool_calls=final.tool_calls,
        reasoning_tokens=final.usage.reasoning_tokens,
    )


def chat_message(
    messages: Sequence[dict],
    *,
    add_generation_prompt: bool = True,
    tools: Sequence[dict] | None = None,
    chat_template_kwargs: dict | None = None,
) -> pb.Chat:
    """A Chat of OpenAI-style messages ({"role", "content", ...}; tool_calls as OpenAI writes them)."""
    chat = pb.Chat(add_generation_prompt=add_generation_prompt)
    for m in messages:
        calls = [
            pb.ToolCall(id=c.get("id", ""), name=c["function"]["name"], arguments=c["function"]["arguments"])
            for c in m.get("tool_calls") or []
        ]
        plain = {k: v for k, v in m.items() if k != "tool_calls" and v is not None}
        chat.messages.append(pb.ChatMessage(**plain, tool_calls=calls))
    for tool in tools or []:
        chat.tools.append(_struct(tool))
    if chat_template_kwargs:
        chat.chat_template_kwargs.CopyFrom(_struct(chat_template_kwargs))
    return chat


def _struct(value: dict) -> struct_pb2.Struct:
    out = struct_pb2.Struct()
    out.update(value)
    return out


def _token_logprobs(lp: pb.TokenLogprob) -> dict[int, Logprob]:
    """vLLM's shape: the chosen token first, then the top alternatives by rank (the chosen one once)."""
    entry = {lp.token_id: Logprob(lp.logprob, lp.rank, lp.token or None)}
    tokens = list(lp.top_tokens) or [None] * len(lp.top_token_ids)
    for rank, (token_id, value, text) in enumerate(zip(lp.top_token_ids, lp.top_logprobs, tokens, strict=True), 1):
        entry[token_id] = Logprob(value, rank, text or None)
    return entry


def _channel_options(max_message_bytes: int) -> list[tuple[str, int]]:
    return [
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", max_message_bytes),
    ]
