"""Engine outputs as OpenAI response bodies: completions and chat completions, whole or as server-sent
event chunks, with usage and logprobs in OpenAI's shapes (from vLLM-shaped RequestOutputs)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass

from deltaserve.cluster.core.request import CompletionOutput, Logprob, RequestOutput, top_logprobs

from . import openai_protocol as api
from .async_engine import AsyncEngine, EngineUnavailableError
from .chat_parsing import ChatParser, Parsed, merge_calls, reasoning_tokens
from .openai_responses import ResponseEvents

# JSON has no -inf: a token the sampler ruled out gets vLLM's floor
LOGPROB_FLOOR = -9999.0


class RequestFailedError(RuntimeError):
    """The engine failed the request after it was queued (a worker died)."""


@dataclass
class Job:
    """A queued request and how its answer is shaped."""

    engine: AsyncEngine
    req_id: str
    model: str
    chat: bool
    logprobs: int | None  # top alternatives per token when logprobs were asked
    return_token_ids: bool = False
    include_usage: bool = False
    continuous_usage: bool = False
    n: int = 1  # completions (choices) of the prompt
    echo: bool = False  # completions: each choice starts with the prompt (its logprobs too, when asked)
    # chat: how each completion's text is read (reasoning, tool calls: chat_parsing.ChatParser's settings)
    parsing: dict | None = None
    # one of a list of prompts: the response's id, and its first choice's index (prompt i: i * n)
    parent_id: str | None = None
    index_base: int = 0
    final_usage: api.Usage | None = None  # set by its stream once the request finished

    @property
    def response_id(self) -> str:
        return self.parent_id or self.req_id

    def parser(self) -> ChatParser:
        return ChatParser(**(self.parsing or {}))


def _value(lp: Logprob) -> float:
    return max(lp.logprob, LOGPROB_FLOOR)


def _text(lp: Logprob) -> str:
    return lp.decoded_token or ""


def usage(out: RequestOutput, completion_tokens: int, reasoning: int | None = None) -> api.Usage:
    """`reasoning`: the completions' reasoning tokens (None: not counted, no completion_tokens_details)."""
    prompt = len(out.prompt_token_ids)
    return api.Usage(
        prompt_tokens=prompt,
        completion_tokens=completion_tokens,
        total_tokens=prompt + completion_tokens,
        prompt_tokens_details=api.PromptTokensDetails(cached_tokens=out.num_cached_tokens),
        completion_tokens_details=None
        if reasoning is None
        else api.CompletionTokensDetails(reasoning_tokens=reasoning),
    )


def _reasoning(job: Job, completions: list[CompletionOutput]) -> int | None:
    """A chat's reasoning tokens under --reasoning-parser (None otherwise), all completions together."""
    parsing = job.parsing or {}
    if not job.chat or not parsing.get("reasoning"):
        return None
    start = bool(parsing.get("in_reasoning"))
    return sum(reasoning_tokens(list(c.token_ids), job.engine.decode, start) for c in completions)


def completion_logprobs(
    entries: list[dict[int, Logprob] | None], k: int, offset: int, first_text: str = ""
) -> api.CompletionLogprobs:
    """OpenAI's legacy logprobs: per token its text, logprob, top-k alternatives and text offset (an
    echoed prompt's first token has none: `first_text` names it, its logprob null)."""
    out = api.CompletionLogprobs()
    for entry in entries:
        if entry is None:
            out.tokens.append(first_text)
            out.token_logprobs.append(None)
            out.top_logprobs.append(None)
            out.text_offset.append(offset)
            offset += len(first_text)
            continue
        chosen = next(iter(entry.values()))
        out.tokens.append(_text(chosen))
        out.token_logprobs.append(_value(chosen))
        out.top_logprobs.append({_text(lp): _value(lp) for _, lp in top_logprobs(entry, k)})
        out.text_offset.append(offset)
        offset += len(_text(chosen))
    return out


def chat_logprobs(entries: list[dict[int, Logprob]], k: int) -> api.ChatLogprobs:
    content = []
    for entry in entries:
        chosen = next(iter(entry.values()))
        top = [
            api.TopLogprob(token=_text(lp), logprob=_value(lp), bytes=list(_text(lp).encode()))
            for _, lp in top_logprobs(entry, k)
        ]
        content.append(
            api.TokenLogprob(
                token=_text(chosen), logprob=_value(chosen), bytes=list(_text(chosen).encode()), top_logprobs=top
            )
        )
    return api.ChatLogprobs(content=content)


