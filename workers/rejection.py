"""Speculative decoding's rejection sampling: which drafts of a verify row are kept, and the token
after them, so that the emitted tokens are distributed exactly as the target's samples.

A verify row holds the last known token and k drafts d_0 .. d_{k-1}; the target's pass gives
L = k + 1 distributions p_0 .. p_k (p_i predicts the token that d_i proposes). The standard scheme:
accept d_i with probability min(1, p_i(d_i) / q_i(d_i)) while every earlier draft was accepted; at
the first rejection emit a token drawn from norm(max(0, p_i - q_i)); with all k accepted, emit a
bonus token drawn from p_k. A row emits `num_accepted + 1` tokens.

The MTP head drafts greedily (its argmax): q_i is one-hot at d_i, accepting has probability
p_i(d_i) and the residual is p_i without d_i. `accept_drafts` realises that by coupling: x_i is the
sampler's own draw from p_i (the argmax for greedy requests, the seeded exponential race for seeded
ones), d_i is accepted iff x_i == d_i, and the emitted token is x at the first mismatch (or x_k).
P(accept) = p_i(d_i), and after a rejection x_i is p_i conditioned on != d_i: the standard scheme's
law, and the very tokens decoding without drafts would sample, so a seeded request's output does not
depend on the drafts. `rejection_sample` is the scheme for drafts sampled from a distribution q.

Everything stays on the device: the accepted counts feed write-on-accept without a host sync.
"""

from __future__ import annotations

import torch


def accept_drafts(sampled: torch.Tensor, drafts: torch.Tensor) -> torch.Tensor:
    """Greedy (one-hot) drafts. sampled [N, L]: the sampler's draw at each verify position; drafts
    [N, L - 1]. Returns num_accepted [N] (int64): the drafts before the first mismatch. The row
    emits sampled[n, : num_accepted[n] + 1]."""
    match = (sampled[:, :-1] == drafts).to(torch.int64)
    return match.cumprod(dim=1).sum(dim=1)


def rejection_sample(
    probs: torch.Tensor,
    drafts: torch.Tensor,
    draft_probs: torch.Tensor,
    uniforms: torch.Tensor,
    noise: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Drafts sampled from q. probs [N, L, V]: the target's p_i (after temperature and filters);
    drafts [N, L - 1]; draft_probs [N, L - 1, V]: q_i; uniforms [N, L - 1] in (0, 1): the
    acceptance draws; noise [N, L, V]: Exp(1) draws (a race argmax(w / noise) samples from w).

    Returns (tokens [N, L], num_accepted [N]): tokens[n, : a + 1] are the emitted ones (the a
    accepted drafts, then the residual draw or the bonus), -1 after them."""
    n, length, _ = probs.shape
    k = length - 1
    p_d = probs[:, :k].gather(2, drafts[..., None]).squeeze(2)
    q_d = draft_probs.gather(2, drafts[..., None]).squeeze(2)
    accepted = (uniforms * q_d < p_d).to(torch.int64)  # u < p / q, with q(d) > 0 for a drawn d
    num_accepted = accepted.cumprod(dim=1).sum(dim=1)
    residual = (probs[:, :k] - draft_probs).clamp(min=0)
    # p == q leaves nothing (a rejection then has probability 0): fall back to p, never divide by 0
    empty = residual.sum(dim=2, keepdim=True) <= 0
    residual = torch.where(empty, probs[:, :k], residual)
    recovered = (residual / noise[:, :k]).argmax(dim=2)  # [N, k]
    bonus = (probs[:, k] / noise[:, k]).argmax(dim=1)  # [N]
    last = torch.cat([recovered, bonus[:, None]], dim=1).gather(1, num_accepted[:, None]).squeeze(1)
    cols = torch.arange(length, device=probs.device)[None, :]
    padded = torch.cat([drafts, torch.full((n, 1), -1, dtype=drafts.dtype, device=drafts.device)], dim=1)
    tokens = torch.where(cols < num_accepted[:, None], padded, torch.full_like(padded, -1))
    tokens = torch.where(cols == num_accepted[:, None], last[:, None].to(tokens.dtype), tokens)
    return tokens, num_accepted


def emitted(sampled: torch.Tensor, num_accepted: torch.Tensor) -> torch.Tensor:
    """sampled [N, L] with -1 past each row's emitted tokens (num_accepted + 1 of them)."""
    cols = torch.arange(sampled.shape[1], device=sampled.device)[None, :]
    return torch.where(cols <= num_accepted[:, None], sampled, torch.full_like(sampled, -1))
