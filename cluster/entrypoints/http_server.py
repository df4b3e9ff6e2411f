"""The OpenAI-compatible HTTP server (FastAPI on uvicorn) in front of an AsyncEngine.

Routes: POST /v1/completions, POST /v1/chat/completions (streamed as server-sent events or whole),
GET /v1/models, POST /tokenize, POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's),
GET /health, GET /metrics (Prometheus). Errors are OpenAI's
error object: 400 naming the field (malformed JSON, a wrong type, an unknown field, a value
SamplingParams or the engine refuses), 401 without the API key, 404 for an unknown model, 429 when
the waiting queue is full, 503 while the engine is down. A client that disconnects aborts its request
(its pages and state slot free on the next engine step), streamed or not. `--api-key` guards the
/v1 routes and /tokenize (health and metrics stay open, as vLLM's do). `model` names the served model
or a loaded LoRA adapter (as vLLM: /v1/models lists both); `response_format` (OpenAI's) or
`structured_outputs` (vLLM's) constrain the output.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hmac
import logging
import re
import socket
from collections.abc import AsyncIterator

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel

from deltaserve import __version__
from deltaserve.cluster.core.request import RequestOptions
from deltaserve.cluster.core.sampling_params import SamplingParams, StructuredOutputsParams, with_defaults
from deltaserve.workers.config import short

from . import openai_protocol as api
from . import openai_responses as responses
from . import validation
from .async_engine import AdapterNotFoundError, AsyncEngine
from .chat_parsing import REASONING_END, THINK_CLOSE, ForcedTools, forced_tools, opens_reasoning, reading
from .front_doors import Cors
from .metrics import CONTENT_TYPE
from .openai_serving import Job, RequestFailedError, collect, merged, response_events, stream_events
from .validation import ErrorKind, ModelNotFoundError

log = logging.getLogger(__name__)

MAX_PROMPTS = 256  # prompts of one /v1/completions request

_UNION_TAG = re.compile(r"^(str|int|float|bool|none|list|dict|[A-Z]\w*)$|\[")
_STATUS = {ErrorKind.INVALID: 400, ErrorKind.NOT_FOUND: 404, ErrorKind.QUEUE_FULL: 429, ErrorKind.UNAVAILABLE: 503}
_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "invalid_request_error",
    429: "rate_limit_exceeded",
    500: "server_error",
    503: "service_unavailable",
}


def error_response(status: int, message: str, param: str | None = None, code: str | None = None) -> JSONResponse:
    body = api.ErrorResponse(
        error=api.ErrorInfo(message=validation.brief(message), type=_TYPES[status], param=param, code=code)
    )
    return JSONResponse(body.model_dump(), status_code=status)


async def response_for(engine: AsyncEngine, error: BaseException) -> JSONResponse:
    """The error response for what went wrong before (or while) a request was answered."""
    kind = validation.classify(error)
    if kind is not None:
        message = str(error)
        code = "model_not_found" if kind is ErrorKind.NOT_FOUND else None
        return error_response(_STATUS[kind], message, validation.field_of(message), code)
    if isinstance(error, RequestFailedError) or not await engine.healthy():
        return error_response(503, f"the engine failed the request: {error}")
    log.exception("request failed", exc_info=error)
    return error_response(500, f"internal error: {type(error).__name__}")


def _validation_message(error: RequestValidationError) -> tuple[str, str | None]:
    """The first pydantic error as "field: what is wrong" (the offending value is never echoed)."""
    first = error.errors()[0]
    loc = [part for part in first.get("loc", ()) if part != "body"]
    if first.get("type") == "json_invalid":
        return f"body: malformed JSON ({first.get('ctx', {}).get('error', 'cannot parse')})", "body"
    field = ""
    for part in loc:
        if isinstance(part, str) and _UNION_TAG.search(part):
            break  # pydantic names the union member it tried ("str", "list[int]", ...): not a field
        field += f"[{part}]" if isinstance(part, int) else (f".{part}" if field else str(part))
    field = field or "body"
    why = "unknown field" if first.get("type") == "extra_forbidden" else first.get("msg", "invalid")
    return f"{field}: {why}", field


def build_app(engine: AsyncEngine, *, api_key: str | None = None, metrics_only: bool = False) -> FastAPI:
    app = FastAPI(title="deltaserve", docs_url=None, redoc_url=None, openapi_url=None)
    stored = responses.ResponseStore()  # the Responses API's, for previous_response_id
    runs = app.state.background_runs = responses.BackgroundRuns()  # cancelled when the server stops

    @app.exception_handler(RequestValidationError)
    async def invalid_body(request: Request, error: RequestValidationError) -> JSONResponse:
        message, field = _validation_message(error)
        return error_response(400, message, field)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(await engine.render_metrics(), media_type=CONTENT_TYPE)

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200 if await engine.healthy() else 503)

    if metrics_only:
        return app

    if api_key:

        @app.middleware("http")
        async def authenticate(request: Request, call_next):
            path = request.url.path
            if path.startswith("/v1") or path == "/tokenize":
                given = request.headers.get("authorization", "")
                if not hmac.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
                    return error_response(401, "authorization: a valid 'Bearer <api key>' header is required")
            return await call_next(request)

    @app.get("/v1/models")
    async def models() -> api.ModelList:
        info = await engine.info()
        card = api.ModelCard(
            id=engine.model_name,
            created=api.now(),
            root=info.model,
            max_model_len=info.max_model_len,
            vocab_size=info.vocab_size,
        )
        adapters = [
            api.ModelCard(
                id=lora.lora_name,
                created=api.now(),
                root=lora.path,
                parent=engine.model_name,
                max_model_len=info.max_model_len,
                vocab_size=info.vocab_size,
            )
            for lora in await engine.list_loras()
        ]
        return api.ModelList(data=[card, *adapters])

    @app.post("/tokenize")
    async def tokenize(body: api.TokenizeRequest):
        try:
            await _adapter_for(engine, body.model)
            if (body.prompt is None) == (body.messages is None):
                raise ValueError("prompt: give either prompt or messages")
            text = body.prompt
            if body.messages is not None:
                text = engine.render_chat(
                    [m.for_template() for m in body.messages],
                    add_generation_prompt=body.add_generation_prompt,
                    continue_final_message=body.continue_final_message,
                    tools=body.tools,
                    chat_template_kwargs=body.chat_template_kwargs,
                )
            tokens = await engine.tokenize(text) if text else []
            info = await engine.info()
        except Exception as e:
            return await response_for(engine, e)
        answer = {"count": len(tokens), "max_model_len": info.max_model_len, "tokens": tokens}
        if body.return_token_strs:
            answer["token_strs"] = engine.token_texts(tokens)
        return answer

    @app.post("/detokenize")
    async def detokenize(body: api.DetokenizeRequest):
        try:
            await _adapter_for(engine, body.model)
            info = await engine.info()
            bad = next((t for t in body.tokens if not 0 <= t < info.vocab_size), None)
            if bad is not None:
                raise ValueError(f"tokens: token id {short(bad)} is outside the vocabulary [0, {info.vocab_size})")
        except Exception as e:
            return await response_for(engine, e)
        return {"prompt": engine.decode(body.tokens)}

    @app.get("/version")
    async def version():
        return {"version": __version__}

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(body: api.LoadLoraAdapterRequest):
        try:
            if not body.lora_name or not body.lora_path:
                raise ValueError("lora_name and lora_path: both are required")
            await engine.load_lora(body.lora_name, body.lora_path)
        except Exception as e:
            return await response_for(engine, e)
        return Response(f"Success: LoRA adapter '{short(body.lora_name, 80)}' added successfully.")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(body: api.UnloadLoraAdapterRequest):
        try:
            await engine.unload_lora(body.lora_name)
        except Exception as e:
            return await response_for(engine, e)
        return Response(f"Success: LoRA adapter '{short(body.lora_name, 80)}' removed successfully.")

    @app.post("/v1/completions")
    async def completions(body: api.CompletionRequest, request: Request):
        jobs: list[Job] = []
        try:
            prompts = _prompt_list(body)
            fields = with_defaults(body.sampling_fields(body.max_tokens, body.logprobs), engine.default_sampling)
            if body.echo and body.logprobs is not None:  # the echoed prompt's logprobs too
                fields["prompt_logprobs"] = body.logprobs
            params = validation.sampling_params(fields)
            lora = await _adapter_for(engine, body.model)
            job = dataclasses.replace(_job(engine, body, "cmpl", chat=False, logprobs=body.logprobs), echo=body.echo)
            for i, prompt in enumerate(prompts):
                one = job
                if len(prompts) > 1:  # a request of its own under the response's id, its choices from i * n
                    one = dataclasses.replace(
                        job, req_id=f"{job.req_id}-{i}", parent_id=job.req_id, index_base=i * job.n
                    )
                await _submit(one, prompt, params, lora, body, _renames(body))
                jobs.append(one)
        except Exception as e:
            for queued in jobs:  # a later prompt was refused: the earlier ones go too
                await engine.discard(queued.req_id)
            return await response_for(engine, e)
        if body.stream:
            return _EngineStream(jobs)
        if len(jobs) > 1:
            return await _answer_all(jobs, job.req_id, request)
        return await _answer(job, False, request)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: api.ChatCompletionRequest, request: Request):
        try:
            job, prompt, params, lora, renames = await _chat_job(engine, body, "chatcmpl")
            await _submit(job, prompt, params, lora, body, renames)
        except Exception as e:
            return await response_for(engine, e)
        return await _answer(job, body.stream, request)

    @app.post("/v1/responses")
    async def create_response(body: responses.ResponsesRequest, request: Request):
        try:
            if body.background and not body.store:
                raise ValueError("background: a background response must be stored (store: true)")
            chat, messages = responses.to_chat(body, stored)
            job, prompt, params, lora, renames = await _chat_job(engine, chat, "resp_")
            await _submit(job, prompt, params, lora, chat, renames)
        except Exception as e:
            return await response_for(engine, _renamed(e, responses.RENAMES))
        shell = responses.shell(body, job.req_id, job.model)
        in_reasoning = opens_reasoning(prompt)
        parsed = bool((job.parsing or {}).get("reasoning"))

        def keep(done: responses.Response) -> None:
            if body.store:
                stored.put(done, messages + responses.output_messages(done.output))

        def shape(chat_answer: api.ChatCompletionResponse) -> responses.Response:
            done = responses.response_of(shell, chat_answer, engine.decode, in_reasoning, parsed)
            keep(done)
            return done

        if body.background:
            queued = shell.model_copy(update={"status": "queued"})
            stored.put(queued, messages)
            running = shell.model_copy(update={"status": "in_progress"})
            events = responses.ResponseEvents(running, engine.decode, in_reasoning, parsed) if body.stream else None

            async def work(run: responses.BackgroundRun) -> None:
                stored.put(running, messages)
                try:
                    if events is None:
                        await _collect(job, shape)
                    else:
                        async with contextlib.aclosing(response_events(job, events, keep)) as stream:
                            async for event in stream:
                                await run.add(event)
                        now = stored.get(job.req_id)
                        if now is not None and now[0].status == "in_progress":  # it streamed response.failed
                            raise RequestFailedError("the engine failed the request")
                except asyncio.CancelledError:
                    output = [] if events is None else events.output
                    stored.put(running.model_copy(update={"status": "cancelled", "output": output}), messages)
                    raise
                except Exception as e:
                    error = {"code": "server_error", "message": str(e)[:512]}
                    stored.put(running.model_copy(update={"status": "failed", "error": error}), messages)
                finally:
                    await engine.discard(job.req_id)

            run = runs.start(job.req_id, work, streamed=body.stream)
            if body.stream:
                return StreamingResponse(run.follow(), media_type="text/event-stream")
            return queued

        if body.stream:
            events = responses.ResponseEvents(shell, engine.decode, in_reasoning, parsed)
            return _EngineStream([job], response_events(job, events, keep))
        return await _answer(job, False, request, shape)

    @app.get("/v1/responses/{response_id}")
    async def get_response(response_id: str, stream: bool = False, starting_after: int | None = None):
        item = stored.get(response_id)
        if item is None:
            return error_response(404, f"response_id: no stored response {short(response_id, 80)}", "response_id")
        if stream:
            run = runs.get(response_id)
            if run is None or not run.streamed:
                return error_response(
                    400, "stream: only a background response created with stream can be streamed again", "stream"
                )
            return StreamingResponse(run.follow(-1 if starting_after is None else starting_after),
                                     media_type="text/event-stream")  # fmt: skip
        return item[0]

    @app.post("/v1/responses/{response_id}/cancel")
    async def cancel_response(response_id: str):
        item = stored.get(response_id)
        if item is None:
            return error_response(404, f"response_id: no stored response {short(response_id, 80)}", "response_id")
        if not item[0].background:
            return error_response(400, "response_id: only a background response can be cancelled", "response_id")
        await runs.cancel(response_id)
        item = stored.get(response_id)
        return item[0] if item is not None else error_response(404, "response_id: deleted", "response_id")

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str):
        await runs.cancel(response_id)
        if not stored.delete(response_id):
            return error_response(404, f"response_id: no stored response {short(response_id, 80)}", "response_id")
        return {"id": response_id, "object": "response.deleted", "deleted": True}

    return app


async def _chat_job(
    engine: AsyncEngine, body: api.ChatCompletionRequest, prefix: str
) -> tuple[Job, str, SamplingParams, str | None, dict[str, str]]:
    """A chat completion request as a job to submit: the job, its rendered prompt, its sampling
    parameters, its adapter and the renames that make an engine error name the request's field."""
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    k = (body.top_logprobs or 0) if body.logprobs else None
    fields = with_defaults(body.sampling_fields(max_tokens, k), engine.default_sampling)
    forced = _force_calls(body, fields)
    params = validation.sampling_params(fields)
    lora = await _adapter_for(engine, body.model)
    job = _job(engine, body, prefix, chat=True, logprobs=k)
    prompt = engine.render_chat(
        [m.for_template() for m in body.messages],
        add_generation_prompt=body.add_generation_prompt,
        continue_final_message=body.continue_final_message,
        tools=body.tools if body.tool_choice != "none" else None,
        chat_template_kwargs=body.chat_template_kwargs,
    )
    if forced is not None and opens_reasoning(prompt):  # forced calls come first: thinking off
        prompt += f"\n{THINK_CLOSE}\n\n"
    params = _after_reasoning(engine, params, prompt)
    job.parsing = _parsing(engine, body, prompt, forced)
    # the rendered prompt is the messages' doing
    renames = {"prompt": "messages", "prompt_token_ids": "messages"} | _renames(body)
    if forced is not None:  # the constraint is the tools' doing
        renames |= {"structured_outputs.json": "tools", "structured_outputs": "tools"}
    return job, prompt, params, lora, renames


