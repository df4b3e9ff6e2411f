"""SamplingParams: what a user asks of one generation, checked when it is made; and
StructuredOutputsParams, its constraint on the output's form (JSON schema, regex, choice, grammar)."""

from __future__ import annotations

import dataclasses
import enum
import json as json_module
import math
import numbers
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from deltaserve.workers.config import short
from deltaserve.workers.plan import FLOAT32_MAX, GREEDY_TEMPERATURE, GrammarSpec, SamplingSpec

MAX_STOP_SEQUENCES = 32
MAX_STOP_STRING_LEN = 256
MAX_LOGPROBS = 20
MAX_TOP_K = 2**31 - 1  # what the gRPC field holds; the sampler keeps every token from the vocabulary size up
FLOAT_FIELDS = ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty")
MAX_GRAMMAR_CHARS = 512 * 1024  # a schema, regex, grammar or the choices together
MAX_CHOICES = 1024
MAX_N = 128  # completions of one request (OpenAI's bound)
MAX_REASONING_END = 64
MAX_LOGIT_BIAS = 1024  # biased tokens of one request
MAX_BIAS = 100.0  # OpenAI's bound on each bias
_CONSTRAINTS = ("json", "regex", "choice", "grammar", "json_object")
_SCHEMA_FIELD = "response_format.json_schema.schema"


@dataclass
class StructuredOutputsParams:
    """Constrained decoding, vLLM's names: exactly one of `json` (a JSON schema, as a dict or its JSON
    text), `regex`, `choice` (the output is one of these strings), `grammar` (EBNF in xgrammar's
    dialect) or `json_object=True` (any JSON object). `disable_any_whitespace`: JSON with fixed
    separators and no free whitespace (a weak model may otherwise spend its tokens on whitespace).
    The output ends where the grammar does: its end allows only EOS, which then ends the request
    (even with ignore_eos)."""

    json: dict | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    # deltaserve's: the constraint holds after free text ending with this (a thinking model's reasoning
    # and its end, "</think>\n\n"; the HTTP server sets it under --reasoning-parser)
    reasoning_end: str | None = None

    def __post_init__(self) -> None:
        self.to_grammar_spec()

    def to_grammar_spec(self) -> GrammarSpec:
        """The constraint in canonical text (a schema's text without its spacing: one compile); raises
        ValueError naming `structured_outputs.<field>` when the fields are not one valid constraint."""

        def bad(name: str, why: str) -> None:
            raise ValueError(f"structured_outputs.{name}: {why}")

        given = [name for name in _CONSTRAINTS if getattr(self, name) not in (None, False)]
        if not given:
            raise ValueError(f"structured_outputs: give one of {', '.join(_CONSTRAINTS)}")
        if len(given) > 1:
            raise ValueError(f"structured_outputs: give only one constraint, got {' and '.join(given)}")
        if not isinstance(self.disable_any_whitespace, bool):
            bad("disable_any_whitespace", f"must be a bool, got {short(self.disable_any_whitespace)}")
        end = self.reasoning_end
        if end is not None and not (isinstance(end, str) and 0 < len(end) <= MAX_REASONING_END):
            bad("reasoning_end", f"must be a string of 1..{MAX_REASONING_END} characters, got {short(end)}")
        kind = given[0]
        value = getattr(self, kind)
        if kind == "json":
            schema = value
            if isinstance(value, str):
                try:
                    schema = json_module.loads(value)
                except ValueError as e:
                    bad("json", f"is not valid JSON ({e})")
            if not isinstance(schema, dict):
                bad("json", f"must be a JSON schema object, got {short(value)}")
            # keys keep their order: the output's properties come in the schema's order
            text = json_module.dumps(schema, separators=(",", ":"), ensure_ascii=False)
        elif kind == "json_object":
            if value is not True:
                bad("json_object", f"must be true or unset, got {short(value)}")
            text = ""
        elif kind == "choice":
            if not isinstance(value, list | tuple):
                bad("choice", f"must be a list of strings, got {short(value)}")
            if not value:
                bad("choice", "must not be empty")
            if len(value) > MAX_CHOICES:
                bad("choice", f"at most {MAX_CHOICES} choices, got {len(value)}")
            for c in value:
                if not isinstance(c, str) or not c:
                    bad("choice", f"each choice must be a non-empty string, got {short(c)}")
            text = json_module.dumps(list(value), ensure_ascii=False)
        else:
            if not isinstance(value, str) or not value:
                bad(kind, f"must be a non-empty string, got {short(value)}")
            text = value
        if len(text) > MAX_GRAMMAR_CHARS:
            bad(kind, f"at most {MAX_GRAMMAR_CHARS} characters, got {len(text)}")
        json_like = kind in ("json", "json_object")
        whitespace = not (json_like and self.disable_any_whitespace)
        return GrammarSpec(kind, text, any_whitespace=whitespace, after=self.reasoning_end or "")

    @classmethod
    def from_response_format(cls, response_format: dict[str, Any] | None) -> StructuredOutputsParams | None:
        """OpenAI's `response_format` -> the constraint (None for `{"type": "text"}` or None):
        `{"type": "json_object"}`, or `{"type": "json_schema", "json_schema": {"name": ..., "schema":
        {...}, "strict": ...}}` (no schema: any JSON object). Errors name the `response_format` field."""
        if response_format is None:
            return None
        if not isinstance(response_format, dict):
            raise ValueError(f"response_format: must be an object, got {short(response_format)}")
        kind = response_format.get("type")
        if kind == "text":
            return None
        if kind == "json_object":
            return cls(json_object=True)
        if kind == "json_schema":
            spec = response_format.get("json_schema")
            if not isinstance(spec, dict):
                raise ValueError("response_format.json_schema: must be an object with a 'schema'")
            name = spec.get("name")
            if name is not None and not isinstance(name, str):
                raise ValueError(f"response_format.json_schema.name: must be a string, got {short(name)}")
            schema = spec.get("schema")
            if schema is None:
                return cls(json_object=True)
            if not isinstance(schema, dict):
                raise ValueError(f"{_SCHEMA_FIELD}: must be a JSON schema object, got {short(schema)}")
            try:
                return cls(json=schema)
            except ValueError as e:
                raise ValueError(str(e).replace("structured_outputs.json", _SCHEMA_FIELD)) from None
        raise ValueError(f"response_format.type: must be text, json_object or json_schema, got {short(kind)}")


