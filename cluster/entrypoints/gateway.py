"""The gRPC gateway: `deltaserve.v1.Generation` and `grpc.health.v1.Health` in front of an AsyncEngine.

Every field is checked before anything is queued (SamplingParams and AsyncEngine.submit raise a
ValueError naming the field), and engine errors map to gRPC status codes: INVALID_ARGUMENT (also for
bytes that do not parse as the request message), NOT_FOUND (an adapter not loaded), RESOURCE_EXHAUSTED
(queue full, or a message over the size limit), UNAVAILABLE (engine down, or the request failed
mid-stream). Every status message is cut to validation.MAX_ERROR_CHARS characters: gRPC carries it in a
header, and one past the peer's header limit turns the status into RESOURCE_EXHAUSTED "Stream removed".
A Generate handler owns its request's output stream: when the client cancels or disconnects, grpc
cancels the handler, which closes the stream, which aborts the request (its pages and slot free).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import asdict

import grpc
from google.protobuf import json_format
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from deltaserve.cluster.core.request import CompletionOutput, Logprob, RequestOptions, RequestOutput, top_logprobs
from deltaserve.cluster.core.sampling_params import SamplingParams, StructuredOutputsParams, with_defaults
from deltaserve.protos import generation_pb2 as pb
from deltaserve.protos import generation_pb2_grpc

from . import validation
from .async_engine import AsyncEngine, EngineUnavailableError
from .chat_parsing import ChatParser, Parsed, reading, reasoning_tokens
from .grpc_security import ApiKeyInterceptor, server_credentials
from .validation import ErrorKind

log = logging.getLogger(__name__)

DEFAULT_MAX_MESSAGE_BYTES = 4 * 2**20
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Generation"].full_name

_STATUS = {
    ErrorKind.INVALID: grpc.StatusCode.INVALID_ARGUMENT,
    ErrorKind.NOT_FOUND: grpc.StatusCode.NOT_FOUND,
    ErrorKind.QUEUE_FULL: grpc.StatusCode.RESOURCE_EXHAUSTED,
    ErrorKind.UNAVAILABLE: grpc.StatusCode.UNAVAILABLE,
}
_FINISH_REASONS = {
    "stop": pb.FINISH_REASON_STOP,
    "length": pb.FINISH_REASON_LENGTH,
    "abort": pb.FINISH_REASON_ABORT,
}


class Gateway:
    """A grpc.aio server in front of `engine`; the engine's owner starts and shuts it down."""

    def __init__(
        self,
        engine: AsyncEngine,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        health_poll_s: float = 1.0,
        api_key: str | None = None,
        ssl_keyfile: str | None = None,
        ssl_certfile: str | None = None,
    ):
        self.engine = engine
        self.api_key = api_key
        self.ssl_keyfile, self.ssl_certfile = ssl_keyfile, ssl_certfile
        self.host = host
        self.port = port
        self.max_message_bytes = max_message_bytes
        self.health_poll_s = health_poll_s
        self._server: grpc.aio.Server | None = None
        self._health: _EngineHealth | None = None
        self._health_poller: asyncio.Task | None = None

    async def start(self) -> int:
        """Bind and start serving; returns the bound port (useful with port=0)."""
        options = [
            ("grpc.max_receive_message_length", self.max_message_bytes),
            ("grpc.max_send_message_length", self.max_message_bytes),
            ("grpc.so_reuseport", 0),  # a port another server holds is an error, not a shared port
        ]
        interceptors = [ApiKeyInterceptor(self.api_key)] if self.api_key else []
        server = grpc.aio.server(options=options, interceptors=interceptors)
        _add_generation_servicer(_GenerationServicer(self.engine), server)
        self._health = _EngineHealth(self.engine)
        health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
        host = f"[{self.host}]" if ":" in self.host else self.host  # an IPv6 literal
        address = f"{host}:{self.port}"
        if self.ssl_certfile:
            self.port = server.add_secure_port(address, server_credentials(self.ssl_keyfile, self.ssl_certfile))
        else:
            self.port = server.add_insecure_port(address)
        if self.port == 0:
            raise RuntimeError(f"gateway: could not bind {host}:{self.port}")
        await self._health.refresh()
        await server.start()
        self._server = server
        self._health_poller = asyncio.create_task(self._poll_health())
        log.info("gateway serving on %s:%d", self.host, self.port)
        return self.port

    async def stop(self, grace_s: float = 5.0) -> None:
        """Refuse new RPCs, let in-flight ones finish for up to grace_s, then cancel the rest (which
        aborts their requests). Health reports NOT_SERVING from the start."""
        if self._server is None:
            return
        self._health_poller.cancel()
        await self._health.enter_graceful_shutdown()
        await self._server.stop(grace_s)
        self._server = None

    async def _poll_health(self) -> None:
        # Watch subscribers learn of an engine failure without anyone calling Check
        while True:
            await asyncio.sleep(self.health_poll_s)
            await self._health.refresh()