def _renamed(error: BaseException, renames: dict[str, str]) -> BaseException:
    """A ValueError naming a field of the request the route built, reworded to name the client's own
    (a message of the chat is named by the whole `input`)."""
    if not isinstance(error, ValueError) or isinstance(error, ModelNotFoundError):
        return error
    message = str(error)
    field = validation.field_of(message)
    if field is None:
        return error
    for ours, theirs in renames.items():
        if field == ours or field.startswith((ours + ".", ours + "[")):
            renamed = theirs if ours == "messages" else theirs + field[len(ours) :]
            return ValueError(renamed + message[len(field) :])
    return error


def _after_reasoning(engine: AsyncEngine, params: SamplingParams, prompt: str) -> SamplingParams:
    """Under --reasoning-parser, a constrained chat that opens with its reasoning thinks freely first:
    the constraint holds the answer after the reasoning block (as vLLM's reasoning-aware structured
    outputs), unless it spells out the block's end itself (it constrains the reasoning too)."""
    constraint = params.structured_outputs
    if constraint is None or engine.config.serving.reasoning_parser is None or not opens_reasoning(prompt):
        return params
    if THINK_CLOSE in constraint.to_grammar_spec().text:
        return params
    return dataclasses.replace(params, structured_outputs=dataclasses.replace(constraint, reasoning_end=REASONING_END))