class RequestOutputKind(enum.Enum):
    """vLLM's: what each streamed RequestOutput of the async API holds (LLM.generate returns finals)."""

    CUMULATIVE = 0  # the whole completion so far
    DELTA = 1  # only what this update added
    FINAL_ONLY = 2  # nothing until the end


@dataclass
class SamplingParams:
    """The parameters of one generation (the names vLLM users know).

    temperature 0 (or anything below 1e-5, as in vLLM) is greedy. top_k -1 (or 0) keeps every token,
    top_p 1 and min_p 0 disable nucleus and min-p filtering. Every float is finite (NaN and inf are
    refused, as is anything beyond float32, what the sampler computes in). top_k may exceed the
    vocabulary. A seed makes the request's samples reproducible whatever else runs in the batch.
    Penalties: repetition (over prompt and output, >1 discourages), presence and
    frequency (over the output, OpenAI semantics). `stop` strings end the text and are not included
    in it; `stop_token_ids` and the checkpoint's EOS end the output (EOS unless `ignore_eos`).
    `logprobs` / `prompt_logprobs`: how many top alternatives to return per position (0: only the
    chosen token's own logprob). `max_tokens` None: as many as fit in max_model_len; a number that
    does not fit after the prompt is refused. `output_kind`: what the async API's outputs hold.
    `n`: completions of the prompt (cluster/core/completions.py: the prompt is prefilled once).
    `logit_bias`: {token id: bias in [-100, 100]} added to the logits before penalties and sampling
    (OpenAI's; such a request decodes without speculation)."""

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
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    structured_outputs: StructuredOutputsParams | None = None
    logit_bias: dict[int, float] | None = None

    def __post_init__(self) -> None:
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        for name in ("stop", "stop_token_ids"):
            value = getattr(self, name)
            if isinstance(value, str | bytes | dict) or not hasattr(value, "__iter__"):
                raise ValueError(f"{name}: must be a list, got {type(value).__name__}")
            setattr(self, name, list(value))
        self.validate()

    def validate(self, vocab_size: int | None = None) -> None:
        """Raise ValueError naming the first bad field."""

        def bad(name: str, why: str) -> None:
            raise ValueError(f"{name}: {why}")

        if not isinstance(self.output_kind, RequestOutputKind):
            bad("output_kind", f"must be a RequestOutputKind, got {short(self.output_kind)}")
        for name in FLOAT_FIELDS:  # NaN and inf first: every range check below assumes a finite number
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Real):
                bad(name, f"must be a number, got {type(value).__name__}")
            if not (math.isfinite(value) and abs(value) <= FLOAT32_MAX):
                bad(name, f"must be a finite float32 number, got {short(value)}")
            setattr(self, name, float(value))
        if not isinstance(self.n, int) or isinstance(self.n, bool) or not 1 <= self.n <= MAX_N:
            bad("n", f"must be an integer in [1, {MAX_N}], got {short(self.n)}")
        if self.max_tokens is not None and (
            not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens < 1
        ):
            bad("max_tokens", f"must be an integer >= 1 or None, got {short(self.max_tokens)}")
        if not isinstance(self.min_tokens, int) or isinstance(self.min_tokens, bool) or self.min_tokens < 0:
            bad("min_tokens", f"must be an integer >= 0, got {short(self.min_tokens)}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            bad("min_tokens", f"must be in [0, max_tokens={short(self.max_tokens)}], got {short(self.min_tokens)}")
        if not self.temperature >= 0:
            bad("temperature", f"must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            bad("top_p", f"must be in (0, 1], got {self.top_p}")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or not -1 <= self.top_k <= MAX_TOP_K:
            bad("top_k", f"must be -1 (disabled), 0 (disabled) or in [1, 2**31), got {short(self.top_k)}")
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
            if not isinstance(t, int) or not 0 <= t < (vocab_size or 2**31):
                vocab = f"the vocabulary [0, {vocab_size})" if vocab_size is not None else "the token ids [0, 2**31)"
                bad("stop_token_ids", f"id {short(t)} is outside {vocab}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, int) and 0 <= value <= MAX_LOGPROBS):
                bad(name, f"must be in [0, {MAX_LOGPROBS}] or None, got {short(value)}")
        if self.logit_bias is not None:
            self._check_logit_bias(vocab_size)
        if self.structured_outputs is not None:
            if not isinstance(self.structured_outputs, StructuredOutputsParams):
                bad("structured_outputs", f"must be a StructuredOutputsParams, got {short(self.structured_outputs)}")
            if self.min_tokens:  # the grammar's end allows only EOS, which min_tokens forbids
                bad("min_tokens", "must be 0 with structured_outputs (the grammar decides where the output ends)")

    def _check_logit_bias(self, vocab_size: int | None) -> None:
        bias = self.logit_bias
        if not isinstance(bias, dict):
            raise ValueError(f"logit_bias: must be a mapping of token id to bias, got {short(bias)}")
        if len(bias) > MAX_LOGIT_BIAS:
            raise ValueError(f"logit_bias: at most {MAX_LOGIT_BIAS} tokens, got {len(bias)}")
        for token, value in bias.items():
            if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token < (vocab_size or 2**31):
                vocab = f"the vocabulary [0, {vocab_size})" if vocab_size is not None else "the token ids [0, 2**31)"
                raise ValueError(f"logit_bias: token id {short(token)} is outside {vocab}")
            if isinstance(value, bool) or not isinstance(value, numbers.Real) or not -MAX_BIAS <= value <= MAX_BIAS:
                raise ValueError(f"logit_bias: the bias of token {token} must be in [-100, 100], got {short(value)}")

    def for_completion(self, index: int) -> SamplingParams:
        """The parameters of completion `index` of an n > 1 request, which runs as a request of its own:
        n = 1, a given seed plus the index (each completion its own reproducible stream, as vLLM), and
        the prompt's logprobs asked of the first completion only (they are every completion's)."""
        seed = None if self.seed is None else (self.seed + index) % 2**63
        prompt_logprobs = self.prompt_logprobs if index == 0 else None
        return dataclasses.replace(self, n=1, seed=seed, prompt_logprobs=prompt_logprobs)

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

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
            grammar=self.structured_outputs.to_grammar_spec() if self.structured_outputs is not None else None,
            logit_bias=[[token, float(value)] for token, value in sorted((self.logit_bias or {}).items())],
        )


# ---- the model's recommended sampling (generation_config.json), as vLLM applies it --------------
GENERATION_DEFAULTS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def generation_defaults(model_dir: str | None, source: str = "auto", overrides: dict | None = None) -> dict[str, Any]:
    """The sampling fields a request that leaves them unset takes: `source` "auto" reads them from the
    checkpoint's generation_config.json (its temperature, top_p, top_k, min_p, repetition_penalty, the
    fields vLLM reads), "vllm" takes none (SamplingParams' own), any other value is a folder holding a
    generation_config.json; `overrides` (override_generation_config) replace or add entries. Values
    are checked as SamplingParams checks them; ValueError names the setting."""
    found: dict[str, Any] = {}
    if source != "vllm":
        folder = model_dir if source == "auto" else source
        path = None if folder is None else Path(folder) / "generation_config.json"
        if path is not None and path.is_file():
            try:
                data = json_module.loads(path.read_text())
            except (OSError, ValueError) as e:
                where = short(str(path), 120)
                raise ValueError(f"generation_config: {where} is not JSON ({type(e).__name__})") from None
            found = {k: data[k] for k in GENERATION_DEFAULTS if isinstance(data, dict) and data.get(k) is not None}
        elif source != "auto":
            raise ValueError(f"generation_config: no generation_config.json in {short(source, 120)}")
    for key in overrides or {}:
        if key not in GENERATION_DEFAULTS:
            raise ValueError(
                f"override_generation_config: unknown key {short(key)}; known: {', '.join(GENERATION_DEFAULTS)}"
            )
    found.update(overrides or {})
    try:
        SamplingParams(**found)
    except ValueError as e:
        raise ValueError(f"generation_config: {e}") from None
    return found


def with_defaults(fields: dict[str, Any], defaults: dict[str, Any]) -> dict[str, Any]:
    """A request's sampling fields with the model's defaults where it set none."""
    return {**{k: v for k, v in defaults.items() if k not in fields}, **fields}
