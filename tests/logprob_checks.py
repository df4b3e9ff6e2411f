"""Comparing logprobs in vLLM's shape: per position {token id: Logprob}, the chosen token first."""

from __future__ import annotations


def assert_entries_close(got, want, atol: float = 1e-5, where="") -> None:
    """Same positions, the same token ids in the same order with the same ranks and texts, and
    logprobs within `atol` (float32 sums in another process or order differ in the last bits)."""
    assert len(got) == len(want), where
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        if w is None:
            assert g is None, (where, i)
            continue
        assert list(g) == list(w), (where, i, g, w)
        for token in w:
            assert (g[token].rank, g[token].decoded_token) == (w[token].rank, w[token].decoded_token), (where, i)
            assert abs(g[token].logprob - w[token].logprob) <= atol, (where, i, token, g[token], w[token])


def prompt_logprob_gaps(a, b) -> list[float]:
    """|logprob difference| of each prompt token (the first has none) between two runs' outputs, sorted;
    each position's entry holds the prompt token first."""
    gaps = []
    for x, y in zip(a, b, strict=True):
        assert len(x.prompt_logprobs) == len(y.prompt_logprobs) == len(x.prompt_token_ids)
        for p, q in zip(x.prompt_logprobs[1:], y.prompt_logprobs[1:], strict=True):
            token, chosen = next(iter(p.items()))
            gaps.append(abs(chosen.logprob - q[token].logprob))
    return sorted(gaps)