def _force_calls(body: api.ChatCompletionRequest, fields: dict) -> ForcedTools | None:
    """A tool_choice that forces calls holds the output to their JSON (a structured-output constraint
    in `fields`); errors name tool_choice or tools."""
    choice = body.tool_choice.model_dump() if isinstance(body.tool_choice, BaseModel) else body.tool_choice
    forced = forced_tools(choice, body.tools, body.parallel_tool_calls)
    if forced is None:
        return None
    if "structured_outputs" in fields:
        raise ValueError("tool_choice: a forced call cannot be combined with response_format or structured_outputs")
    try:
        fields["structured_outputs"] = StructuredOutputsParams(json=forced.schema, disable_any_whitespace=True)
    except ValueError as e:
        raise ValueError(f"tools: a function's parameters are not a usable JSON schema ({e})") from None
    return forced


def _parsing(engine: AsyncEngine, body: api.ChatCompletionRequest, prompt: str, forced: ForcedTools | None) -> dict:
    """How the chat's completions are read (--reasoning-parser; --tool-call-parser when tools are offered;
    a forced tool_choice's JSON as its calls)."""
    if forced is not None:
        return dict(forced=forced)
    serving = engine.config.serving
    tools = body.tools if body.tool_choice != "none" else None
    return reading(serving.reasoning_parser, serving.tool_call_parser, prompt, tools)


