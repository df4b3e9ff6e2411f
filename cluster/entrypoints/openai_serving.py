"""Engine outputs as OpenAI response bodies: completions and chat completions, whole or as server-sent
event chunks, with usage and logprobs in OpenAI's shapes (from vLLM-shaped RequestOutputs)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass

from deltaserve.cluster.core.request import Logprob, RequestOutput, top_logprobs

from . import openai_protocol as api
from .async_engine import AsyncEngine, EngineUnavailableError

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


def _value(lp: Logprob) -> float:
    return max(lp.logprob, LOGPROB_FLOOR)


def _text(lp: Logprob) -> str:
    return lp.decoded_token or ""


def usage(out: RequestOutput, completion_tokens: int) -> api.Usage:
    prompt = len(out.prompt_token_ids)
    return api.Usage(
        prompt_tokens=prompt,
        completion_tokens=completion_tokens,
        total_tokens=prompt + completion_tokens,
        prompt_tokens_details=api.PromptTokensDetails(cached_tokens=out.num_cached_tokens),
    )


def completion_logprobs(entries: list[dict[int, Logprob]], k: int, offset: int) -> api.CompletionLogprobs:
    """OpenAI's legacy logprobs: per token its text, logprob, top-k alternatives and text offset."""
    out = api.CompletionLogprobs()
    for entry in entries:
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
    """Wait for the whole answer (leaving early aborts the request)."""
    last = None
    async with contextlib.aclosing(job.engine.stream(job.req_id)) as outputs:
        async for out in outputs:
            if out.outputs[0].finish_reason == "error":
                raise RequestFailedError(out.error or "the engine failed the request")
            last = out
    c = last.outputs[0]
    lps = c.logprobs if job.logprobs is not None else None
    ids = c.token_ids if job.return_token_ids else None
    common = dict(id=job.req_id, created=api.now(), model=job.model, usage=usage(last, len(c.token_ids)))
    if job.chat:
        choice = api.ChatChoice(
            message=api.ChatResponseMessage(content=c.text),
            logprobs=chat_logprobs(lps, job.logprobs) if lps is not None else None,
            finish_reason=c.finish_reason,
            stop_reason=c.stop_reason,
            token_ids=ids,
        )
        prompt_ids = last.prompt_token_ids if job.return_token_ids else None
        return api.ChatCompletionResponse(choices=[choice], prompt_token_ids=prompt_ids, **common)
    choice = api.CompletionChoice(
        text=c.text,
        logprobs=completion_logprobs(lps, job.logprobs, 0) if lps is not None else None,
        finish_reason=c.finish_reason,
        stop_reason=c.stop_reason,
        token_ids=ids,
        prompt_token_ids=last.prompt_token_ids if job.return_token_ids else None,
    )
    return api.CompletionResponse(choices=[choice], **common)


async def stream_events(job: Job) -> AsyncIterator[str]:
    """Server-sent events: a chunk per engine step, the finish reason, the usage when asked, [DONE].
    A failure after the first byte is an error event (the status line is already sent)."""
    created, tokens, offset = api.now(), 0, 0
    try:
        if job.chat:  # OpenAI's first chat chunk names the role
            yield _event(
                _chat_chunk(job, created, api.ChatStreamChoice(delta=api.DeltaMessage(role="assistant", content="")))
            )
        async with contextlib.aclosing(job.engine.stream(job.req_id)) as outputs:
            async for out in outputs:
                c = out.outputs[0]
                if c.finish_reason == "error":
                    raise RequestFailedError(out.error or "the engine failed the request")
                tokens += len(out.delta_token_ids)
                if not (out.delta_text or out.delta_token_ids or out.finished):
                    continue
                finish = c.finish_reason if out.finished else None
                stop = c.stop_reason if out.finished else None
                ids = out.delta_token_ids if job.return_token_ids else None
                lps = out.delta_logprobs if job.logprobs is not None else None
                step_usage = usage(out, tokens) if job.continuous_usage else None
                if job.chat:
                    choice = api.ChatStreamChoice(
                        delta=api.DeltaMessage(content=out.delta_text),
                        logprobs=chat_logprobs(lps, job.logprobs) if lps is not None else None,
                        finish_reason=finish,
                        stop_reason=stop,
                        token_ids=ids,
                    )
                    chunk = _chat_chunk(job, created, choice, step_usage)
                else:
                    choice = api.CompletionChoice(
                        text=out.delta_text,
                        logprobs=completion_logprobs(lps, job.logprobs, offset) if lps is not None else None,
                        finish_reason=finish,
                        stop_reason=stop,
                        token_ids=ids,
                    )
                    chunk = api.CompletionResponse(
                        id=job.req_id, created=created, model=job.model, choices=[choice], usage=step_usage
                    )
                offset += len(out.delta_text)
                yield _event(chunk)
                if out.finished and job.include_usage:
                    final_usage = usage(out, tokens)
                    if job.chat:
                        yield _event(_chat_chunk(job, created, None, final_usage))
                    else:
                        yield _event(
                            api.CompletionResponse(
                                id=job.req_id, created=created, model=job.model, choices=[], usage=final_usage
                            )
                        )
    except (RequestFailedError, EngineUnavailableError) as e:
        error = api.ErrorResponse(error=api.ErrorInfo(message=str(e)[:512], type="server_error", code="503"))
        yield _event(error)
    yield "data: [DONE]\n\n"


def _chat_chunk(job: Job, created: int, choice, step_usage: api.Usage | None = None) -> api.ChatCompletionChunk:
    return api.ChatCompletionChunk(
        id=job.req_id, created=created, model=job.model, choices=[choice] if choice else [], usage=step_usage
    )


def _event(body) -> str:
    return f"data: {body.model_dump_json(exclude_none=False)}\n\n"