async def collect(job: Job) -> api.CompletionResponse | api.ChatCompletionResponse:
    """Wait for the whole answer, a choice per completion (leaving early aborts the request)."""
    last = None
    async with contextlib.aclosing(job.engine.stream(job.req_id)) as outputs:
        async for out in outputs:
            if out.completion(out.delta_index).finish_reason == "error":
                raise RequestFailedError(out.error or "the engine failed the request")
            last = out
    completions = sorted(last.outputs, key=lambda c: c.index)
    tokens = sum(len(c.token_ids) for c in completions)
    common = dict(
        id=job.req_id, created=api.now(), model=job.model, usage=usage(last, tokens, _reasoning(job, completions))
    )
    if job.chat:
        choices = []
        for c in completions:
            parser = job.parser()
            parsed = parser.feed(c.text)
            parsed += parser.finish()
            calls = [_tool_call(call) for call in merge_calls(parsed.tool_calls)]
            message = api.ChatResponseMessage(
                content=parsed.content or (None if calls else ""),
                reasoning_content=parsed.reasoning or None,
                tool_calls=calls,
            )
            choice = api.ChatChoice(
                index=c.index,
                message=message,
                logprobs=chat_logprobs(c.logprobs, job.logprobs) if _asked(job, c) else None,
                finish_reason=_finish_reason(c.finish_reason, parser),
                stop_reason=c.stop_reason,
                token_ids=c.token_ids if job.return_token_ids else None,
            )
            choices.append(choice)
        prompt_ids = last.prompt_token_ids if job.return_token_ids else None
        return api.ChatCompletionResponse(choices=choices, prompt_token_ids=prompt_ids, **common)
    echoed, prompt_entries, first = "", [], ""
    if job.echo:  # the prompt's text (and logprobs) before each choice's own
        echoed = last.prompt if last.prompt is not None else job.engine.decode(last.prompt_token_ids)
        prompt_entries = last.prompt_logprobs or []
        first = job.engine.token_texts(last.prompt_token_ids[:1])[0] if prompt_entries else ""
    choices = [
        api.CompletionChoice(
            index=c.index,
            text=echoed + c.text,
            logprobs=completion_logprobs(prompt_entries + (c.logprobs or []), job.logprobs, 0, first)
            if _asked(job, c)
            else None,
            finish_reason=c.finish_reason,
            stop_reason=c.stop_reason,
            token_ids=(last.prompt_token_ids if job.echo else []) + c.token_ids if job.return_token_ids else None,
            prompt_token_ids=last.prompt_token_ids if job.return_token_ids else None,
        )
        for c in completions
    ]
    return api.CompletionResponse(choices=choices, **common)


def merged(answers: list[api.CompletionResponse], req_id: str, n: int) -> api.CompletionResponse:
    """The answers to a list of prompts as one (OpenAI's order: prompt i's choices at i * n + index)."""
    choices = [
        choice.model_copy(update={"index": i * n + choice.index}) for i, a in enumerate(answers) for choice in a.choices
    ]
    usage = _summed([a.usage for a in answers])
    return answers[0].model_copy(update={"id": req_id, "choices": choices, "usage": usage})


def _asked(job: Job, completion: CompletionOutput) -> bool:
    return job.logprobs is not None and completion.logprobs is not None


def _tool_call(call) -> api.ToolCallItem:
    return api.ToolCallItem(id=call.id, function=api.FunctionCall(name=call.name, arguments=call.arguments))


def _finish_reason(reason: str | None, parser: ChatParser) -> str | None:
    """OpenAI's: a completion that ended by itself after tool calls ended for them."""
    return "tool_calls" if reason == "stop" and parser.ends_in_calls else reason


async def stream_events(jobs: list[Job]) -> AsyncIterator[str]:
    """Server-sent events of one request, or of a list of prompts' (chunks as each prompt's engine steps
    come, choice i * n + index for prompt i's completion index, one id): a chunk per engine step and
    completion, each completion's finish reason, the usage when asked (summed over the prompts), [DONE].
    A failure after the first byte is an error event (the status line is already sent)."""
    created = api.now()
    head = jobs[0]
    try:
        chunks = _job_chunks(head, created) if len(jobs) == 1 else _merged(jobs, created)
        async with contextlib.aclosing(chunks) as items:
            async for item in items:
                yield _event(item)
        if head.include_usage:
            total = _summed([job.final_usage for job in jobs])
            if head.chat:
                yield _event(_chat_chunk(head, created, None, total))
            else:
                end = api.CompletionResponse(id=head.response_id, created=created, model=head.model, choices=[])
                yield _event(end.model_copy(update={"usage": total}))
    except (RequestFailedError, EngineUnavailableError) as e:
        error = api.ErrorResponse(error=api.ErrorInfo(message=str(e)[:512], type="server_error", code="503"))
        yield _event(error)
    yield "data: [DONE]\n\n"