async def _adapter_for(engine: AsyncEngine, model: str | None) -> str | None:
    """The LoRA adapter `model` names (None: the base model); ModelNotFoundError for anything else."""
    if model is None or model == engine.model_name:
        return None
    if await engine.lora_request(model) is None:
        raise ModelNotFoundError(
            f"model: {validation.brief(model, 100)!r} is not served here (try {engine.model_name!r})"
        )
    return model


def _renames(body: api.SamplingFields) -> dict[str, str]:
    """Engine field names -> the request's, where the request spelled the setting its own way."""
    if not body.response_format or body.response_format.get("type") == "text":  # checked by sampling_fields
        return {}
    return {"structured_outputs.json": "response_format.json_schema.schema", "structured_outputs": "response_format"}


async def _submit(
    job: Job,
    prompt: str | list[int],
    params: SamplingParams,
    lora: str | None,
    body: api.SamplingFields,
    renames: dict[str, str],
) -> None:
    """Queue the job's request (its adapter, priority and cache salt from the body); an error names the
    field as this request spelled it."""
    try:
        await job.engine.submit(job.req_id, prompt, params, RequestOptions(lora, body.priority, body.cache_salt))
    except AdapterNotFoundError:  # unloaded since the lookup
        raise ModelNotFoundError(f"model: {validation.brief(lora, 100)!r} is no longer loaded") from None
    except ValueError as e:
        field = validation.field_of(str(e))
        if field in renames:
            raise ValueError(renames[field] + str(e)[len(field) :]) from None
        raise


