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


def make_decisive(model, seed: int = 0) -> None:
    """Bench-only: rewrite a random-weight model in place so that greedy decoding has one continuation
    under any kernel's rounding. Random bf16 weights leave the top two logits near-tied, so a verify
    pass (k + 1 rows through other kernels) and a one-token decode part ways within a few tokens, and
    drafts taken from a reference run stop matching: the set agreement could not be measured.

    Here every layer's output projections (attention o_proj, GDN out_proj, the MLPs' and experts' down
    projections, the shared expert's) are zero, so the final hidden state is the last token's own
    embedding, normed; and the lm_head row of token perm[t] is token t's embedding (perm: a seeded
    permutation of the vocabulary). The next token after t is perm[t], its logit ~sqrt(hidden) standard
    deviations above any other (margins no rounding reaches). What a step costs does not change: the
    same shapes, kernels and bytes (zeros are read like any weight), and routing stays a function of
    each token's embedding (random across tokens). The MTP head is left as it was."""
    import torch

    if model.lm_head is None:
        raise ValueError("a decisive model needs its own lm_head (this checkpoint ties it to the embedding)")
    if model.layout.tp_size != 1:
        raise ValueError("a decisive model is built in-process: tensor_parallel_size must be 1")
    with torch.no_grad():
        for layer in model.layers:
            mixer = layer.mixer
            (mixer.o_proj if layer.is_attention else mixer.out_proj).zero_()
            mlp = layer.mlp
            mlp.w2.zero_()
            shared = getattr(mlp, "shared_expert", None)
            if shared is not None:
                shared.w2.zero_()
        vocab = model.embed_tokens.shape[0]
        perm = torch.randperm(vocab, generator=torch.Generator().manual_seed(seed)).to(model.lm_head.device)
        model.lm_head.index_copy_(0, perm, model.embed_tokens.to(model.lm_head.dtype))


def decisive_successor(vocab_size: int, seed: int = 0):
    """The successor of each token in make_decisive(model, seed)'s model: numpy [vocab] int."""
    import torch

    perm = torch.randperm(vocab_size, generator=torch.Generator().manual_seed(seed))
    return perm.numpy()
