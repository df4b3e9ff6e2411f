"""Token sampling on the worker (TP rank 0): penalties, temperature, top-k / top-p / min-p, and
the draw itself; plus logprobs of sampled and prompt tokens.

The draw is an exponential race, argmax(p / E) with E ~ Exp(1) per vocabulary entry, which samples
exactly from p. For a request with a seed, E comes from a counter-based hash of (seed, output index,
token id): the same request gives the same tokens whatever else is in the batch, on CPU or GPU, and
after a preemption.
"""

from __future__ import annotations

import torch

from deltaserve.cluster.plan import NewRequestData, SamplingSpec, TokenLogprobs

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


class RequestSamplingState:
    def __init__(self, data: NewRequestData):
        self.spec: SamplingSpec = data.sampling
        self.prompt_token_ids = list(data.prompt_token_ids)
        self.output_token_ids = list(data.output_token_ids)


class Sampler:
    def __init__(self, vocab_size: int, seed: int = 0):
        self.vocab_size = vocab_size
        self.states: dict[str, RequestSamplingState] = {}
        self.generator_seed = seed
        self._generators: dict[torch.device, torch.Generator] = {}

    def _generator(self, device: torch.device) -> torch.Generator:
        if device not in self._generators:
            self._generators[device] = torch.Generator(device=device).manual_seed(self.generator_seed)
        return self._generators[device]

    # ---- request bookkeeping ------------------------------------------------------------------
    def add(self, data: NewRequestData) -> None:
        self.states[data.req_id] = RequestSamplingState(data)

    def remove(self, req_id: str) -> None:
        self.states.pop(req_id, None)

    # ---- sampling ------------------------------------------------------------------------------
    def sample(self, req_ids: list[str], logits: torch.Tensor) -> tuple[list[int], dict[str, TokenLogprobs]]:
        """One token for each row of logits [R, V] (float32); records it in the request's history."""
        if not req_ids:
            return [], {}
        states = [self.states[r] for r in req_ids]
        raw = logits
        if any(_needs_penalties(s) for s in states):
            logits = logits.clone()
            self._apply_penalties(logits, states)
        greedy = [i for i, s in enumerate(states) if s.spec.temperature == 0]
        if len(greedy) == len(states):  # all greedy: one argmax, no gathers
            tokens = logits.argmax(dim=-1)
        else:
            tokens = torch.empty(len(states), dtype=torch.long, device=logits.device)
            if greedy:
                tokens[greedy] = logits[greedy].argmax(dim=-1)
            random_rows = [i for i, s in enumerate(states) if s.spec.temperature != 0]
            tokens[random_rows] = self._draw(logits[random_rows], [states[i] for i in random_rows])
        token_list = tokens.tolist()
        want_logprobs = [i for i, s in enumerate(states) if s.spec.logprobs is not None]
        logprobs = {}
        if want_logprobs:
            lp = torch.log_softmax(raw[want_logprobs].float(), dim=-1)
            for j, i in enumerate(want_logprobs):
                logprobs[req_ids[i]] = token_logprobs(lp[j], token_list[i], states[i].spec.logprobs)
        for state, token in zip(states, token_list, strict=True):
            state.output_token_ids.append(token)
        return token_list, logprobs

    def _apply_penalties(self, logits: torch.Tensor, states: list[RequestSamplingState]) -> None:
        for i, s in enumerate(states):
            spec = s.spec
            if len(s.output_token_ids) < spec.min_tokens and spec.min_tokens_banned_ids:
                logits[i, spec.min_tokens_banned_ids] = float("-inf")
            if spec.repetition_penalty != 1.0:
                seen = torch.tensor(sorted(set(s.prompt_token_ids) | set(s.output_token_ids)), device=logits.device)
                values = logits[i, seen]
                logits[i, seen] = torch.where(
                    values > 0, values / spec.repetition_penalty, values * spec.repetition_penalty
                )
            if (spec.presence_penalty or spec.frequency_penalty) and s.output_token_ids:
                out = torch.tensor(s.output_token_ids, device=logits.device)
                counts = torch.bincount(out, minlength=logits.shape[1]).to(logits.dtype)
                logits[i] -= spec.frequency_penalty * counts + spec.presence_penalty * (counts > 0).to(logits.dtype)

    def _draw(self, logits: torch.Tensor, states: list[RequestSamplingState]) -> torch.Tensor:
        device = logits.device
        temps = torch.tensor([s.spec.temperature for s in states], device=device, dtype=torch.float32)
        logits = logits / temps[:, None]
        if any(s.spec.top_k > 0 or s.spec.top_p < 1.0 or s.spec.min_p > 0 for s in states):
            logits = _filter(logits, states)
        probs = torch.softmax(logits, dim=-1)
        noise = torch.empty_like(probs)
        unseeded = [i for i, s in enumerate(states) if s.spec.seed is None]
        if unseeded:
            noise[unseeded] = torch.empty(
                (len(unseeded), probs.shape[1]), device=device, dtype=probs.dtype
            ).exponential_(generator=self._generator(device))
        for i, s in enumerate(states):
            if s.spec.seed is not None:
                noise[i] = seeded_exponentials(s.spec.seed, len(s.output_token_ids), probs.shape[1], device)
        return (probs / noise).argmax(dim=-1)

    def prompt_logprobs(self, logits: torch.Tensor, next_tokens: list[int], k: int) -> list[TokenLogprobs]:
        """Logprobs of next_tokens[i] under logits[i] (one prompt position each)."""
        lp = torch.log_softmax(logits.float(), dim=-1)
        return [token_logprobs(lp[i], t, k) for i, t in enumerate(next_tokens)]


def _needs_penalties(state: RequestSamplingState) -> bool:
    spec = state.spec
    return (
        spec.repetition_penalty != 1.0
        or bool(spec.presence_penalty or spec.frequency_penalty)
        or (len(state.output_token_ids) < spec.min_tokens and bool(spec.min_tokens_banned_ids))
    )


def _filter(logits: torch.Tensor, states: list[RequestSamplingState]) -> torch.Tensor:
    """top-k, then top-p, then min-p, per row (-inf for removed tokens)."""
    device, vocab = logits.device, logits.shape[1]
    top_k = torch.tensor([s.spec.top_k if s.spec.top_k > 0 else vocab for s in states], device=device)
    top_p = torch.tensor([s.spec.top_p for s in states], device=device, dtype=torch.float32)
    min_p = torch.tensor([s.spec.min_p for s in states], device=device, dtype=torch.float32)
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


def token_logprobs(logprobs: torch.Tensor, token: int, k: int) -> TokenLogprobs:
    """The token's logprob and rank, and the top-k alternatives, from a [V] logprob row."""
    value = logprobs[token]
    rank = int((logprobs > value).sum().item()) + 1
    if k:
        top = torch.topk(logprobs, k)
        top_ids, top_lp = top.indices.tolist(), top.values.tolist()
    else:
        top_ids, top_lp = [], []
    return TokenLogprobs(token_id=int(token), logprob=float(value), rank=rank, top_ids=top_ids, top_logprobs=top_lp)
