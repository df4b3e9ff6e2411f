"""Token sampling on the worker (every TP rank; logprobs on rank 0 only): penalties, temperature,
top-k / top-p / min-p, and the draw itself; plus logprobs of sampled and prompt tokens.

The draw is an exponential race, argmax(p / E) with E ~ Exp(1) per vocabulary entry, which samples
exactly from p. For a request with a seed, E comes from a counter-based hash of (seed, output index,
token id): the same request gives the same tokens whatever else is in the batch, on CPU or GPU, and
after a preemption.

Nothing here waits for the device: `sample_async` leaves the tokens (and logprob tensors) on the
device and registers their copies to the host with a `HostCopy`; `SampledBatch.result()` reads them
once copied and only then records the ids in each request's history. Under async scheduling a
request's latest token may still be on its way when the next pass samples it: the output counter
(`num_sampled`, the seeded draw's index) counts it already, and penalties take its id from the
device (`pending_rows` / `pending_tokens`).

Structured output (`workers/grammar.py`): a constrained row's logits are masked, in place and before
anything else (so its logprobs are those of the constrained distribution, as vLLM's), to the tokens
its grammar allows next, for greedy and sampled rows alike; the mask needs the row's latest token
known on the host (the runner waits for the previous pass's ids first), and `SampledBatch.result()`
advances each grammar with its token.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch

from deltaserve.layers.kernels import argmax as argmax_kernels
from deltaserve.layers.kernels import bitmask as bitmask_kernels
from deltaserve.workers.context import HostCopy, upload
from deltaserve.workers.grammar import (
    GrammarCompiler,
    RequestGrammar,
    fill_bitmasks,
    fill_draft_bitmasks,
    forced_draft,
)
from deltaserve.workers.plan import FLOAT32_MAX, GrammarSpec, NewRequestData, SamplingSpec, TokenLogprobs
from deltaserve.workers.rejection import accept_drafts

_M32 = 0xFFFFFFFF


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (xorshift-multiply) on int64 tensors holding values in [0, 2**32)."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _M32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _M32
    return x ^ (x >> 16)


def _mix32_int(x: int) -> int:
    x ^= x >> 16
    x = (x * 0x7FEB352D) & _M32
    x ^= x >> 15
    x = (x * 0x846CA68B) & _M32
    return x ^ (x >> 16)


def seeded_exponentials(seed: int, step: int, vocab_size: int, device) -> torch.Tensor:
    """Exp(1) noise [vocab_size] determined by (seed, step) alone."""
    base = _mix32_int(_mix32_int(_mix32_int((seed & _M32) ^ 0x9E3779B9) ^ (seed >> 32) & _M32) ^ (step & _M32))
    idx = torch.arange(vocab_size, device=device, dtype=torch.int64)
    bits = _mix32(_mix32(idx ^ base) ^ 0x5BD1E995)
    uniform = (bits.double() + 0.5) / 2.0**32
    return (-torch.log(uniform)).float()


class _AtDraft:
    """A verify row's position as the decode step it stands for: the request's outputs followed by
    the drafts before the position (what its penalties and min_tokens bans count)."""

    __slots__ = ("spec", "prompt_token_ids", "output_token_ids", "num_sampled", "grammar")

    def __init__(self, state: RequestSamplingState, drafts_before: list[int]):
        self.spec = state.spec
        self.prompt_token_ids = state.prompt_token_ids
        self.output_token_ids = state.output_token_ids + drafts_before
        self.num_sampled = state.num_sampled + len(drafts_before)
        self.grammar = None


class RequestSamplingState:
    def __init__(self, data: NewRequestData, grammar: RequestGrammar | None = None):
        self.spec: SamplingSpec = data.sampling
        self.prompt_token_ids = list(data.prompt_token_ids)
        # the output ids known on the host (a token whose pass is not resolved yet is missing)
        self.output_token_ids = list(data.output_token_ids)
        # outputs sampled so far, known or still on the device: the index of the next draw
        self.num_sampled = len(self.output_token_ids)
        self.grammar = grammar  # structured output: what the next token may be


def logprob_tensors(logits: torch.Tensor, tokens: torch.Tensor, k: int):
    """On the device: log-softmax of logits [R, V], then per row the logprob of tokens[r], its rank
    (1 = most likely) and the top-k (values, ids) (None when k = 0; at most V of them). Every logprob
    is finite: an infinite logit counts as the largest finite float32 (a log-softmax over +inf is NaN),
    and a token ruled out gets the lowest one, not -inf (which JSON cannot carry)."""
    lp = torch.log_softmax(logits.float().clamp(-FLOAT32_MAX, FLOAT32_MAX), dim=-1).clamp_(min=-FLOAT32_MAX)
    chosen = lp.gather(1, tokens.view(-1, 1))
    rank = (lp > chosen).sum(dim=1) + 1
    k = min(k, lp.shape[-1])
    top = torch.topk(lp, k, dim=-1) if k else None
    return chosen.view(-1), rank, top


class LogprobParts:
    """`logprob_tensors` registered with a HostCopy; `result(ks)` builds the TokenLogprobs."""

    def __init__(self, copy: HostCopy, tokens: torch.Tensor, logits: torch.Tensor, kmax: int):
        chosen, rank, top = logprob_tensors(logits, tokens, kmax)
        self.copy = copy
        self.slots = [copy.add(tokens), copy.add(chosen), copy.add(rank)]
        if top is not None:
            self.slots += [copy.add(top.values), copy.add(top.indices)]

    def result(self, ks: Sequence[int]) -> list[TokenLogprobs]:
        tokens, chosen, rank = (self.copy.get(s).tolist() for s in self.slots[:3])
        top_lp, top_ids = (self.copy.get(s).tolist() for s in self.slots[3:]) if len(self.slots) > 3 else ([], [])
        out = []
        for r, k in enumerate(ks):
            ids, lps = (top_ids[r][:k], top_lp[r][:k]) if k else ([], [])
            out.append(
                TokenLogprobs(token_id=int(tokens[r]), logprob=chosen[r], rank=rank[r], top_ids=ids, top_logprobs=lps)
            )
        return out


class SampledBatch:
    """One `sample_async` call: `tokens` [R] (int64) stays on the device (the next pass may read its
    input ids from it); `result()` waits for the host copies, records the ids in the request
    histories (and grammars) and returns (ids, logprobs by request id). `grammar_errors`: req_id ->
    why its grammar failed it (its token here is not constrained), complete once `result()` ran."""

    def __init__(self, req_ids, states, tokens, copy, logprob_rows, logprobs: LogprobParts | None, grammar_errors=None):
        self.req_ids = req_ids
        self.states = states  # the state objects sampled: a request id re-added later is another state
        self.tokens = tokens
        self._copy = copy
        self._tokens_slot = copy.add(tokens)
        self._logprob_rows = logprob_rows
        self._logprobs = logprobs
        self.grammar_errors: dict[str, str] = grammar_errors or {}
        self._result = None

    def result(self) -> tuple[list[int], dict[str, TokenLogprobs]]:
        if self._result is None:
            token_list = self._copy.get(self._tokens_slot).tolist()
            for req_id, state, token in zip(self.req_ids, self.states, token_list, strict=True):
                state.output_token_ids.append(token)
                if state.grammar is not None and state.grammar.accept(token) is not None:
                    self.grammar_errors.setdefault(req_id, state.grammar.error)
            logprobs = {}
            if self._logprobs is not None:
                ks = [self.states[i].spec.logprobs for i in self._logprob_rows]
                for i, entry in zip(self._logprob_rows, self._logprobs.result(ks), strict=True):
                    logprobs[self.req_ids[i]] = entry
            self._result = token_list, logprobs
        return self._result


class VerifyBatch:
    """One `sample_verify` call: `sampled` [N, L] and `num_accepted` [N] stay on the device (write-on-
    accept and the MTP head read them); `result()` waits for their host copies, records each row's
    emitted tokens (sampled[n, : num_accepted[n] + 1]) in its request's history and returns (the
    emitted ids per row, their logprobs by request id)."""

    def __init__(
        self,
        req_ids,
        states,
        sampled,
        num_accepted,
        copy,
        logprob_rows,
        logprobs: LogprobParts | None,
        grammar_errors: dict[str, str] | None = None,
    ):
        self.req_ids, self.states = req_ids, states
        self.sampled, self.num_accepted = sampled, num_accepted
        self._copy = copy
        self._slots = (copy.add(sampled), copy.add(num_accepted))
        self._logprob_rows, self._logprobs = logprob_rows, logprobs
        self.grammar_errors: dict[str, str] = grammar_errors or {}
        self._result = None

    def result(self) -> tuple[list[list[int]], dict[str, list[TokenLogprobs]]]:
        if self._result is None:
            sampled, accepted = (self._copy.get(s).tolist() for s in self._slots)
            length = len(sampled[0]) if sampled else 0
            emitted = [row[: a + 1] for row, a in zip(sampled, accepted, strict=True)]
            for req_id, state, tokens in zip(self.req_ids, self.states, emitted, strict=True):
                state.output_token_ids.extend(tokens)
                state.num_sampled += len(tokens)
                if state.grammar is not None:  # every emitted token, as decoding would have fed them
                    for token in tokens:
                        if state.grammar.accept(token) is not None:
                            self.grammar_errors.setdefault(req_id, state.grammar.error)
                            break
            logprobs: dict[str, list[TokenLogprobs]] = {}
            if self._logprobs is not None:
                rows = self._logprob_rows  # expanded rows: request n's position i is n * length + i
                ks = [self.states[i // length].spec.logprobs for i in rows]
                for i, entry in zip(rows, self._logprobs.result(ks), strict=True):
                    n, position = divmod(i, length)
                    if position <= accepted[n]:
                        logprobs.setdefault(self.req_ids[n], []).append(entry)
            self._result = emitted, logprobs
        return self._result


class Sampler:
    def __init__(self, vocab_size: int, seed: int = 0, pdl: bool = True, grammars: GrammarCompiler | None = None):
        self.vocab_size = vocab_size
        self.pdl = pdl  # the argmax kernel's launch (KernelOptions.pdl)
        self.states: dict[str, RequestSamplingState] = {}
        # structured output's compiles (no tokenizer: a constrained request fails with that error)
        self.grammars = grammars or GrammarCompiler(None, vocab_size, ())
        self.generator_seed = seed
        self._generators: dict[torch.device, torch.Generator] = {}

    def _generator(self, device: torch.device) -> torch.Generator:
        if device not in self._generators:
            self._generators[device] = torch.Generator(device=device).manual_seed(self.generator_seed)
        return self._generators[device]

    # ---- request bookkeeping ------------------------------------------------------------------
    def add(self, data: NewRequestData) -> None:
        spec = data.sampling.grammar
        grammar = None
        if spec is not None:
            grammar = RequestGrammar(spec.key, self.grammars.prepare(spec), data.output_token_ids)
        self.states[data.req_id] = RequestSamplingState(data, grammar)

    def prepare_grammar(self, spec: GrammarSpec) -> None:
        """Start compiling a grammar that requests will need (in the background)."""
        self.grammars.prepare(spec)

    def constrained(self, req_ids: Sequence[str]) -> bool:
        """Whether one of these requests follows a grammar."""
        return any(self.states[r].grammar is not None for r in req_ids)

    def needs_known_history(self, req_ids: Sequence[str]) -> bool:
        """Whether one of these requests is constrained and its latest sampled token is not known on
        the host yet (its grammar cannot say what may follow until it is)."""
        for r in req_ids:
            state = self.states[r]
            if state.grammar is not None and state.num_sampled > len(state.output_token_ids):
                return True
        return False

    def remove(self, req_id: str) -> None:
        self.states.pop(req_id, None)

    # ---- sampling ------------------------------------------------------------------------------
    def compile_warmup(self, logits: torch.Tensor) -> None:
        """Run the sampler's one Triton kernel (the greedy argmax) on logits [R, V] in their dtype and
        in float32 (what penalties leave), results dropped: it compiles at start-up, not on a
        server's first greedy request (a stall for every running request)."""
        for rows in (logits, logits.float()):
            argmax_kernels.row_argmax(logits=rows, pdl=self.pdl)
        if logits.is_cuda:  # structured output's mask kernel, every row or some, on a copy (all allowed)
            words = -(-logits.shape[1] // 32)
            mask = torch.full((1, words), -1, dtype=torch.int32, device=logits.device)
            for rows in (None, torch.zeros(1, dtype=torch.long, device=logits.device)):
                bitmask_kernels.apply_token_bitmask(logits=logits[:1].clone(), bitmask=mask, rows=rows)

    def sample(self, req_ids: list[str], logits: torch.Tensor) -> tuple[list[int], dict[str, TokenLogprobs]]:
        """One token for each row of logits [R, V] (any float dtype), waited for; records it in the history."""
        if not req_ids:
            return [], {}
        copy = HostCopy(logits.device)
        batch = self.sample_async(req_ids, logits, copy)
        copy.record()
        return batch.result()

    def sample_async(
        self,
        req_ids: list[str],
        logits: torch.Tensor,
        copy: HostCopy,
        pending_rows: Sequence[int] = (),
        pending_tokens: Callable[[], torch.Tensor] | None = None,
        logprobs: bool = True,
    ) -> SampledBatch:
        """One token for each row of logits [R, V] (any float dtype), left on the device. `pending_rows`:
        rows whose request's latest output id is not in its history yet; `pending_tokens()` gives
        those ids [P] on the device (called only when penalties need them). `logprobs=False`
        (TP ranks other than 0) skips the requests' logprobs."""
        states = [self.states[r] for r in req_ids]
        steps = [s.num_sampled for s in states]
        grammar_errors = {}
        if any(s.grammar is not None for s in states):
            logits = self._apply_grammars(req_ids, states, logits, grammar_errors)
        raw = logits
        if any(_needs_penalties(s) for s in states):
            logits = logits.to(torch.float32, memory_format=torch.contiguous_format, copy=True)
            self._apply_penalties(logits, states, pending_rows, pending_tokens)
        tokens = self._tokens(logits, states, steps)
        for s in states:
            s.num_sampled += 1
        want, parts = self._logprob_parts(states, tokens, raw, copy, logprobs)
        return SampledBatch(req_ids, states, tokens, copy, want, parts, grammar_errors)

    def _apply_grammars(self, req_ids, states, logits: torch.Tensor, errors: dict[str, str]) -> torch.Tensor:
        """Mask each constrained row of logits [R, V] to what its grammar allows next (in place; the
        logits returned are those masked). The masks are filled on the host into fresh pinned memory
        and copied without blocking: a buffer is never reused while a copy may still read it."""
        rows = _constrained(req_ids, states, errors)
        grammars = [states[i].grammar for i in rows]
        if not rows:
            return logits
        device = logits.device
        words = -(-logits.shape[1] // 32)
        host = torch.empty((len(rows), words), dtype=torch.int32, pin_memory=device.type == "cuda")
        fill_bitmasks(grammars, host)
        mask = host.to(device, non_blocking=True)
        if logits.stride(1) != 1:
            logits = logits.contiguous()
        ids = None
        if len(rows) < len(states):
            (ids,) = upload([np.asarray(rows)], device)
        with torch.inference_mode():  # the forward's logits are inference tensors
            bitmask_kernels.apply_token_bitmask(logits=logits, bitmask=mask, rows=ids)
        return logits

    def sample_verify(
        self,
        req_ids: list[str],
        logits: torch.Tensor,
        drafts: torch.Tensor,
        copy: HostCopy,
        logprobs: bool = True,
        host_drafts: np.ndarray | None = None,
    ) -> VerifyBatch:
        """Speculative verify rows: logits [N * L, V] (each row's L = k + 1 positions in order), drafts
        [N, k] on the device (and on the host, `host_drafts`, for constrained rows). Position i of a row
        is sampled as decoding would sample the request's output number num_sampled + i (its seeded
        draw included), its penalties and min_tokens bans counting the drafts before it; `accept_drafts`
        keeps the drafts up to the first mismatch (workers/rejection.py says why that is the rejection
        scheme for greedy drafts). A constrained row's position i is
        masked to what its grammar allows after the drafts before it (the drafts past one the grammar
        refuses are never accepted: the masked sample cannot equal it), so the emitted tokens are those
        constrained decoding samples. Nothing waits for the device; the requests' counters (and
        grammars) move when the result is read."""
        states = [self.states[r] for r in req_ids]
        length = logits.shape[0] // max(1, len(states))
        needs_drafts = any(s.grammar is not None or _needs_history(s) for s in states)
        if needs_drafts and host_drafts is None:
            raise ValueError("verify rows with a grammar, penalties or min_tokens bans need their drafts on the host")
        grammar_errors: dict[str, str] = {}
        if any(s.grammar is not None for s in states):
            logits = self._apply_verify_grammars(req_ids, states, logits, host_drafts, length, grammar_errors)
        # position j of a row stands for the decode step after the row's drafts[:j]: its penalties and
        # min_tokens bans count them
        expanded = [
            _AtDraft(s, host_drafts[n][:j].tolist()) if _needs_history(s) else s
            for n, s in enumerate(states)
            for j in range(length)
        ]
        raw = logits  # logprobs are the model's (masked), before bias and penalties, as decoding reports them
        if any(_needs_penalties(s) for s in expanded):
            logits = logits.to(torch.float32, memory_format=torch.contiguous_format, copy=True)
            self._apply_penalties(logits, expanded)
        tokens = self._tokens(logits, expanded, [s.num_sampled + i for s in states for i in range(length)])
        sampled = tokens.view(len(states), length)
        num_accepted = accept_drafts(sampled, drafts)
        want, parts = self._logprob_parts(expanded, tokens, raw, copy, logprobs)
        return VerifyBatch(req_ids, states, sampled, num_accepted, copy, want, parts, grammar_errors)

    def _apply_verify_grammars(
        self, req_ids, states, logits: torch.Tensor, drafts: np.ndarray, length: int, errors: dict[str, str]
    ) -> torch.Tensor:
        """Mask the positions of each constrained verify row (logits [N * L, V], in place): position j
        to what the grammar allows after the row's drafts[:j] (grammar.fill_draft_bitmasks)."""
        owners = _constrained(req_ids, states, errors)
        if not owners:
            return logits
        device = logits.device
        words = -(-logits.shape[1] // 32)
        host = torch.empty((len(owners) * length, words), dtype=torch.int32, pin_memory=device.type == "cuda")
        for i, n in enumerate(owners):
            fill_draft_bitmasks(states[n].grammar.matcher, drafts[n].tolist(), host, first_row=i * length)
        mask = host.to(device, non_blocking=True)
        if logits.stride(1) != 1:
            logits = logits.contiguous()
        (rows,) = upload([np.asarray([n * length + j for n in owners for j in range(length)])], device)
        with torch.inference_mode():
            bitmask_kernels.apply_token_bitmask(logits=logits, bitmask=mask, rows=rows)
        return logits

    def grammar_drafts(self, req_ids: Sequence[str], drafts: list[list[int]]) -> list[list[int]]:
        """The next pass's drafts, each constrained request's with the tokens its grammar forces in
        place of those it refuses (grammar.forced_draft): a position with one allowed token is always
        accepted, whatever the MTP head guessed. Read after this pass's tokens advanced the grammars;
        the emitted tokens stay decoding's (a draft only decides how many of them one pass keeps)."""
        bitmask = None
        for n, req_id in enumerate(req_ids):
            state = self.states.get(req_id)
            grammar = None if state is None else state.grammar
            if grammar is None or grammar.matcher is None or grammar.error is not None:
                continue
            if bitmask is None:
                bitmask = torch.empty((1, -(-self.vocab_size // 32)), dtype=torch.int32)
            drafts[n] = forced_draft(grammar.matcher, drafts[n], bitmask)
        return drafts

    def is_plain_greedy(self, req_ids: Sequence[str]) -> bool:
        """Whether every request samples by argmax alone, without logprobs or penalties: their verify
        rows can run inside a CUDA graph."""
        for r in req_ids:
            state = self.states[r]
            if not state.spec.greedy or state.spec.logprobs is not None or _needs_penalties(state):
                return False
            if state.grammar is not None:  # its mask is applied here, not inside a graph
                return False
        return True

    def verified(
        self, req_ids: list[str], sampled: torch.Tensor, num_accepted: torch.Tensor, copy: HostCopy
    ) -> VerifyBatch:
        """A VerifyBatch of greedy verify rows sampled elsewhere (a CUDA graph's argmax and acceptance)."""
        if not self.is_plain_greedy(req_ids):
            raise ValueError("only greedy verify rows without logprobs run outside the sampler")
        return VerifyBatch(req_ids, [self.states[r] for r in req_ids], sampled, num_accepted, copy, [], None)

    def _tokens(self, logits: torch.Tensor, states: list[RequestSamplingState], steps: list[int]) -> torch.Tensor:
        """One token per row of logits [R, V]: the argmax for greedy requests, a draw (seeded at
        `steps[i]` for a request with a seed) for the others."""
        greedy = [s.spec.greedy for s in states]
        if all(greedy):  # one argmax, no gathers
            return argmax_kernels.row_argmax(logits=logits, pdl=self.pdl)
        random_rows = [i for i, g in enumerate(greedy) if not g]
        if len(random_rows) == len(states):
            return self._draw(logits, states, steps)
        tokens = argmax_kernels.row_argmax(logits=logits, pdl=self.pdl)
        (rows,) = upload([np.asarray(random_rows)], logits.device)
        drawn = self._draw(
            logits.index_select(0, rows), [states[i] for i in random_rows], [steps[i] for i in random_rows]
        )
        tokens.index_copy_(0, rows, drawn)
        return tokens

    def _logprob_parts(
        self, states: list[RequestSamplingState], tokens: torch.Tensor, raw: torch.Tensor, copy: HostCopy, on: bool
    ) -> tuple[list[int], LogprobParts | None]:
        """The rows whose request wants logprobs, and their logprob tensors (None: no such row)."""
        want = [i for i, s in enumerate(states) if s.spec.logprobs is not None] if on else []
        if not want:
            return want, None
        kmax = max(states[i].spec.logprobs for i in want)
        if len(want) == len(states):
            return want, LogprobParts(copy, tokens, raw, kmax)
        (rows,) = upload([np.asarray(want)], raw.device)
        return want, LogprobParts(copy, tokens.index_select(0, rows), raw.index_select(0, rows), kmax)

    def _apply_penalties(
        self,
        logits: torch.Tensor,
        states: list[RequestSamplingState],
        pending_rows: Sequence[int] = (),
        pending_tokens: Callable[[], torch.Tensor] | None = None,
    ) -> None:
        """In place on logits [R, V] (contiguous), row i for states[i]: the logit bias, the repetition
        penalty, then presence and frequency penalties, then min_tokens bans; built as flat index lists on the host
        and applied with device-side fills (no host sync). A penalty that overflows float32 leaves the
        largest finite value (an infinite logit would make the draw's softmax NaN)."""
        device, vocab = logits.device, logits.shape[1]
        flat_logits = logits.view(-1)
        pending = {row: j for j, row in enumerate(pending_rows)}
        pending_ids = None

        def pending_for(rows: list[int]) -> tuple[torch.Tensor, torch.Tensor] | None:
            """(flat row offsets, ids) on the device for the pending tokens of `rows`."""
            nonlocal pending_ids
            mine = [r for r in rows if r in pending]
            if not mine:
                return None
            if pending_ids is None:
                pending_ids = pending_tokens()
            at, offsets = upload([np.asarray([pending[r] for r in mine]), np.asarray(mine) * vocab], device)
            return offsets, pending_ids.index_select(0, at)

        _add_logit_bias(logits, states)  # OpenAI's logit_bias, before the penalties

        rep = [i for i, s in enumerate(states) if s.spec.repetition_penalty != 1.0]
        if rep:
            seen_ids = [
                i * vocab + np.unique(np.asarray(states[i].prompt_token_ids + states[i].output_token_ids, np.int64))
                for i in rep
            ]
            penalty = np.ones((len(states), 1), np.float32)
            penalty[rep, 0] = np.minimum([states[i].spec.repetition_penalty for i in rep], FLOAT32_MAX)
            flat, penalty = upload([np.concatenate(seen_ids)], device) + upload([penalty], device, torch.float32)
            seen = torch.zeros(logits.numel(), dtype=torch.bool, device=device)
            seen.index_fill_(0, flat, True)
            extra = pending_for(rep)
            if extra is not None:
                seen.index_fill_(0, extra[0] + extra[1], True)
            seen = seen.view_as(logits)
            penalised = torch.where(logits > 0, logits / penalty, logits * penalty)
            logits.copy_(torch.where(seen, penalised, logits))

        pf = [i for i, s in enumerate(states) if s.spec.presence_penalty or s.spec.frequency_penalty]
        if pf:
            out_ids = [i * vocab + np.asarray(states[i].output_token_ids, np.int64) for i in pf]
            scale = np.zeros((2, len(states), 1), np.float32)
            scale[0, pf, 0] = [states[i].spec.frequency_penalty for i in pf]
            scale[1, pf, 0] = [states[i].spec.presence_penalty for i in pf]
            (flat,) = upload([np.concatenate(out_ids)], device)
            (scale,) = upload([scale], device, torch.float32)
            counts = torch.zeros(logits.numel(), dtype=logits.dtype, device=device)
            counts.index_add_(0, flat, torch.ones(flat.shape[0], dtype=logits.dtype, device=device))
            extra = pending_for(pf)
            if extra is not None:
                counts.index_add_(
                    0, extra[0] + extra[1], torch.ones(extra[0].shape[0], dtype=logits.dtype, device=device)
                )
            counts = counts.view_as(logits)
            logits -= scale[0] * counts + scale[1] * (counts > 0).to(logits.dtype)

        if rep or pf:  # a zero logit times an infinite penalty is NaN: that token is as unlikely as can be
            torch.nan_to_num_(logits, nan=-FLOAT32_MAX, posinf=FLOAT32_MAX, neginf=-FLOAT32_MAX)
        banned = [
            i * vocab + t
            for i, s in enumerate(states)
            if s.num_sampled < s.spec.min_tokens
            for t in s.spec.min_tokens_banned_ids
        ]
        if banned:
            (flat,) = upload([np.asarray(banned)], device)
            flat_logits.index_fill_(0, flat, float("-inf"))

    def _draw(self, logits: torch.Tensor, states: list[RequestSamplingState], steps: list[int]) -> torch.Tensor:
        device = logits.device
        (temps,) = upload([np.asarray([s.spec.temperature for s in states], np.float32)], device, torch.float32)
        logits = logits.float()
        # shifted by the row's largest logit first: logits / a small temperature overflow, shifted ones
        # only reach -inf (probability 0), never inf - inf = NaN
        logits = (logits - logits.amax(dim=-1, keepdim=True)) / temps[:, None]
        if any(s.spec.top_k > 0 or s.spec.top_p < 1.0 or s.spec.min_p > 0 for s in states):
            logits = _filter(logits, states)
        probs = torch.softmax(logits, dim=-1)
        unseeded = [i for i, s in enumerate(states) if s.spec.seed is None]
        if len(unseeded) == len(states):
            noise = torch.empty_like(probs).exponential_(generator=self._generator(device))
        else:
            noise = torch.empty_like(probs)
            if unseeded:
                (rows,) = upload([np.asarray(unseeded)], device)
                drawn = torch.empty((len(unseeded), probs.shape[1]), device=device, dtype=probs.dtype)
                noise.index_copy_(0, rows, drawn.exponential_(generator=self._generator(device)))
            for i, s in enumerate(states):
                if s.spec.seed is not None:
                    noise[i] = seeded_exponentials(s.spec.seed, steps[i], probs.shape[1], device)
        return (probs / noise).argmax(dim=-1)

    def prompt_logprobs(self, logits: torch.Tensor, next_tokens: list[int], k: int) -> list[TokenLogprobs]:
        """Logprobs of next_tokens[i] under logits[i] (one prompt position each), waited for."""
        copy = HostCopy(logits.device)
        (tokens,) = upload([np.asarray(next_tokens)], logits.device)
        parts = LogprobParts(copy, tokens, logits[: len(next_tokens)], k)
        copy.record()
        return parts.result([k] * len(next_tokens))


def _constrained(req_ids, states, errors: dict[str, str]) -> list[int]:
    """The rows whose grammar masks them: started, not failed (a failed one goes into `errors`: it is
    sampled unconstrained and the driver fails the request), not past its end (that token is dropped
    on the driver)."""
    rows = []
    for i, state in enumerate(states):
        grammar = state.grammar
        if grammar is None:
            continue
        if grammar.start() is not None:
            errors[req_ids[i]] = grammar.error
        elif not grammar.terminated:
            rows.append(i)
    return rows


def _needs_penalties(state: RequestSamplingState) -> bool:
    return bool(state.spec.logit_bias) or _needs_history(state)


def _needs_history(state: RequestSamplingState) -> bool:
    """Whether a row's logits change with the request's own history (penalties, min_tokens bans)."""
    spec = state.spec
    return (
        spec.repetition_penalty != 1.0
        or bool(spec.presence_penalty or spec.frequency_penalty)
        or (state.num_sampled < spec.min_tokens and bool(spec.min_tokens_banned_ids))
    )


def _add_logit_bias(logits: torch.Tensor, states: list[RequestSamplingState]) -> None:
    """In place on logits [R, V] (contiguous): row i += states[i]'s logit_bias."""
    biased = [i for i, s in enumerate(states) if s.spec.logit_bias]
    if not biased:
        return
    vocab = logits.shape[1]
    ids = np.concatenate([i * vocab + np.asarray([t for t, _ in states[i].spec.logit_bias]) for i in biased])
    values = np.concatenate([np.asarray([b for _, b in states[i].spec.logit_bias]) for i in biased])
    flat, values = upload([ids], logits.device) + upload([values], logits.device, logits.dtype)
    logits.view(-1).index_add_(0, flat, values)


def _filter(logits: torch.Tensor, states: list[RequestSamplingState]) -> torch.Tensor:
    """top-k, then top-p, then min-p, per row (-inf for removed tokens)."""
    device, vocab = logits.device, logits.shape[1]
    (top_k,) = upload([np.asarray([s.spec.top_k if 0 < s.spec.top_k < vocab else vocab for s in states])], device)
    top_p, min_p = upload(
        [np.asarray([s.spec.top_p for s in states]), np.asarray([s.spec.min_p for s in states])], device, torch.float32
    )
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(vocab, device=device)[None, :]
    sorted_logits = sorted_logits.masked_fill(ranks >= top_k[:, None], float("-inf"))
    sorted_probs = torch.softmax(sorted_logits, dim=-1)
    before = sorted_probs.cumsum(dim=-1) - sorted_probs  # mass of strictly better tokens
    remove = before >= top_p[:, None]
    remove |= sorted_probs < min_p[:, None] * sorted_probs[:, :1]
    remove[:, 0] = False  # the best token always survives
    sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)
