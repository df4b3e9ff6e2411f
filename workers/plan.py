"""The two plain dataclasses that cross the driver/worker boundary: `PassPlan` (what one forward
pass runs) and `RunnerOutput` (the tokens it produced). Arrays are numpy, so the msgpack codec
(`workers/wire.py`) sends them as raw little-endian bytes.

Under async scheduling the plan of pass N+1 is built before pass N's tokens are known: a decode
row whose input is such a token says so in `input_from_prev`, and the worker fills it in on the
device from pass N's sampled ids (no host round trip).

Rows of a pass: the decode rows first (one new token each), then the prefill streams (a chunk of
one or more prompt tokens each). Whether a row is decode or prefill follows from its token count
and cached length; the scheduler has no phases.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import numpy as np

# Temperatures below this sample greedily (vLLM's threshold): dividing logits by a smaller one overflows
# float32, and a softmax of infinities is NaN, which would pick token 0 every time.
GREEDY_TEMPERATURE = 1e-5
# The sampler computes in float32: a larger finite float64 parameter would become inf there.
FLOAT32_MAX = 3.4028234663852886e38

GRAMMAR_KINDS = ("json", "json_object", "regex", "choice", "grammar")


@dataclass(frozen=True)
class GrammarSpec:
    """A structured-output constraint in canonical text (`workers/grammar.py` compiles it with
    xgrammar): `json` a JSON schema (compact, keys in the user's order), `json_object` any JSON object (text
    empty), `regex`, `choice` a JSON list of the strings, `grammar` EBNF; `after`: the constraint
    starts once free text has ended with this (a reasoning block's end). Equal texts share one
    compile on each worker, through `key`."""

    kind: str
    text: str
    any_whitespace: bool = True
    after: str = ""  # free text (the model's reasoning) up to this end first, then the constraint

    @property
    def key(self) -> str:
        raw = f"{self.kind}\0{int(self.any_whitespace)}\0{self.after}\0{self.text}".encode()
        return hashlib.sha256(raw).hexdigest()[:32]


@dataclass(frozen=True)
class PoolSizes:
    """The KV pages and GDN state slots every rank allocated (the smallest any rank could hold): the
    driver's allocators hand out exactly these, and a plan may address nothing beyond them."""

    num_blocks: int
    block_size: int
    num_slots: int  # running slots + the scratch slot
    num_snapshots: int = 0  # prefix-cache snapshot slots after them

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def total_slots(self) -> int:
        return self.num_slots + self.num_snapshots


@dataclass
class SamplingSpec:
    """What the worker's sampler needs of a request's SamplingParams (a plain, msgpack-able copy)."""

    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    # until min_tokens outputs exist these ids (EOS, stop ids) cannot be sampled
    min_tokens: int = 0
    min_tokens_banned_ids: list[int] = field(default_factory=list)
    # structured output: the worker masks the logits to what the grammar allows next
    grammar: GrammarSpec | None = None
    # [token id, bias] pairs added to the logits first (OpenAI's logit_bias)
    logit_bias: list[list] = field(default_factory=list)

    def __post_init__(self) -> None:
        if isinstance(self.grammar, dict):  # as msgpack brings it
            self.grammar = GrammarSpec(**self.grammar)

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE


@dataclass
class NewRequestData:
    """Sent once when a request (re)enters the running set: the worker's sampler keeps its params
    and token history (prompt + outputs so far, so that penalties and seeds survive preemption)."""

    req_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    sampling: SamplingSpec


@dataclass
class LoraLoad:
    """An adapter to place in a device slot before the pass runs (the driver picks slots, LRU):
    `key` names this registration of the adapter (a rank's host cache of loaded adapters is keyed by
    it), `name` and `path` the adapter folder (PEFT: adapter_config.json + adapter_model.safetensors)."""

    slot: int
    key: int
    name: str
    path: str


@dataclass
class PassPlan:
    pass_id: int
    req_ids: list[str]  # N rows
    num_decode_rows: int
    input_ids: np.ndarray  # [T] int32
    positions: np.ndarray  # [T] int32
    slot_mapping: np.ndarray  # [T] int64: page * block_size + offset
    query_start_loc: np.ndarray  # [N + 1] int32: cu_seqlens over all rows
    seq_lens: np.ndarray  # [N] int32: tokens cached after this pass
    block_tables: np.ndarray  # [N, max_pages] int32 (padded with 0)
    state_slots: np.ndarray  # [N] int32
    has_initial_state: np.ndarray  # [N] bool: cached tokens exist before this pass
    sample_rows: np.ndarray  # [N] bool: the row's last token yields a sampled token
    prompt_logprob_rows: np.ndarray  # [N] bool: return prompt logprobs for this row's tokens
    # [N] int32: the token right after the row's chunk (-1: none or not known yet), so that the chunk's
    # last position gets a prompt logprob too and the MTP head its next token (a preempted request's
    # recomputed chunk may end before one of its output tokens)
    next_prompt_token: np.ndarray | None = None
    # [N] int32 (async scheduling): -1, or j: the row is one decode token whose id is not known on
    # the driver yet (input_ids holds a placeholder); the runner takes it on the device from entry j
    # of the sampled ids of the previous pass (pass_id - 1, its sampling rows in plan order)
    input_from_prev: np.ndarray | None = None
    # Prefix caching (GDN state at other positions, done before the forward in this order):
    # [M, 2] int32 (running slot, snapshot slot): snapshot saves (a finished or preempted request's
    # state); [M, 2] (snapshot slot, running slot): restores (a request resuming from a snapshot);
    # [M, 2] (page, page): KV page copies (a snapshot's partly filled page for a resuming request)
    slot_saves: np.ndarray | None = None
    slot_restores: np.ndarray | None = None
    page_copies: np.ndarray | None = None
    # [M, 3] int32 (row, tokens of the row's chunk before the captured point, snapshot slot): GDN
    # state captured inside a prefill row's chunk (the seed's MidchunkCapture)
    captures: np.ndarray | None = None
    # Speculative decoding (MTP): k > 0 when the decode rows are verify rows of k + 1 tokens each (the
    # request's last token, then its k drafts); [N] bool: the rows after which the MTP head drafts k
    # tokens for the request's next verify (with k > 0 every verify row is one)
    num_spec_tokens: int = 0
    draft_rows: np.ndarray | None = None
    # LoRA: [N] int32, each row's adapter slot (-1: the base model); None: no row has an adapter.
    # lora_loads: adapters placed in slots before the forward (a slot a row names holds its adapter)
    lora_slots: np.ndarray | None = None
    lora_loads: list[LoraLoad] = field(default_factory=list)
    new_requests: list[NewRequestData] = field(default_factory=list)
    finished_req_ids: list[str] = field(default_factory=list)
    # grammars the workers start compiling now, in the background (requests that will need them
    # wait on the driver until a RunnerOutput reports them in `grammars_ready`)
    grammars: list[GrammarSpec] = field(default_factory=list)

    @property
    def num_rows(self) -> int:
        return len(self.req_ids)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])


