"""The gRPC gateway: `deltaserve.v1.Generation` and `grpc.health.v1.Health` in front of an AsyncEngine.

Every field is checked before anything is queued (SamplingParams and AsyncEngine.submit raise a
ValueError naming the field), and engine errors map to gRPC status codes: INVALID_ARGUMENT (also for
bytes that do not parse as the request message), NOT_FOUND (an adapter not loaded), RESOURCE_EXHAUSTED
(queue full, or a message over the size limit), UNAVAILABLE (engine down, or the request failed
mid-stream). Every status message is cut to MAX_STATUS_MESSAGE characters: gRPC carries it in a
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
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import asdict

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from deltaserve.cluster.core.request import RequestOutput
from deltaserve.cluster.core.sampling_params import SamplingParams, StructuredOutputsParams
from deltaserve.protos import generation_pb2 as pb
from deltaserve.protos import generation_pb2_grpc
from deltaserve.workers.plan import TokenLogprobs

from .async_engine import AdapterNotFoundError, AsyncEngine, EngineUnavailableError, QueueFullError

log = logging.getLogger(__name__)

DEFAULT_MAX_MESSAGE_BYTES = 4 * 2**20
MAX_REQUEST_ID_LEN = 256
MAX_STATUS_MESSAGE = 512
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Generation"].full_name

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
    ):
        self.engine = engine
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
        server = grpc.aio.server(options=options)
        _add_generation_servicer(_GenerationServicer(self.engine), server)
        self._health = _EngineHealth(self.engine)
        health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
        host = f"[{self.host}]" if ":" in self.host else self.host  # an IPv6 literal
        self.port = server.add_insecure_port(f"{host}:{self.port}")
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


def status_message(text: str) -> str:
    """`text` cut to MAX_STATUS_MESSAGE characters (its field name, first, is kept)."""
    return text if len(text) <= MAX_STATUS_MESSAGE else text[: MAX_STATUS_MESSAGE - 3] + "..."


async def _abort(context, code: grpc.StatusCode, text: str) -> None:
    await context.abort(code, status_message(text))


class _GenerationServicer(generation_pb2_grpc.GenerationServicer):
    def __init__(self, engine: AsyncEngine):
        self._engine = engine

    async def Generate(self, request: pb.GenerateRequest, context) -> AsyncIterator[pb.GenerateResponse]:
        if isinstance(request, Undecodable):
            await _abort(context, grpc.StatusCode.INVALID_ARGUMENT, request.message)
        req_id = request.request_id or uuid.uuid4().hex
        try:
            if len(req_id) > MAX_REQUEST_ID_LEN:
                raise ValueError(f"request_id: at most {MAX_REQUEST_ID_LEN} characters, got {len(req_id)}")
            await self._engine.submit(
                req_id, _prompt(request), _sampling_params(request.sampling_params), request.lora_name or None
            )
        except Exception as e:
            await self._abort_with(context, e)
        try:
            async with contextlib.aclosing(self._engine.stream(req_id)) as outputs:
                async for out in outputs:
                    completion = out.outputs[0]
                    if completion.finish_reason == "error":
                        await _abort(context, grpc.StatusCode.UNAVAILABLE, out.error or "the engine failed the request")
                    if out.delta_token_ids or out.delta_text:
                        yield pb.GenerateResponse(request_id=req_id, chunk=_chunk(out))
                    if out.finished:
                        yield pb.GenerateResponse(request_id=req_id, final=_final(out))
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
        if isinstance(error, AdapterNotFoundError):
            await _abort(context, grpc.StatusCode.NOT_FOUND, str(error))
        if isinstance(error, ValueError):
            await _abort(context, grpc.StatusCode.INVALID_ARGUMENT, str(error))
        if isinstance(error, QueueFullError):
            await _abort(context, grpc.StatusCode.RESOURCE_EXHAUSTED, str(error))
        if isinstance(error, EngineUnavailableError):
            await _abort(context, grpc.StatusCode.UNAVAILABLE, str(error))
        if not await self._engine.healthy():  # e.g. the Ray driver actor is gone
            await _abort(context, grpc.StatusCode.UNAVAILABLE, f"the engine is down: {type(error).__name__}: {error}")
        log.error("unexpected error in a request", exc_info=error)  # a server bug: INTERNAL, its cause logged
        await _abort(context, grpc.StatusCode.INTERNAL, f"{type(error).__name__}: {error}")


def _adapter(lora) -> pb.LoraAdapter:
    return pb.LoraAdapter(lora_name=lora.lora_name, lora_int_id=lora.lora_int_id, lora_path=lora.path)


def _prompt(request: pb.GenerateRequest) -> str | list[int]:
    kind = request.WhichOneof("prompt")
    if kind is None:
        raise ValueError("prompt: give text or token_ids")
    return request.text if kind == "text" else list(request.token_ids.ids)


def _sampling_params(message: pb.SamplingParams) -> SamplingParams:
    """The fields the client set (proto3 presence); the rest keep SamplingParams' defaults."""
    fields = {descriptor.name: value for descriptor, value in message.ListFields()}
    for name in ("stop", "stop_token_ids"):
        if name in fields:
            fields[name] = list(fields[name])
    if "structured_outputs" in fields:
        constraint = {descriptor.name: value for descriptor, value in fields["structured_outputs"].ListFields()}
        if "choice" in constraint:
            constraint["choice"] = list(constraint["choice"])
        fields["structured_outputs"] = StructuredOutputsParams(**constraint)
    return SamplingParams(**fields)


def _token_logprob(lp: TokenLogprobs) -> pb.TokenLogprob:
    return pb.TokenLogprob(
        token_id=lp.token_id,
        logprob=lp.logprob,
        rank=lp.rank,
        top_token_ids=lp.top_ids,
        top_logprobs=lp.top_logprobs,
    )


def _chunk(out: RequestOutput) -> pb.GenerateChunk:
    chunk = pb.GenerateChunk(token_ids=out.delta_token_ids, text=out.delta_text)
    chunk.logprobs.extend(_token_logprob(lp) for lp in out.delta_logprobs)
    return chunk


def _final(out: RequestOutput) -> pb.GenerateFinal:
    completion = out.outputs[0]
    final = pb.GenerateFinal(
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
    if out.prompt_logprobs is not None:  # entry 0 is None: the first prompt token has no logprob
        final.prompt_logprobs.extend(_token_logprob(lp) for lp in out.prompt_logprobs[1:])
    return final
