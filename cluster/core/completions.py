"""Requests for several completions of one prompt (`SamplingParams.n` > 1).

Each completion runs as a request of its own (`completion_id`: the request id, then `#` and the
index), with `SamplingParams.for_completion`'s parameters. The first one leads: with prefix caching
on, the others wait until its prompt is planned (`Request.prefill_leader`, scheduler.py) and then
start from its cached pages and GDN snapshot, so the prompt is prefilled about once. The engine
gathers their outputs back into the request's (`CompletionGroup.gather`), in vLLM's shapes: a final
output holds every completion in index order; a streamed one (cumulative or delta) holds the
completion that changed, and `RequestOutput.delta_index` says which.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field

from .request import CompletionOutput, RequestMetrics, RequestOutput


def completion_id(req_id: str, index: int) -> str:
    """The request id of completion `index` of request `req_id`."""
    return f"{req_id}#{index}"


@dataclass
class CompletionGroup:
    """The n completions of one request as their outputs arrive."""

    req_id: str
    n: int
    prompt: str | None  # the prompt's text (None for token ids), as RequestOutput.prompt
    finals: dict[int, CompletionOutput] = field(default_factory=dict)
    lead: RequestOutput | None = None  # the first completion's latest output: the prompt's logprobs, its cache hit
    first_token_s: float | None = None
    first_scheduled: float | None = None
    first_token_time: float | None = None
    error: str | None = None

    @property
    def done(self) -> bool:
        return len(self.finals) == self.n

    def gather(self, index: int, out: RequestOutput, final_only: bool) -> RequestOutput | None:
        """Completion `index`'s output `out` as the request's (None while final_only and some
        completion is still running)."""
        completion = dataclasses.replace(out.outputs[0], index=index)
        self.first_token_s = _earliest(self.first_token_s, out.time_to_first_token_s)
        if index == 0:
            self.lead = out
        if out.finished:
            self.finals[index] = completion
            self.error = self.error or out.error
            if out.metrics is not None:
                self.first_scheduled = _earliest(self.first_scheduled, out.metrics.first_scheduled_time)
                self.first_token_time = _earliest(self.first_token_time, out.metrics.first_token_time)
        common = dict(request_id=self.req_id, prompt=self.prompt, delta_index=index)
        if not self.done:
            if final_only:
                return None
            first = self.first_token_s
            return dataclasses.replace(
                out, **common, outputs=[completion], finished=False, metrics=None, time_to_first_token_s=first
            )
        lead = self.lead if self.lead is not None else out
        arrival = lead.metrics.arrival_time if lead.metrics is not None else time.monotonic()
        return dataclasses.replace(
            out,
            **common,
            prompt_logprobs=lead.prompt_logprobs,
            outputs=[self.finals[i] for i in range(self.n)],
            finished=True,
            num_cached_tokens=lead.num_cached_tokens,
            metrics=RequestMetrics(arrival, self.first_scheduled, self.first_token_time, time.monotonic()),
            time_to_first_token_s=self.first_token_s,
            error=self.error,
        )


def _earliest(a: float | None, b: float | None) -> float | None:
    return b if a is None else a if b is None else min(a, b)