async def response_events(job: Job, events: ResponseEvents, on_done) -> AsyncIterator[str]:
    """The Responses API's events of a chat job (`events` reads its chunks); `on_done(response)` gets
    the finished response (to store it). A failure after the first byte is a response.failed event."""
    for event in events.start():
        yield event
    try:
        async with contextlib.aclosing(_job_chunks(job, api.now())) as chunks:
            async for chunk in chunks:
                for event in events.chunk(chunk):
                    yield event
        tail, done = events.end(job.final_usage)
        on_done(done)
        for event in tail:
            yield event
    except (RequestFailedError, EngineUnavailableError) as e:
        yield events.failed(str(e))


async def _merged(jobs: list[Job], created: int) -> AsyncIterator[api.CompletionResponse]:
    """Several prompts' chunks as they come (each prompt's in its own order); the first failure ends
    them all (leaving aborts every prompt's request)."""
    queue: asyncio.Queue = asyncio.Queue()
    ended = object()

    async def pump(job: Job) -> None:
        try:
            async with contextlib.aclosing(_job_chunks(job, created)) as items:
                async for item in items:
                    await queue.put(item)
        except Exception as e:
            await queue.put(e)
            return
        await queue.put(ended)

    tasks = [asyncio.ensure_future(pump(job)) for job in jobs]
    try:
        left = len(jobs)
        while left:
            item = await queue.get()
            if item is ended:
                left -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _job_chunks(job: Job, created: int) -> AsyncIterator[api.CompletionResponse | api.ChatCompletionChunk]:
    """One request's stream chunks; its usage (prompt, completion tokens, cache hit) in `job.final_usage`
    once it finished. Echo: each completion's first chunk starts with the prompt (its text, and its
    logprobs and ids when asked)."""
    tokens = 0
    offsets: dict[int, int] = {}  # each completion's text so far (legacy logprobs' text offsets)
    ended: set[int] = set()
    parsers: dict[int, ChatParser] = {}  # chat: each completion's reading of its text
    echo = _Echo(job) if job.echo else None
    if job.chat:  # OpenAI's first chat chunk of each choice names the role
        for index in range(job.n):
            role = api.DeltaMessage(role="assistant", content="")
            yield _chat_chunk(job, created, api.ChatStreamChoice(index=index, delta=role))
    async with contextlib.aclosing(job.engine.stream(job.req_id)) as outputs:
        async for out in outputs:
            index = out.delta_index
            c = out.completion(index)
            if c.finish_reason == "error":
                raise RequestFailedError(out.error or "the engine failed the request")
            tokens += len(out.delta_token_ids)
            step_usage = usage(out, tokens) if job.continuous_usage else None
            if echo is not None:
                echo.saw(out)
            if out.delta_text or out.delta_token_ids or (c.finish_reason is not None and index not in ended):
                parser = _parser_of(parsers, index, job)
                step = _read(parser, out.delta_text, c.finish_reason is not None) if job.chat else None
                head = echo.head(index) if echo is not None else None
                yield _step_chunk(job, created, out, c, offsets.get(index, 0), step_usage, step, parser, head)
                offsets[index] = offsets.get(index, 0) + len(out.delta_text) + (len(head.text) if head else 0)
                if c.finish_reason is not None:
                    ended.add(index)
            if out.finished:  # completions that ended without a step of their own here (an abort)
                job.final_usage = usage(out, tokens, _reasoning(job, out.outputs))
                for other in out.outputs:
                    if other.finish_reason is not None and other.index not in ended:
                        ended.add(other.index)
                        parser = _parser_of(parsers, other.index, job)
                        step = _read(parser, "", True) if job.chat else None
                        head = echo.head(other.index) if echo is not None else None
                        yield _step_chunk(job, created, None, other, 0, None, step, parser, head)


@dataclass
class EchoHead:
    """What an echoed completion's first chunk starts with."""

    text: str
    token_ids: list[int]
    logprobs: list  # the prompt's entries (the first is None), when logprobs were asked
    first_text: str  # the prompt's first token's text (its entry has no logprob)


