"""A request as the driver tracks it, and the outputs users receive.

A `Request` owns its token ids, `num_computed_tokens`, block table and GDN state slot; only the
allocators (driven by the scheduler) change the last two.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from deltaserve.workers.plan import GrammarSpec, TokenLogprobs

from .prefix_cache import RequestHashes
from .sampling_params import SamplingParams

if TYPE_CHECKING:  # only a field's type: the adapter registry imports torch, the gRPC client must not
    from .lora import Adapter


PRIORITY_LIMIT = 2**31  # |priority| below it: the gRPC field is an int32


@dataclass(frozen=True)
class RequestOptions:
    """What a front door passes with a request besides its prompt and sampling parameters, from the
    API down to the engine loop: the loaded adapter it runs on (by name; None: the base model), its
    scheduling priority (lower first, under `scheduling_policy="priority"`) and its prefix-cache
    salt (requests share cached blocks and GDN snapshots only with requests of the same salt)."""

    lora_name: str | None = None
    priority: int = 0
    cache_salt: str | None = None

    def check(self) -> None:
        """ValueError naming the field (a value is never echoed whole)."""
        if isinstance(self.priority, bool) or not isinstance(self.priority, int):
            raise ValueError(f"priority: must be an integer, got {type(self.priority).__name__}")
        if not -PRIORITY_LIMIT < self.priority < PRIORITY_LIMIT:
            raise ValueError(f"priority: must be within +-(2**31 - 1), got {str(self.priority)[:24]}")
        if self.cache_salt is not None and (not isinstance(self.cache_salt, str) or len(self.cache_salt) > 256):
            raise ValueError("cache_salt: must be a string of at most 256 characters")


NO_OPTIONS = RequestOptions()


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or the model's length limit
    ABORT = "abort"  # cancelled by the client
    ERROR = "error"  # the engine failed the request (a worker died)


@dataclass(frozen=True)
class SampleRef:
    """Where a sampled token is before the driver sees it: pass `pass_id`'s sampled ids, entry `index`
    (its sampling rows in plan order)."""

    pass_id: int
    index: int


@dataclass
class Request:
    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    max_tokens: int  # sampling_params.max_tokens, or (None there) what fits in max_model_len
    eos_token_ids: tuple[int, ...] = ()
    arrival_time: float = field(default_factory=time.monotonic)
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    state_slot: int | None = None
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    error: str | None = None
    num_preemptions: int = 0
    # sampled-token and prompt logprobs collected so far
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprobs | None] = field(default_factory=list)
    # the same in vLLM's shape, converted as they arrive (a cumulative output must not redo them all)
    sample_logprobs_out: SampleLogprobs = field(default_factory=list)
    prompt_logprobs_out: PromptLogprobs = field(default_factory=list)
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    # set by the scheduler when the request (re)enters the running set; the next plan carries it
    needs_worker_state: bool = True
    # async scheduling: tokens sampled by passes in flight whose ids the driver has not seen yet,
    # and where the latest one is
    num_pending_outputs: int = 0
    last_sample: SampleRef | None = None
    # prefix caching: what keeps its blocks apart from other requests' (adapter, salt), its block
    # hashes, the prompt tokens its first admission skipped, positions below kv_shared_until are in
    # pages it shares (its recomputed KV there is not written), and where its tokens stopped
    # matching cached ones (a snapshot is captured there)
    cache_key: str = ""
    # LoRA: the adapter it runs on (None: the base model) and the device slot it pins while running
    lora: Adapter | None = None
    lora_slot: int | None = None
    prefix_hashes: RequestHashes | None = None
    num_cached_tokens: int | None = None
    kv_shared_until: int = 0
    divergence: int = 0
    # structured output: the constraint its outputs follow (checked to compile when it was made)
    grammar: GrammarSpec | None = None
    # speculative decoding: the MTP head's drafts after the latest token, for its next verify row
    draft_token_ids: list[int] = field(default_factory=list)
    # completion 1.. of an n > 1 request: the first completion, whose prompt prefill it waits for
    # (then it starts from the prefix cache: completions.py)
    prefill_leader: Request | None = None
    # scheduling_policy="priority": lower first (vLLM's meaning); ties by arrival
    priority: int = 0
    # the prompt as int32 (made once, by the engine's check or the first token_array): its slices feed
    # the plan's input ids and the block hashes without a conversion per pass
    prompt_array: np.ndarray | None = field(default=None, repr=False, compare=False)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_at(self, index: int) -> int:
        """Token `index` of prompt + output, without building the joined list."""
        prompt = len(self.prompt_token_ids)
        return self.prompt_token_ids[index] if index < prompt else self.output_token_ids[index - prompt]

    def token_slice(self, start: int, end: int) -> list[int]:
        prompt = len(self.prompt_token_ids)
        if end <= prompt:
            return self.prompt_token_ids[start:end]
        if start >= prompt:
            return self.output_token_ids[start - prompt : end - prompt]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - prompt]

    def token_array(self, start: int, end: int) -> np.ndarray:
        """token_slice as int32: a view of prompt_array within the prompt."""
        if end <= len(self.prompt_token_ids):
            if self.prompt_array is None:
                self.prompt_array = np.asarray(self.prompt_token_ids, dtype=np.int32)
            return self.prompt_array[start:end]
        return np.asarray(self.token_slice(start, end), dtype=np.int32)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Prompt logprobs asked for and not all delivered yet (the first token has none)."""
        return self.sampling_params.prompt_logprobs is not None and len(self.prompt_logprobs) < self.num_prompt_tokens


