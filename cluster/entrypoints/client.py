"""Python clients of the gateway (sync for the CLI, asyncio for benchmarks) and `stream_to_terminal`.

    with GenerationClient("127.0.0.1:50051") as client:
        for item in client.generate("Hello", max_tokens=32, temperature=0):
            if isinstance(item, Chunk):
                print(item.text, end="")

`generate` takes a text prompt or a list of token ids and any SamplingParams field as a keyword
(None means the server's default); it yields a Chunk per engine step and a Final last. Errors are
grpc.RpcError (`.code()`, `.details()` naming the bad field). Leaving the iteration early cancels
the call, which aborts the request on the server.
"""

from __future__ import annotations

import sys
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from contextlib import closing
from dataclasses import dataclass, field
from typing import TextIO

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from deltaserve.protos import generation_pb2 as pb
from deltaserve.protos import generation_pb2_grpc
from deltaserve.workers.plan import TokenLogprobs

DEFAULT_MAX_MESSAGE_BYTES = 4 * 2**20

_FINISH_REASONS = {
    pb.FINISH_REASON_STOP: "stop",
    pb.FINISH_REASON_LENGTH: "length",
    pb.FINISH_REASON_ABORT: "abort",
}


@dataclass
class Chunk:
    """What one engine step added: token ids, the text delta and (when asked) their logprobs."""

    token_ids: list[int]
    text: str
    logprobs: list[TokenLogprobs] = field(default_factory=list)


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
    # when asked: entry i is prompt token i + 1 given the tokens before it
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)


class GenerationClient:
    """A blocking client over one channel; close it (or use it as a context manager) when done."""

    def __init__(self, target: str, *, max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES):
        self.channel = grpc.insecure_channel(target, options=_channel_options(max_message_bytes))
        self._stub = generation_pb2_grpc.GenerationStub(self.channel)
        self._health = health_pb2_grpc.HealthStub(self.channel)

    def generate(
        self,
        prompt: str | Sequence[int],
        *,
        request_id: str = "",
        timeout_s: float | None = None,
        lora_name: str = "",
        **sampling,
    ) -> Iterator[Chunk | Final]:
        """Chunks as they arrive, then the Final; `timeout_s` bounds the whole stream; `lora_name`: a
        loaded adapter to run on."""
        request = generate_request(prompt, request_id, **sampling)
        request.lora_name = lora_name
        call = self._stub.Generate(request, timeout=timeout_s)
        try:
            for response in call:
                yield from_response(response)
        finally:
            call.cancel()  # a no-op once the call has ended; otherwise the server aborts the request

    def tokenize(self, text: str, *, timeout_s: float | None = None) -> list[int]:
        return list(self._stub.Tokenize(pb.TokenizeRequest(text=text), timeout=timeout_s).token_ids)

    def model_info(self, *, timeout_s: float | None = None) -> pb.ModelInfo:
        return self._stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=timeout_s)

    def load_lora_adapter(self, name: str, path: str, *, timeout_s: float | None = None) -> pb.LoraAdapter:
        request = pb.LoadLoraAdapterRequest(lora_name=name, lora_path=path)
        return self._stub.LoadLoraAdapter(request, timeout=timeout_s)

    def unload_lora_adapter(self, name: str, *, timeout_s: float | None = None) -> None:
        self._stub.UnloadLoraAdapter(pb.UnloadLoraAdapterRequest(lora_name=name), timeout=timeout_s)

    def list_lora_adapters(self, *, timeout_s: float | None = None) -> list[pb.LoraAdapter]:
        return list(self._stub.ListLoraAdapters(pb.ListLoraAdaptersRequest(), timeout=timeout_s).adapters)

    def health(self, service: str = "", *, timeout_s: float | None = None) -> str:
        """SERVING or NOT_SERVING (grpc.health.v1); "" is the whole server."""
        response = self._health.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout_s)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> GenerationClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class AsyncGenerationClient:
    """The asyncio twin of GenerationClient (create it inside the event loop that uses it)."""

    def __init__(self, target: str, *, max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES):
        self.channel = grpc.aio.insecure_channel(target, options=_channel_options(max_message_bytes))
        self._stub = generation_pb2_grpc.GenerationStub(self.channel)
        self._health = health_pb2_grpc.HealthStub(self.channel)

    async def generate(
        self,
        prompt: str | Sequence[int],
        *,
        request_id: str = "",
        timeout_s: float | None = None,
        **sampling,
    ) -> AsyncIterator[Chunk | Final]:
        call = self._stub.Generate(generate_request(prompt, request_id, **sampling), timeout=timeout_s)
        try:
            async for response in call:
                yield from_response(response)
        finally:
            call.cancel()

    async def tokenize(self, text: str, *, timeout_s: float | None = None) -> list[int]:
        return list((await self._stub.Tokenize(pb.TokenizeRequest(text=text), timeout=timeout_s)).token_ids)

    async def model_info(self, *, timeout_s: float | None = None) -> pb.ModelInfo:
        return await self._stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=timeout_s)

    async def health(self, service: str = "", *, timeout_s: float | None = None) -> str:
        response = await self._health.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout_s)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)

    async def close(self) -> None:
        await self.channel.close()

    async def __aenter__(self) -> AsyncGenerationClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()