async def run_gateway(
    engine: AsyncEngine,
    host: str = "127.0.0.1",
    port: int = 0,
    *,
    grace_s: float = 5.0,
    on_started: Callable[[int], None] | None = None,
    **gateway_options,
) -> None:
    """Serve until SIGINT / SIGTERM (or until cancelled), then stop gracefully. `on_started` gets the
    bound port. The engine stays up: its owner shuts it down."""
    gateway = Gateway(engine, host=host, port=port, **gateway_options)
    bound = await gateway.start()
    if on_started is not None:
        on_started(bound)
    loop = asyncio.get_running_loop()
    stopping = asyncio.Event()
    signals = (signal.SIGINT, signal.SIGTERM) if threading.current_thread() is threading.main_thread() else ()
    for sig in signals:
        loop.add_signal_handler(sig, stopping.set)
    try:
        await stopping.wait()
    finally:
        for sig in signals:
            loop.remove_signal_handler(sig)
        await gateway.stop(grace_s)


class _EngineHealth(health.aio.HealthServicer):
    """Health of the server ("") and of the Generation service, both following the engine's."""

    def __init__(self, engine: AsyncEngine):
        super().__init__()
        self._engine = engine

    async def refresh(self) -> None:
        healthy = await self._engine.healthy()
        status = health_pb2.HealthCheckResponse.SERVING if healthy else health_pb2.HealthCheckResponse.NOT_SERVING
        for service in ("", SERVICE_NAME):
            await self.set(service, status)

    async def Check(self, request, context):
        await self.refresh()
        return await super().Check(request, context)


class Undecodable:
    """What the request deserializer returns for bytes that are not the method's message (grpc itself
    would answer INTERNAL, a server fault, for the client's bad bytes)."""

    def __init__(self, message: str):
        self.message = message


def _lenient(message_type):
    def parse(data: bytes):
        try:
            return message_type.FromString(data)
        except Exception as e:  # DecodeError, or invalid UTF-8 in a string field
            return Undecodable(f"request: not a valid {message_type.DESCRIPTOR.name} message ({type(e).__name__})")

    return parse


def _add_generation_servicer(servicer: generation_pb2_grpc.GenerationServicer, server: grpc.aio.Server) -> None:
    """generation_pb2_grpc's registration, with request parsers that never raise."""
    methods = pb.DESCRIPTOR.services_by_name["Generation"].methods_by_name
    handlers = {}
    for name, method in methods.items():
        make = grpc.unary_stream_rpc_method_handler if method.server_streaming else grpc.unary_unary_rpc_method_handler
        handlers[name] = make(
            getattr(servicer, name),
            request_deserializer=_lenient(getattr(pb, method.input_type.name)),
            response_serializer=getattr(pb, method.output_type.name).SerializeToString,
        )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
    server.add_registered_method_handlers(SERVICE_NAME, handlers)


async def _abort(context, code: grpc.StatusCode, text: str) -> None:
    await context.abort(code, validation.brief(text))  # its field name, first, is kept