def _prompt_list(body: api.CompletionRequest) -> list[str | list[int]]:
    """The request's prompts: one, or a list (answered whole, choices in prompt order, as OpenAI)."""
    if body.suffix is not None:
        raise ValueError("suffix: not supported")
    if body.best_of not in (None, 1):
        raise ValueError("best_of: must be 1")
    prompt = body.prompt
    if not (isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list)):
        return [prompt]
    if len(prompt) > MAX_PROMPTS:
        raise ValueError(f"prompt: at most {MAX_PROMPTS} prompts a request, got {len(prompt)}")
    return list(prompt)


def _job(engine: AsyncEngine, body: api.SamplingFields, prefix: str, *, chat: bool, logprobs: int | None) -> Job:
    options = body.stream_options
    if options is not None and not body.stream:
        raise ValueError("stream_options: only with stream=true")
    req_id = validation.request_id(body.request_id) if body.request_id else api.new_id(prefix)
    return Job(
        engine,
        req_id,
        body.model or engine.model_name,  # the adapter's name when it names one
        chat,
        logprobs,
        return_token_ids=body.return_token_ids,
        include_usage=bool(options and options.include_usage),
        continuous_usage=bool(options and options.include_usage and options.continuous_usage_stats),
        n=body.n,
    )


class _EngineStream(StreamingResponse):
    """Server-sent events of queued requests (a list of prompts': one each; `events`: another form
    of them than stream_events'); however the response ends (even before its first byte), none is
    left running."""

    def __init__(self, jobs: list[Job], events: AsyncIterator[str] | None = None):
        super().__init__(events if events is not None else stream_events(jobs), media_type="text/event-stream")
        self.jobs = jobs

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()  # a stream cut off mid-way closes (and aborts) now, not at GC
            for job in self.jobs:
                await job.engine.discard(job.req_id)