@dataclass
class Logprob:
    """vLLM's logprob of one token at one position: its log probability, its rank among the vocabulary
    (1 = most likely) and its text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# vLLM's shapes: per position, {token id: Logprob} holding the sampled (or prompt) token first, then
# the top-k alternatives in rank order; prompt position 0 is None (the first token has no logprob)
SampleLogprobs = list[dict[int, Logprob]]
PromptLogprobs = list[dict[int, Logprob] | None]


def top_logprobs(entry: dict[int, Logprob], k: int) -> list[tuple[int, Logprob]]:
    """The k most likely tokens of one position's entry, in rank order. The entry holds the chosen
    token first and then the top k; when the chosen token is one of the top k it appears once (first),
    so it goes back to its place among them."""
    items = list(entry.items())
    chosen, others = items[0], items[1:]
    if len(others) < k and chosen[1].rank is not None:
        others.insert(min(chosen[1].rank - 1, len(others)), chosen)
    return others[:k]


@dataclass
class RequestMetrics:
    """Where a request's time went, on the engine's clock (time.monotonic, seconds); vLLM's names."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None

    @property
    def time_in_queue(self) -> float | None:
        return None if self.first_scheduled_time is None else self.first_scheduled_time - self.arrival_time


@dataclass
class CompletionOutput:
    """vLLM's CompletionOutput: text and token ids (and their logprobs when asked) of one completion."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: SampleLogprobs | None
    finish_reason: str | None
    stop_reason: int | str | None = None


@dataclass
class RequestOutput:
    """vLLM's RequestOutput: a request's output so far (`finished` False while streaming) or final. The
    `delta_*` fields are deltaserve's: what this update added (what a stream sends on)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: PromptLogprobs | None
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None
    # streaming: what this update added
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)
    delta_logprobs: SampleLogprobs = field(default_factory=list)
    time_to_first_token_s: float | None = None
    error: str | None = None
    # an n > 1 request (completions.py): the index of the completion the delta_* fields belong to
    delta_index: int = 0

    def completion(self, index: int) -> CompletionOutput:
        """The completion at this index among `outputs` (a streamed n > 1 update holds only the one that
        changed: `delta_index`)."""
        return next(c for c in self.outputs if c.index == index)
