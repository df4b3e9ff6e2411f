"""Structured output on the worker, through xgrammar: grammars compiled off the pass loop, one
matcher per constrained request, the bitmask of what each may sample next, and the draft check
that speculative decoding needs.

Where the state lives: every TP rank samples the same ids from the same logits, so each rank holds
its own matchers and advances them from the ids it sampled itself; the plan carries no bitmask
(248K tokens are 31 KB a row) and no rank waits on another. Under async scheduling pass N+1 may be
launched before pass N's ids reach the host: the runner launches N+1's forward first, then waits
for N's ids, advances the matchers and fills N+1's masks while the device runs that forward.

Compilation: `GrammarCompiler.prepare` compiles in a thread pool (xgrammar releases the GIL while it
compiles), once per grammar text per process; the driver learns from `RunnerOutput.grammars_ready`
when a grammar is ready and only then schedules the requests waiting on it.

xgrammar (and transformers, for the vocabulary) is imported on the first constrained request only.
"""

from __future__ import annotations

import functools
import json
import os
import re
import threading
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from deltaserve.workers.plan import GrammarSpec

if TYPE_CHECKING:
    import torch
    import xgrammar

MAX_CACHED_GRAMMARS = 256  # compiled grammars kept per process (a large schema's is a few MB)
COMPILE_THREADS = 2  # grammars compiled at once
ANY_OBJECT = '{"type": "object"}'
_PREFIX = re.compile(r"^\[[0-9:]+\] \S+:\d+: ")  # xgrammar's "[03:49:44] /path/file.cc:94: " prefix


def _xgr():
    import xgrammar

    return xgrammar


