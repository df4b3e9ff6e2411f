"""Drafts of known quality for speculative decoding's tests and benchmarks (never used in serving).

`ReferenceDrafter` replaces the MTP head's drafts (the head still runs, so its cost stays in the
measurement) with the tokens a reference run without speculation produced, each kept with
probability `agreement` and otherwise replaced by another token: at 1.0 every draft is the target's
own next token; at 0.7 a verify row's drafts stop matching after a geometric number of them.
"""

from __future__ import annotations

import numpy as np


class ReferenceDrafter:
    def __init__(self, reference: dict[tuple[int, ...], list[int]], agreement: float, vocab_size: int, seed: int = 0):
        """reference: prompt token ids -> the output a greedy run without speculation produced (longer
        than the runs it drafts for, so that every draft has a reference token)."""
        if not 0 <= agreement <= 1:
            raise ValueError(f"agreement: must be in [0, 1], got {agreement}")
        self.reference, self.agreement, self.vocab_size = reference, agreement, vocab_size
        self.rng = np.random.default_rng(seed)

    def propose(self, req, k: int, head_drafts=None) -> list[int]:
        """The k drafts after the request's latest token (the head's own, `head_drafts`, unused)."""
        ref = self.reference[tuple(req.prompt_token_ids)]
        done = len(req.output_token_ids)
        out = []
        for i in range(k):
            true = ref[done + i] if done + i < len(ref) else 0
            if self.rng.random() < self.agreement:
                out.append(int(true))
            else:  # any other token
                out.append(int((true + 1 + self.rng.integers(self.vocab_size - 1)) % self.vocab_size))
        return out