async def _answer(job: Job, stream: bool, request: Request, shape=None):
    """The job's answer: streamed, or whole (`shape` turns the collected response into another)."""
    if stream:
        return _EngineStream([job])
    task = asyncio.ensure_future(_collect(job, shape))
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
        if not task.done():  # the client left: cancelling the collection aborts the request
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
            return Response(status_code=499)
        try:
            return task.result()
        except Exception as e:
            return await response_for(job.engine, e)
    finally:
        gone.cancel()
        await job.engine.discard(job.req_id)


async def _collect(job: Job, shape=None):
    whole = await collect(job)
    return whole if shape is None else shape(whole)


async def _answer_all(jobs: list[Job], req_id: str, request: Request):
    """A list of prompts' answers as one response; a client that leaves aborts them all."""
    task = asyncio.ensure_future(asyncio.gather(*(collect(job) for job in jobs)))
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
        if not task.done():
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
            return Response(status_code=499)
        try:
            return merged(task.result(), req_id, jobs[0].n)
        except Exception as e:
            return await response_for(jobs[0].engine, e)
    finally:
        gone.cancel()
        for job in jobs:
            await job.engine.discard(job.req_id)


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


class HttpServer:
    """uvicorn serving `build_app(engine)` on the engine's event loop; the engine's owner starts and
    stops it (and handles signals)."""

    def __init__(
        self,
        engine: AsyncEngine,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        api_key: str | None = None,
        ssl_keyfile: str | None = None,
        ssl_certfile: str | None = None,
        metrics_only: bool = False,
        grace_s: float = 5.0,
        cors: Cors | None = None,
    ):
        self.engine = engine
        self.host, self.port = host, port
        app = self.app = build_app(engine, api_key=api_key, metrics_only=metrics_only)
        if cors is not None and cors.allowed_origins:  # outermost: a preflight is answered before the key is asked
            app.add_middleware(
                CORSMiddleware,
                allow_origins=list(cors.allowed_origins),
                allow_methods=list(cors.allowed_methods),
                allow_headers=list(cors.allowed_headers),
                allow_credentials=cors.allow_credentials,
            )
        config = uvicorn.Config(
            app,
            log_level="warning",
            access_log=False,
            lifespan="off",
            ssl_keyfile=ssl_keyfile,
            ssl_certfile=ssl_certfile,
            timeout_graceful_shutdown=grace_s,
        )
        self._server = _QuietSignals(config)
        self._task: asyncio.Task | None = None

    @property
    def scheme(self) -> str:
        return "https" if self._server.config.ssl_certfile else "http"

    async def start(self) -> int:
        """Bind and serve; returns the bound port (useful with port=0)."""
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((self.host, self.port))
        except OSError as e:
            sock.close()
            raise RuntimeError(f"http: could not bind {self.host}:{self.port}: {e.strerror}") from None
        self.port = sock.getsockname()[1]
        self._task = asyncio.create_task(self._server.serve(sockets=[sock]))
        while not self._server.started:
            if self._task.done():
                self._task.result()  # raises what stopped it
                raise RuntimeError("http: the server stopped while starting")
            await asyncio.sleep(0.01)
        log.info("HTTP serving on %s:%d", self.host, self.port)
        return self.port

    async def stop(self) -> None:
        """Stop accepting, let responses in flight finish within the grace time, then cancel them
        (which aborts their requests)."""
        if self._task is None:
            return
        self._server.should_exit = True
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        self._task = None
        runs = getattr(self.app.state, "background_runs", None)
        if runs is not None:  # background responses outlive their connections, not the server
            await runs.cancel_all()


class _QuietSignals(uvicorn.Server):
    """The serve command owns SIGINT / SIGTERM (it stops every front door, then the engine)."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield
