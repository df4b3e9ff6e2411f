"""The OpenAI API's request and response bodies (the subset deltaserve serves), as pydantic models.

Requests refuse unknown fields (a typo is a 400 naming it, not a silently ignored setting); the
fields beyond OpenAI's are vLLM's extensions by vLLM's names (top_k, min_p, repetition_penalty,
min_tokens, stop_token_ids, ignore_eos, include_stop_str_in_output, skip_special_tokens,
return_token_ids, structured_outputs, chat_template_kwargs, add_generation_prompt,
continue_final_message). OpenAI's `response_format` and vLLM's `structured_outputs` both become
SamplingParams.structured_outputs.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from deltaserve.cluster.core.sampling_params import MAX_LOGPROBS, StructuredOutputsParams

from .validation import CHAT_ROLES


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class StructuredOutputs(Strict):
    """vLLM's `structured_outputs` request field: exactly one constraint (StructuredOutputsParams checks)."""

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")  # BaseModel has a .json
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False


def token_biases(logit_bias: dict[str, float]) -> dict[int, float]:
    """OpenAI's logit_bias (token ids as JSON object keys) with integer keys; ValueError naming it."""
    out = {}
    for key, value in logit_bias.items():
        try:
            out[int(key)] = value
        except ValueError:
            raise ValueError(f"logit_bias: keys must be token ids, got {key[:40]!r}") from None
    return out


class SamplingFields(Strict):
    """What completions and chat completions share; every field maps onto SamplingParams."""

    model: str | None = None
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    logit_bias: dict[str, float] | None = None
    # vLLM's extensions
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    return_token_ids: bool = False
    request_id: str | None = None
    priority: int = 0  # lower first, under --scheduling-policy priority
    cache_salt: str | None = None  # share the prefix cache only with requests of this salt
    # OpenAI's (chat completions; vLLM takes it on completions too) and vLLM's constraint on the output
    response_format: dict[str, Any] | None = None
    structured_outputs: StructuredOutputs | None = None

    def sampling_fields(self, max_tokens: int | None, logprobs: int | None) -> dict[str, Any]:
        """The SamplingParams fields this request sets (the rest keep SamplingParams' defaults)."""
        fields: dict[str, Any] = {
            "max_tokens": max_tokens,
            "frequency_penalty": self.frequency_penalty,
            "presence_penalty": self.presence_penalty,
            "min_tokens": self.min_tokens,
            "ignore_eos": self.ignore_eos,
            "include_stop_str_in_output": self.include_stop_str_in_output,
            "skip_special_tokens": self.skip_special_tokens,
            "n": self.n,
            "logprobs": logprobs,
        }
        optional = {
            "temperature": self.temperature,
            "top_p": self.top_p,
            "seed": self.seed,
            "top_k": self.top_k,
            "min_p": self.min_p,
            "repetition_penalty": self.repetition_penalty,
            "stop": [self.stop] if isinstance(self.stop, str) else self.stop,
            "stop_token_ids": self.stop_token_ids,
        }
        fields.update({name: value for name, value in optional.items() if value is not None})
        if self.logit_bias:
            fields["logit_bias"] = token_biases(self.logit_bias)
        constraint = StructuredOutputsParams.from_response_format(self.response_format)
        if self.structured_outputs is not None:
            if constraint is not None:
                raise ValueError("structured_outputs: give it or a json response_format, not both")
            constraint = StructuredOutputsParams(**self.structured_outputs.model_dump(exclude_none=True, by_alias=True))
        if constraint is not None:
            fields["structured_outputs"] = constraint
        return fields


class CompletionRequest(SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None


class TextPart(Strict):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    # what a client sends back from a previous response (refusal, annotations, ...) is accepted and ignored
    model_config = ConfigDict(extra="forbid")

    role: Literal[CHAT_ROLES]  # type: ignore[valid-type]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None
    refusal: str | None = None
    annotations: list[Any] | None = None
    audio: Any = None
    function_call: Any = None

    def for_template(self) -> dict[str, Any]:
        keys = ("role", "content", "name", "tool_calls", "tool_call_id", "reasoning_content")
        return {k: v for k, v in self.model_dump(include=set(keys)).items() if v is not None}


class NamedFunction(Strict):
    name: str


class NamedToolChoice(Strict):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None  # deprecated by OpenAI in favour of max_completion_tokens
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    tools: list[dict[str, Any]] | None = None
    # "required" or {"type": "function", "function": {"name": ...}} force calls (chat_parsing.forced_tools)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    # vLLM's extensions
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False


class TokenizeRequest(Strict):
    """vLLM's /tokenize: a prompt's ids, or a chat's (rendered by the chat template as a chat
    completion renders it)."""

    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    model: str | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    tools: list[dict[str, Any]] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False


class DetokenizeRequest(Strict):
    """vLLM's /detokenize: the text of token ids (special tokens kept)."""

    tokens: list[int]
    model: str | None = None


class LoadLoraAdapterRequest(Strict):
    """vLLM's POST /v1/load_lora_adapter."""

    lora_name: str
    lora_path: str


class UnloadLoraAdapterRequest(Strict):
    """vLLM's POST /v1/unload_lora_adapter (lora_int_id is accepted as vLLM's clients send it; the name
    decides)."""

    lora_name: str
    lora_int_id: int | None = None


# ---- responses ------------------------------------------------------------------------------------
def new_id(prefix: str) -> str:
    """OpenAI's id shape: "chatcmpl-<hex>", "cmpl-<hex>"; a prefix ending in "_" joins as is ("resp_<hex>")."""
    return f"{prefix}{'' if prefix.endswith('_') else '-'}{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class CompletionTokensDetails(BaseModel):
    reasoning_tokens: int = 0  # the output tokens before the reasoning block's end


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int = 0
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None
    completion_tokens_details: CompletionTokensDetails | None = None  # chats under --reasoning-parser


class CompletionLogprobs(BaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None  # vLLM's return_token_ids
    prompt_token_ids: list[int] | None = None


class CompletionResponse(BaseModel):
    id: str
    object: str = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob] | None = None


class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON text


class ToolCallItem(BaseModel):
    id: str
    type: str = "function"
    function: FunctionCall


class DeltaFunctionCall(BaseModel):
    name: str | None = None  # with the call's first piece
    arguments: str = ""  # more of the arguments' JSON text


class DeltaToolCall(BaseModel):
    index: int  # the call's place among the completion's calls
    id: str | None = None  # with the call's first piece
    type: str | None = "function"
    function: DeltaFunctionCall | None = None


class ChatResponseMessage(BaseModel):
    role: str = "assistant"
    content: str | None = None
    reasoning_content: str | None = None  # with --reasoning-parser (vLLM's field)
    tool_calls: list[ToolCallItem] = Field(default_factory=list)


class ChatChoice(BaseModel):
    index: int = 0
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: str = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage | None = None
    prompt_token_ids: list[int] | None = None


class DeltaMessage(BaseModel):
    role: str | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatStreamChoice(BaseModel):
    index: int = 0
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: str = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: str = "model"
    created: int
    owned_by: str = "deltaserve"
    root: str | None = None
    parent: str | None = None  # a LoRA adapter's base model
    max_model_len: int | None = None
    vocab_size: int | None = None  # deltaserve's: what random-token benchmarks draw ids below


class ModelList(BaseModel):
    object: str = "list"
    data: list[ModelCard]


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo
