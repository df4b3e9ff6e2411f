"""SamplingParams: what a user asks of one generation, checked when it is made."""

from __future__ import annotations

from dataclasses import dataclass, field

from deltaserve.workers.config import short
from deltaserve.workers.plan import SamplingSpec

MAX_STOP_SEQUENCES = 32
MAX_STOP_STRING_LEN = 256
MAX_LOGPROBS = 20


@dataclass
class SamplingParams:
    """The parameters of one generation (the names vLLM users know).

    temperature 0 is greedy. top_k -1 (or 0) keeps every token, top_p 1 and min_p 0 disable
    nucleus and min-p filtering. A seed makes the request's samples reproducible whatever else
    runs in the batch. Penalties: repetition (over prompt and output, >1 discourages), presence and
    frequency (over the output, OpenAI semantics). `stop` strings end the text and are not included
    in it; `stop_token_ids` and the checkpoint's EOS end the output (EOS unless `ignore_eos`).
    `logprobs` / `prompt_logprobs`: how many top alternatives to return per position (0: only the
    chosen token's own logprob). `max_tokens` None: as many as fit in max_model_len; a number that
    does not fit after the prompt is refused."""

    max_tokens: int | None = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    n: int = 1

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids)
        self.validate()

    def validate(self, vocab_size: int | None = None) -> None:
        """Raise ValueError naming the first bad field."""

        def bad(name: str, why: str) -> None:
            raise ValueError(f"{name}: {why}")

        if self.n != 1:
            bad("n", f"must be 1 (got {self.n}); several completions per request are not supported yet")
        if self.max_tokens is not None and (
            not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens < 1
        ):
            bad("max_tokens", f"must be an integer >= 1 or None, got {short(self.max_tokens)}")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            bad("min_tokens", f"must be an integer >= 0, got {short(self.min_tokens)}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            bad("min_tokens", f"must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}")
        if not self.temperature >= 0:  # also rejects NaN
            bad("temperature", f"must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            bad("top_p", f"must be in (0, 1], got {self.top_p}")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            bad("top_k", f"must be -1 (disabled), 0 (disabled) or >= 1, got {short(self.top_k)}")
        if not 0 <= self.min_p <= 1:
            bad("min_p", f"must be in [0, 1], got {self.min_p}")
        if not self.repetition_penalty > 0:
            bad("repetition_penalty", f"must be > 0, got {self.repetition_penalty}")
        if not -2 <= self.presence_penalty <= 2:
            bad("presence_penalty", f"must be in [-2, 2], got {self.presence_penalty}")
        if not -2 <= self.frequency_penalty <= 2:
            bad("frequency_penalty", f"must be in [-2, 2], got {self.frequency_penalty}")
        if self.seed is not None and not (isinstance(self.seed, int) and 0 <= self.seed < 2**63):
            bad("seed", f"must be an integer in [0, 2**63), got {short(self.seed)}")
        if len(self.stop) > MAX_STOP_SEQUENCES:
            bad("stop", f"at most {MAX_STOP_SEQUENCES} stop strings, got {len(self.stop)}")
        for s in self.stop:
            if not isinstance(s, str) or not s or len(s) > MAX_STOP_STRING_LEN:
                bad("stop", f"each stop string must be 1..{MAX_STOP_STRING_LEN} characters, got {short(s)}")
        if len(self.stop_token_ids) > MAX_STOP_SEQUENCES:
            bad("stop_token_ids", f"at most {MAX_STOP_SEQUENCES} stop token ids, got {len(self.stop_token_ids)}")
        for t in self.stop_token_ids:
            if not isinstance(t, int) or t < 0 or (vocab_size is not None and t >= vocab_size):
                vocab = f"the vocabulary [0, {vocab_size})" if vocab_size is not None else "the token ids (>= 0)"
                bad("stop_token_ids", f"id {short(t)} is outside {vocab}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, int) and 0 <= value <= MAX_LOGPROBS):
                bad(name, f"must be in [0, {MAX_LOGPROBS}] or None, got {short(value)}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def to_spec(self) -> SamplingSpec:
        """The part the worker's sampler needs."""
        return SamplingSpec(
            temperature=self.temperature,
            top_k=self.top_k,
            top_p=self.top_p,
            min_p=self.min_p,
            seed=self.seed,
            repetition_penalty=self.repetition_penalty,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            logprobs=self.logprobs,
            prompt_logprobs=self.prompt_logprobs,
        )