class _GenerationServicer(generation_pb2_grpc.GenerationServicer):
    def __init__(self, engine: AsyncEngine):
        self._engine = engine

    async def Generate(self, request: pb.GenerateRequest, context) -> AsyncIterator[pb.GenerateResponse]:
        if isinstance(request, Undecodable):
            await _abort(context, grpc.StatusCode.INVALID_ARGUMENT, request.message)
        try:
            req_id = validation.request_id(request.request_id)
            params = _sampling_params(request.sampling_params, self._engine.default_sampling)
            options = RequestOptions(request.lora_name or None, request.priority, request.cache_salt or None)
            prompt = _prompt(request, self._engine)
            await self._engine.submit(req_id, prompt, params, options)
        except Exception as e:
            await self._abort_with(context, e)
        k = params.logprobs
        chat = _ChatReading(request, prompt, self._engine) if request.WhichOneof("prompt") == "chat" else None
        try:
            async with contextlib.aclosing(self._engine.stream(req_id)) as outputs:
                ended: set[int] = set()  # completions whose final was sent
                async for out in outputs:
                    if out.completion(out.delta_index).finish_reason == "error":
                        await _abort(context, grpc.StatusCode.UNAVAILABLE, out.error or "the engine failed the request")
                    step = chat.step(out, out.completion(out.delta_index)) if chat is not None else None
                    if out.delta_token_ids or out.delta_text or step:
                        yield pb.GenerateResponse(request_id=req_id, chunk=_chunk(out, k, step))
                    # a completion's final as it ends (n > 1: the request's last output holds them all)
                    for completion in out.outputs if out.finished else [out.completion(out.delta_index)]:
                        if completion.finish_reason is None or completion.index in ended:
                            continue
                        ended.add(completion.index)
                        if chat is not None and completion.index != out.delta_index:  # its text was all sent
                            rest = chat.step(None, completion)
                            if rest:
                                yield pb.GenerateResponse(request_id=req_id, chunk=_chunk(None, k, rest, completion))
                        asked = params.prompt_logprobs if completion.index == 0 else None
                        final = _final(out, completion, asked)
                        if chat is not None:
                            chat.finish(final, completion)
                        yield pb.GenerateResponse(request_id=req_id, final=final)
        except EngineUnavailableError as e:  # the Ray driver died under the stream
            await _abort(context, grpc.StatusCode.UNAVAILABLE, str(e))

    async def Tokenize(self, request: pb.TokenizeRequest, context) -> pb.TokenizeResponse:
        if isinstance(request, Undecodable):
            await _abort(context, grpc.StatusCode.INVALID_ARGUMENT, request.message)
        try:
            return pb.TokenizeResponse(token_ids=await self._engine.tokenize(request.text))
        except Exception as e:
            await self._abort_with(context, e)

    async def GetModelInfo(self, request: pb.GetModelInfoRequest, context) -> pb.ModelInfo:
        if isinstance(request, Undecodable):
            await _abort(context, grpc.StatusCode.INVALID_ARGUMENT, request.message)
        try:
            info = await self._engine.info()
            stats = await self._engine.stats()
        except Exception as e:
            await self._abort_with(context, e)
        return pb.ModelInfo(
            model=info.model,
            model_type=info.model_type,
            family=info.family,
            max_model_len=info.max_model_len,
            vocab_size=info.vocab_size,
            eos_token_ids=info.eos_token_ids,
            parallel=pb.ParallelLayout(
                tensor_parallel_size=info.tensor_parallel_size,
                expert_parallel=info.expert_parallel,
                data_parallel_size=info.data_parallel_size,
            ),
            pool=pb.PoolCapacity(
                kv_tokens=info.kv_tokens,
                kv_pages=info.num_kv_pages,
                block_size=info.block_size,
                max_num_seqs=info.max_num_seqs,
            ),
            dtype=info.dtype,
            device=info.device,
            speculative=None if info.speculative is None else pb.SpeculativeDecoding(**asdict(info.speculative)),
            replicas=[
                pb.Replica(
                    index=r.index,
                    state=r.state,
                    node_id=r.node_id,
                    node_ip=r.node_ip,
                    transport=r.transport,
                    in_flight=r.in_flight,
                    routed=r.routed,
                )
                for r in info.replicas
            ],
            prefix_cache=_prefix_cache_info(stats.get("prefix_cache") or {}),
        )

    async def LoadLoraAdapter(self, request: pb.LoadLoraAdapterRequest, context) -> pb.LoraAdapter:
        if isinstance(request, Undecodable):
            await _abort(context, grpc.StatusCode.INVALID_ARGUMENT, request.message)
        try:
            if not request.lora_name or not request.lora_path:
                raise ValueError("lora_name and lora_path: both are required")
            return _adapter(await self._engine.load_lora(request.lora_name, request.lora_path))
        except Exception as e:
            await self._abort_with(context, e)

    async def UnloadLoraAdapter(self, request: pb.UnloadLoraAdapterRequest, context) -> pb.UnloadLoraAdapterResponse:
        if isinstance(request, Undecodable):
            await _abort(context, grpc.StatusCode.INVALID_ARGUMENT, request.message)
        try:
            await self._engine.unload_lora(request.lora_name)
            return pb.UnloadLoraAdapterResponse()
        except Exception as e:
            await self._abort_with(context, e)

    async def ListLoraAdapters(self, request: pb.ListLoraAdaptersRequest, context) -> pb.ListLoraAdaptersResponse:
        if isinstance(request, Undecodable):
            await _abort(context, grpc.StatusCode.INVALID_ARGUMENT, request.message)
        try:
            return pb.ListLoraAdaptersResponse(adapters=[_adapter(r) for r in await self._engine.list_loras()])
        except Exception as e:
            await self._abort_with(context, e)

    async def _abort_with(self, context, error: Exception) -> None:
        """End the RPC with the status that `error` (raised before anything was queued) calls for."""
        kind = validation.classify(error)
        if kind is not None:
            await _abort(context, _STATUS[kind], str(error))
        if not await self._engine.healthy():  # e.g. the Ray driver actor is gone
            await _abort(context, grpc.StatusCode.UNAVAILABLE, f"the engine is down: {type(error).__name__}: {error}")
        log.error("unexpected error in a request", exc_info=error)  # a server bug: INTERNAL, its cause logged
        await _abort(context, grpc.StatusCode.INTERNAL, f"{type(error).__name__}: {error}")