def error_text(error: BaseException, limit: int = 200) -> str:
    """xgrammar's message in one short line (its C++ log prefix dropped)."""
    lines = [line for line in str(error).strip().splitlines() if line.strip()]
    text = _PREFIX.sub("", lines[0] if lines else type(error).__name__)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def choice_ebnf(choices: Sequence[str]) -> str:
    """The EBNF of exactly one of `choices` (JSON string escapes, which xgrammar's EBNF reads)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def parse_grammar(spec: GrammarSpec) -> xgrammar.Grammar:
    """The spec as an xgrammar Grammar (parsing only: no vocabulary, milliseconds). Raises ValueError
    naming the field `structured_outputs.<kind>` when it does not compile. `spec.after`: any text
    up to the first `after` (a reasoning block and its end), then the constraint."""
    grammar = _constraint(spec)
    if not spec.after:
        return grammar
    from xgrammar import structural_tag as st

    free = st.TagFormat(begin="", content=st.AnyTextFormat(), end=spec.after)
    tail = st.GrammarFormat(grammar=str(grammar), syntax="ebnf")
    return _xgr().Grammar.from_structural_tag(st.StructuralTag(format=st.SequenceFormat(elements=[free, tail])))


def _constraint(spec: GrammarSpec) -> xgrammar.Grammar:
    xgr = _xgr()
    try:
        if spec.kind == "json":
            return _no_raw_controls(xgr.Grammar.from_json_schema(spec.text, any_whitespace=spec.any_whitespace))
        if spec.kind == "json_object":  # any object: an open schema, not xgrammar's strict default
            grammar = xgr.Grammar.from_json_schema(ANY_OBJECT, any_whitespace=spec.any_whitespace, strict_mode=False)
            return _no_raw_controls(grammar)
        if spec.kind == "regex":
            return xgr.Grammar.from_regex(spec.text)
        if spec.kind == "choice":
            return xgr.Grammar.from_ebnf(choice_ebnf(json.loads(spec.text)))
        if spec.kind == "grammar":
            return xgr.Grammar.from_ebnf(spec.text)
    except Exception as e:  # xgrammar raises RuntimeError (C++) or its own InvalidJSONError
        raise ValueError(f"structured_outputs.{spec.kind}: does not compile: {error_text(e)}") from None
    raise ValueError(f"structured_outputs: unknown constraint kind {spec.kind!r}")


# xgrammar 0.2.9 writes the characters of a JSON string with minLength / maxLength as this class,
# which lets a raw tab or other control character (U+0000-U+001F) into the string: not JSON, and
# Python's json.loads refuses it (xgrammar issue #800). Its own unbounded strings use the second.
_RAW_CONTROLS = r"[^\"\\\r\n]"
_NO_CONTROLS = r"[^\0-\x1f\"\\\r\n]"


def _no_raw_controls(grammar):
    """The grammar with control characters kept out of length-bounded JSON strings (through its
    EBNF, which xgrammar prints and parses back to the same grammar)."""
    text = str(grammar)
    if _RAW_CONTROLS not in text:
        return grammar
    return _xgr().Grammar.from_ebnf(text.replace(_RAW_CONTROLS, _NO_CONTROLS))


@functools.lru_cache(maxsize=4)  # engines built again in one process (tests, benchmarks) share it
def tokenizer_info(tokenizer_dir: str, vocab_size: int, stop_token_ids: tuple[int, ...]) -> xgrammar.TokenizerInfo:
    """xgrammar's view of the model's vocabulary (`tokenizer.json`, the engine's own tokenizer): ids
    up to the model's (padded) vocab_size, the model's EOS ids as the grammar's stop tokens. Reading
    a 248K vocabulary takes seconds."""
    path = Path(tokenizer_dir) / "tokenizer.json"
    if not path.is_file():
        raise FileNotFoundError(f"structured output needs the model's tokenizer.json; none at {path}")
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(path))
    # a config without EOS ids: xgrammar finds the tokenizer's own (it refuses an empty list)
    stops = list(stop_token_ids) or None
    return _xgr().TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=stops)


class GrammarCompiler:
    """Compiles GrammarSpecs in background threads, each key once per process (the last
    MAX_CACHED_GRAMMARS kept). The vocabulary is read on the first compile (about 2.5 s for 248K
    tokens, in the pool's thread). `take_ready()` hands over the keys finished since its last call."""

    def __init__(self, tokenizer_dir: str | Path | None, vocab_size: int, stop_token_ids: Sequence[int]):
        self.tokenizer_dir = tokenizer_dir
        self.vocab_size = vocab_size
        self.stop_token_ids = list(stop_token_ids)
        self._futures: OrderedDict[str, Future] = OrderedDict()
        self._ready: dict[str, str | None] = {}
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self._compiler = None
        self._compiler_lock = threading.Lock()

    def prepare(self, spec: GrammarSpec) -> Future:
        """The compile of `spec` (a Future of an xgrammar CompiledGrammar), started if new."""
        key = spec.key
        with self._lock:
            future = self._futures.get(key)
            if future is not None:
                self._futures.move_to_end(key)
                if future.done():  # asked again (a driver that lost track): report it again
                    self._ready[key] = _failure(future)
                return future
            if self._pool is None:
                self._pool = ThreadPoolExecutor(COMPILE_THREADS, thread_name_prefix="grammar")
            future = self._pool.submit(self._compile, spec)
            self._futures[key] = future
            while len(self._futures) > MAX_CACHED_GRAMMARS:
                self._futures.popitem(last=False)
        future.add_done_callback(lambda f: self._finished(key, f))
        return future

    def take_ready(self) -> dict[str, str | None]:
        """key -> None (compiled) or the error, for compiles finished since the last call."""
        with self._lock:
            ready, self._ready = self._ready, {}
        return ready

    def _finished(self, key: str, future: Future) -> None:
        with self._lock:
            self._ready[key] = _failure(future)

    def _compile(self, spec: GrammarSpec):
        return self.compiler().compile_grammar(parse_grammar(spec))

    def compiler(self) -> xgrammar.GrammarCompiler:
        with self._compiler_lock:
            if self._compiler is None:
                if self.tokenizer_dir is None:
                    raise FileNotFoundError("structured output needs the model's tokenizer.json; this model has none")
                info = tokenizer_info(str(self.tokenizer_dir), self.vocab_size, tuple(self.stop_token_ids))
                self._compiler = _xgr().GrammarCompiler(info, max_threads=_threads(), cache_enabled=False)
            return self._compiler

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)


def _failure(future: Future) -> str | None:
    error = future.exception()
    return None if error is None else _failure_text(error)


def _failure_text(error: BaseException) -> str:
    """Our own errors as they are (they name the field), xgrammar's cut to one line."""
    return str(error) if isinstance(error, ValueError | FileNotFoundError) else error_text(error)


def _threads() -> int:
    """Threads for xgrammar's own parallel work (a compile, a batch of masks): half the cores this
    process may use, at most 8 (every TP rank of a host runs its own)."""
    return max(1, min(8, len(os.sched_getaffinity(0)) // 2))


class RequestGrammar:
    """One request's grammar on a worker: its compile and, from its first sampled token on, an
    xgrammar GrammarMatcher fed every output token once the token is known on the host. A request
    that re-enters the running set (preempted, resumed) gets a new one that replays its outputs.
    `error` (None while all is well) says why the grammar cannot constrain it any more."""

    def __init__(self, key: str, compiled: Future, history: Sequence[int] = ()):
        self.key = key
        self._compiled = compiled
        self._history: list[int] | None = list(history)
        self.matcher: Any = None
        self.error: str | None = None

    def start(self) -> str | None:
        """Build the matcher (waiting for the compile if it still runs: only a request admitted
        before its grammar was reported ready) and replay the history; returns `error`."""
        if self.matcher is not None or self.error is not None:
            return self.error
        try:
            compiled = self._compiled.result()
        except Exception as e:
            self.error = f"structured_outputs: the grammar did not compile: {_failure_text(e)}"
            return self.error
        self.matcher = _xgr().GrammarMatcher(compiled)
        history, self._history = self._history, None
        for token in history:
            self.accept(token)
        return self.error

    def accept(self, token: int) -> str | None:
        """Advance by one sampled token; a token after the grammar's end (a pass that ran while the
        driver had not seen the end yet) is ignored: the driver drops it. Returns `error`."""
        if self.error is not None:
            return self.error
        if self.matcher is None:
            self._history.append(token)
        elif not self.matcher.is_terminated() and not self.matcher.accept_token(token):
            self.error = f"structured_outputs: token {token} is not allowed by the grammar"
        return self.error

    @property
    def terminated(self) -> bool:
        """The grammar accepted a stop token: nothing may follow."""
        return self.matcher is not None and self.matcher.is_terminated()

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Bitmask row `row` (int32 on the host) <- the tokens allowed next (`start()` first)."""
        self.matcher.fill_next_token_bitmask(bitmask, row)


def fill_bitmasks(grammars: Sequence[RequestGrammar], bitmask: torch.Tensor) -> None:
    """Row i of `bitmask` <- grammars[i]'s next tokens; a batch of them in xgrammar's threads."""
    if len(grammars) >= BATCH_FILL_MIN_ROWS:
        _batch_matcher().batch_fill_next_token_bitmask([g.matcher for g in grammars], bitmask)
    else:
        for row, grammar in enumerate(grammars):
            grammar.fill(bitmask, row)


BATCH_FILL_MIN_ROWS = 8
_BATCH = threading.local()


def _batch_matcher():
    if getattr(_BATCH, "matcher", None) is None:
        _BATCH.matcher = _xgr().BatchGrammarMatcher(max_threads=_threads())
    return _BATCH.matcher


# ---- speculative decoding ----------------------------------------------------------------------
# A verify pass over k draft tokens samples k + 1 positions: position j must be masked with what the
# grammar allows after draft[:j], and drafts past the first token the grammar rejects are not
# accepted whatever the model says. The helper leaves the matcher as it found it (rollback).


def fill_draft_bitmasks(matcher, draft: Sequence[int], bitmask: torch.Tensor, first_row: int = 0) -> int:
    """Rows first_row .. first_row + len(draft) of `bitmask` <- the masks of a verify pass over
    `draft`: row j allows what the grammar allows after draft[:j]. Rows past the first rejected
    draft token, or after the grammar's end, allow everything (their samples are discarded). Returns
    how many draft tokens the grammar accepts."""
    accepted = 0
    for j in range(len(draft) + 1):
        row = first_row + j
        if accepted < j or matcher.is_terminated():
            bitmask[row] = -1
            continue
        matcher.fill_next_token_bitmask(bitmask, row)
        if j < len(draft) and matcher.accept_token(int(draft[j])):
            accepted += 1
    if accepted:
        matcher.rollback(accepted)
    return accepted


def forced_draft(matcher, draft: Sequence[int], bitmask: torch.Tensor) -> list[int]:
    """The draft with each token the grammar refuses replaced by the grammar's own next token where it
    has one: the first of xgrammar's jump-forward tokens (the longest vocabulary tokens spelling what
    the grammar forces next: a JSON key, its quotes and colon) or the only token it allows (a stop
    token at its end). A refused draft is never accepted; where one token is allowed the masked target
    samples it, so that draft always is. Kept from the first refused token without a replacement on.
    bitmask: an int32 host row [1, words] to fill. Leaves the matcher as it found it (rollback)."""
    out = [int(t) for t in draft]
    advanced = 0
    for j, token in enumerate(out):
        if matcher.is_terminated():
            break
        if matcher.accept_token(token):
            advanced += 1
            continue
        jump = matcher.find_jump_forward_tokens()
        if jump:
            guess = int(jump[0])
        else:
            matcher.fill_next_token_bitmask(bitmask, 0)
            guess = only_allowed(bitmask[0])
        if guess is None or not matcher.accept_token(guess):
            break
        out[j] = guess
        advanced += 1
    if advanced:
        matcher.rollback(advanced)
    return out


def only_allowed(words: torch.Tensor) -> int | None:
    """The token a bitmask row (int32 words, bit t % 32 of word t // 32) allows, if it allows one."""
    row = words.numpy()
    nonzero = np.flatnonzero(row)
    if len(nonzero) != 1:
        return None
    word = int(row[nonzero[0]]) & 0xFFFFFFFF
    if word & (word - 1):
        return None
    return int(nonzero[0]) * 32 + word.bit_length() - 1