class _Echo:
    """The prompt, put before each completion's first streamed chunk (once per completion)."""

    def __init__(self, job: Job) -> None:
        self.job = job
        self.prompt: RequestOutput | None = None
        self.prompt_logprobs: list | None = None
        self.done: set[int] = set()

    def saw(self, out: RequestOutput) -> None:
        self.prompt = self.prompt or out
        if out.prompt_logprobs is not None:  # with the first tokens of the completion that asked
            self.prompt_logprobs = out.prompt_logprobs

    def head(self, index: int) -> EchoHead | None:
        if index in self.done or self.prompt is None:
            return None
        self.done.add(index)
        out, engine = self.prompt, self.job.engine
        text = out.prompt if out.prompt is not None else engine.decode(out.prompt_token_ids)
        entries = self.prompt_logprobs or []
        first = engine.token_texts(out.prompt_token_ids[:1])[0] if entries else ""
        return EchoHead(text, list(out.prompt_token_ids), entries, first)


def _summed(usages: list[api.Usage | None]) -> api.Usage:
    """The usage of several prompts' requests as one."""
    done = [u for u in usages if u is not None]
    return api.Usage(
        prompt_tokens=sum(u.prompt_tokens for u in done),
        completion_tokens=sum(u.completion_tokens for u in done),
        total_tokens=sum(u.total_tokens for u in done),
        prompt_tokens_details=api.PromptTokensDetails(
            cached_tokens=sum(u.prompt_tokens_details.cached_tokens for u in done)
        ),
        completion_tokens_details=api.CompletionTokensDetails(
            reasoning_tokens=sum(u.completion_tokens_details.reasoning_tokens for u in details)
        )
        if (details := [u for u in done if u.completion_tokens_details is not None])
        else None,
    )


def _parser_of(parsers: dict[int, ChatParser], index: int, job: Job) -> ChatParser | None:
    """Completion `index`'s parser (chat only), made at its first step."""
    if not job.chat:
        return None
    if index not in parsers:
        parsers[index] = job.parser()
    return parsers[index]


def _read(parser: ChatParser, text: str, last: bool) -> Parsed:
    """What a step's text adds to its completion's message (the rest of it too at the end)."""
    step = parser.feed(text)
    if last:
        step += parser.finish()
    return step


def _step_chunk(
    job: Job,
    created: int,
    out: RequestOutput | None,
    c: CompletionOutput,
    offset: int,
    step_usage: api.Usage | None,
    step: Parsed | None = None,
    parser: ChatParser | None = None,
    head: EchoHead | None = None,
) -> api.ChatCompletionChunk | api.CompletionResponse:
    """One completion's step (out's delta; None: only its end) as a stream chunk; chat: `step`, what
    its text added to the message (read by `parser`); completions: `head`, the echoed prompt before a
    completion's first step."""
    text = out.delta_text if out is not None else ""
    finish, stop = c.finish_reason, c.stop_reason
    ids = (out.delta_token_ids if out is not None else []) if job.return_token_ids else None
    lps = (out.delta_logprobs if out is not None else []) if job.logprobs is not None else None
    if job.chat:
        calls = [
            api.DeltaToolCall(
                index=d.index,
                id=d.id,
                type="function" if d.id is not None else None,
                function=api.DeltaFunctionCall(name=d.name, arguments=d.arguments),
            )
            for d in step.tool_calls
        ]
        delta = api.DeltaMessage(
            content=step.content, reasoning_content=step.reasoning or None, tool_calls=calls or None
        )
        choice = api.ChatStreamChoice(
            index=c.index,
            delta=delta,
            logprobs=chat_logprobs(lps, job.logprobs) if lps is not None else None,
            finish_reason=_finish_reason(finish, parser),
            stop_reason=stop,
            token_ids=ids,
        )
        return _chat_chunk(job, created, choice, step_usage)
    first_text, prompt_ids = "", None
    if head is not None:
        text = head.text + text
        ids = head.token_ids + ids if ids is not None else None
        lps = head.logprobs + lps if lps is not None else None
        first_text = head.first_text
        prompt_ids = head.token_ids if job.return_token_ids else None
    choice = api.CompletionChoice(
        index=job.index_base + c.index,
        text=text,
        logprobs=completion_logprobs(lps, job.logprobs, offset, first_text) if lps is not None else None,
        finish_reason=finish,
        stop_reason=stop,
        token_ids=ids,
        prompt_token_ids=prompt_ids,
    )
    return api.CompletionResponse(
        id=job.response_id, created=created, model=job.model, choices=[choice], usage=step_usage
    )


def _chat_chunk(job: Job, created: int, choice, step_usage: api.Usage | None = None) -> api.ChatCompletionChunk:
    return api.ChatCompletionChunk(
        id=job.response_id, created=created, model=job.model, choices=[choice] if choice else [], usage=step_usage
    )


def _event(body) -> str:
    return f"data: {body.model_dump_json(exclude_none=False)}\n\n"