def _adapter(lora) -> pb.LoraAdapter:
    return pb.LoraAdapter(lora_name=lora.lora_name, lora_int_id=lora.lora_int_id, lora_path=lora.path)


def _prompt(request: pb.GenerateRequest, engine: AsyncEngine) -> str | list[int]:
    kind = request.WhichOneof("prompt")
    if kind is None:
        raise ValueError("prompt: give text, token_ids or chat")
    if kind == "chat":
        return _render_chat(request.chat, engine)
    return request.text if kind == "text" else list(request.token_ids.ids)


def _render_chat(chat: pb.Chat, engine: AsyncEngine) -> str:
    """The chat's prompt text through the model's template (shared with the HTTP server)."""
    messages = []
    for m in chat.messages:
        message = {d.name: v for d, v in m.ListFields() if d.name != "tool_calls"}
        if m.tool_calls:
            message["tool_calls"] = [
                {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                for c in m.tool_calls
            ]
        messages.append(message)
    return engine.render_chat(
        messages,
        add_generation_prompt=chat.add_generation_prompt if chat.HasField("add_generation_prompt") else True,
        continue_final_message=chat.continue_final_message,
        tools=[json_format.MessageToDict(t) for t in chat.tools] or None,
        chat_template_kwargs=json_format.MessageToDict(chat.chat_template_kwargs),
    )


def _sampling_params(message: pb.SamplingParams, defaults: dict) -> SamplingParams:
    """The fields the client set (proto3 presence); the model's `defaults` (generation_config) where it
    set none of theirs, SamplingParams' own for the rest."""
    fields = with_defaults({descriptor.name: value for descriptor, value in message.ListFields()}, defaults)
    for name in ("stop", "stop_token_ids"):
        if name in fields:
            fields[name] = list(fields[name])
    if "logit_bias" in fields:
        fields["logit_bias"] = dict(fields["logit_bias"])
    if "structured_outputs" in fields:
        constraint = {descriptor.name: value for descriptor, value in fields["structured_outputs"].ListFields()}
        if "choice" in constraint:
            constraint["choice"] = list(constraint["choice"])
        fields["structured_outputs"] = StructuredOutputsParams(**constraint)
    return validation.sampling_params(fields)


def _token_logprob(entry: dict[int, Logprob], k: int) -> pb.TokenLogprob:
    """One position of vLLM-shaped logprobs (the chosen token first, then the top k)."""
    token_id, chosen = next(iter(entry.items()))
    top = top_logprobs(entry, k)
    return pb.TokenLogprob(
        token_id=token_id,
        logprob=chosen.logprob,
        rank=chosen.rank,
        token=chosen.decoded_token or "",
        top_token_ids=[t for t, _ in top],
        top_logprobs=[lp.logprob for _, lp in top],
        top_tokens=[lp.decoded_token or "" for _, lp in top],
    )


class _ChatReading:
    """A chat prompt's completions read as the HTTP server reads them (chat_parsing.ChatParser under
    the server's --reasoning-parser / --tool-call-parser): what each step adds to the answer, the
    reasoning and the tool calls, and how each completion ended."""

    def __init__(self, request: pb.GenerateRequest, prompt: str, engine: AsyncEngine):
        serving = engine.config.serving
        tools = [json_format.MessageToDict(t) for t in request.chat.tools]
        self.settings = reading(serving.reasoning_parser, serving.tool_call_parser, prompt, tools)
        self.engine = engine
        self.parsers: dict[int, ChatParser] = {}

    def step(self, out: RequestOutput | None, completion: CompletionOutput) -> Parsed | None:
        """What completion's step adds (out: its output; None: only its end); None when nothing."""
        parser = self.parsers.setdefault(completion.index, ChatParser(**self.settings))
        step = parser.feed(out.delta_text if out is not None else "")
        if completion.finish_reason is not None:
            step += parser.finish()
        return step if step.content or step.reasoning or step.tool_calls else None

    def finish(self, final: pb.GenerateFinal, completion: CompletionOutput) -> None:
        parser = self.parsers.get(completion.index)
        final.tool_calls = completion.finish_reason == "stop" and parser is not None and parser.ends_in_calls
        if self.settings["reasoning"]:
            start = self.settings["in_reasoning"]
            final.usage.reasoning_tokens = reasoning_tokens(list(completion.token_ids), self.engine.decode, start)


def _chunk(
    out: RequestOutput | None, k: int | None, step: Parsed | None = None, ended: CompletionOutput | None = None
) -> pb.GenerateChunk:
    """A step's chunk (out: its output; None: only a chat completion's end, `ended`)."""
    if out is None:
        chunk = pb.GenerateChunk(index=ended.index)
    else:
        chunk = pb.GenerateChunk(token_ids=out.delta_token_ids, text=out.delta_text, index=out.delta_index)
        if k is not None:
            chunk.logprobs.extend(_token_logprob(entry, k) for entry in out.delta_logprobs)
    if step is not None:
        chunk.content, chunk.reasoning = step.content, step.reasoning
        chunk.tool_calls.extend(
            pb.ToolCallDelta(index=d.index, id=d.id or "", name=d.name or "", arguments=d.arguments)
            for d in step.tool_calls
        )
    return chunk


def _final(out: RequestOutput, completion: CompletionOutput, k: int | None) -> pb.GenerateFinal:
    """The end of one completion; k: the prompt logprobs asked for (None: none sent)."""
    final = pb.GenerateFinal(
        index=completion.index,
        finish_reason=_FINISH_REASONS[completion.finish_reason],
        usage=pb.Usage(
            prompt_tokens=len(out.prompt_token_ids),
            completion_tokens=len(completion.token_ids),
            cached_tokens=out.num_cached_tokens,
        ),
    )
    if isinstance(completion.stop_reason, int):
        final.stop_token_id = completion.stop_reason
    elif isinstance(completion.stop_reason, str):
        final.stop_string = completion.stop_reason
    if out.time_to_first_token_s is not None:
        final.time_to_first_token_s = out.time_to_first_token_s
    if out.prompt_logprobs is not None and k is not None:  # entry 0 is None: the first token has no logprob
        final.prompt_logprobs.extend(_token_logprob(entry, k) for entry in out.prompt_logprobs[1:])
    return final


_PREFIX_CACHE_COUNTS = (
    "blocks_cached", "snapshots_held", "snapshot_slots", "queries", "hits", "query_tokens", "hit_tokens",
    "snapshots_taken", "snapshots_evicted",
)  # fmt: skip


def _prefix_cache_info(stats: dict) -> pb.PrefixCache:
    """The replicas' prefix-cache counts (added up by AsyncEngine.stats) as GetModelInfo reports them;
    the hit rate from the totals."""
    counts = {k: int(stats.get(k, 0)) for k in _PREFIX_CACHE_COUNTS}
    rate = counts["hit_tokens"] / counts["query_tokens"] if counts["query_tokens"] else 0.0
    return pb.PrefixCache(enabled=bool(stats.get("enabled", False)), hit_rate=rate, **counts)