@dataclass
class TokenLogprobs:
    """Logprobs at one position: the top-k token ids and logprobs (k may be 0), and the chosen
    token's own logprob and rank (1 = most likely)."""

    token_id: int
    logprob: float
    rank: int
    top_ids: list[int]
    top_logprobs: list[float]


@dataclass
class RunnerOutput:
    pass_id: int
    req_ids: list[str]  # the rows that sampled, in plan order
    sampled_token_ids: list[int]
    logprobs: dict[str, TokenLogprobs] = field(default_factory=dict)
    # req_id -> logprobs of the prompt tokens this pass covered (token i given tokens < i)
    prompt_logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)
    forward_time_s: float = 0.0
    # with RunnerConfig.time_passes on a GPU (else -1): device time from the pass's first to last
    # operation, and the device's idle time between the previous pass's last operation and its first
    device_busy_s: float = -1.0
    device_gap_s: float = -1.0
    # structured output: grammar key -> None (compiled on this rank since its last output) or the
    # compile error; req_id -> why its grammar failed it (its token of this pass is not valid)
    grammars_ready: dict[str, str | None] = field(default_factory=dict)
    grammar_errors: dict[str, str] = field(default_factory=dict)
    # speculative decoding: req_id -> the tokens a verify row emitted after the first (its accepted
    # drafts are those it emitted but the last) and their logprobs; req_id -> the drafts of its next
    # verify
    extra_token_ids: dict[str, list[int]] = field(default_factory=dict)
    extra_logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)
    draft_token_ids: dict[str, list[int]] = field(default_factory=dict)