def stream_to_terminal(
    target: str, prompt: str | Sequence[int], *, out: TextIO = sys.stdout, err: TextIO = sys.stderr, **sampling
) -> int:
    """Print the text as it arrives on `out` and a summary line on `err`; returns an exit status
    (0, or 1 after printing the gRPC error)."""
    start = time.perf_counter()
    with GenerationClient(target) as client, closing(client.generate(prompt, **sampling)) as items:
        try:
            for item in items:
                if isinstance(item, Chunk):
                    out.write(item.text)
                    out.flush()
                else:
                    final = item
        except grpc.RpcError as e:
            out.write("\n")
            print(f"error: {e.code().name}: {e.details()}", file=err)
            return 1
    elapsed = time.perf_counter() - start
    out.write("\n")
    out.flush()
    print(summary_line(final, elapsed), file=err)
    return 0


def summary_line(final: Final, elapsed_s: float) -> str:
    reason = final.finish_reason if final.stop_reason is None else f"{final.finish_reason} ({final.stop_reason!r})"
    ttft = "-" if final.time_to_first_token_s is None else f"{final.time_to_first_token_s:.3f} s"
    rate = final.completion_tokens / elapsed_s if elapsed_s > 0 else 0.0
    return (
        f"[{reason}] {final.prompt_tokens} prompt + {final.completion_tokens} completion tokens"
        f" ({final.cached_tokens} cached), first token {ttft}, {elapsed_s:.2f} s, {rate:.1f} tokens/s"
    )


def generate_request(prompt: str | Sequence[int], request_id: str = "", **sampling) -> pb.GenerateRequest:
    """The GenerateRequest for a prompt and SamplingParams keywords (None: the server's default)."""
    sampling = {name: value for name, value in sampling.items() if value is not None}
    if isinstance(sampling.get("stop"), str):
        sampling["stop"] = [sampling["stop"]]
    request = pb.GenerateRequest(request_id=request_id, sampling_params=pb.SamplingParams(**sampling))
    if isinstance(prompt, str):
        request.text = prompt
    else:
        request.token_ids.ids.extend(prompt)
        request.token_ids.SetInParent()  # an empty id list still selects token_ids (and is rejected)
    return request


def from_response(response: pb.GenerateResponse) -> Chunk | Final:
    if response.HasField("chunk"):
        chunk = response.chunk
        return Chunk(list(chunk.token_ids), chunk.text, [_token_logprobs(lp) for lp in chunk.logprobs])
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
    )


def _token_logprobs(lp: pb.TokenLogprob) -> TokenLogprobs:
    return TokenLogprobs(lp.token_id, lp.logprob, lp.rank, list(lp.top_token_ids), list(lp.top_logprobs))


def _channel_options(max_message_bytes: int) -> list[tuple[str, int]]:
    return [
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", max_message_bytes),
    ]
