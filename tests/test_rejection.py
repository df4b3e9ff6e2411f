"""Rejection sampling (workers/rejection.py): on a tiny vocabulary the emitted tokens follow the target's
distribution at every output position (a chi-square test that the wrong schemes below fail), the
acceptance rate is the scheme's, and greedy rows keep exactly the drafts that match the argmax."""

from __future__ import annotations

import pytest
import torch

from deltaserve.workers.rejection import accept_drafts, emitted, rejection_sample

V, K, TRIALS = 5, 3, 60_000


def chi_square_pvalue(tokens: torch.Tensor, probs: torch.Tensor) -> float:
    """P-value of the hypothesis that `tokens` are independent draws from `probs` [V]."""
    observed = torch.bincount(tokens, minlength=probs.shape[0]).double()
    expected = probs.double() * tokens.shape[0]
    stat = ((observed - expected) ** 2 / expected).sum()
    df = probs.shape[0] - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), stat / 2))


@pytest.fixture
def setting():
    g = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(K + 1, V, generator=g) * 1.5, dim=-1)  # the target at each position
    q = torch.softmax(torch.randn(K, V, generator=g) * 1.5, dim=-1)  # the draft model's
    drafts = torch.stack([torch.multinomial(q[i], TRIALS, replacement=True, generator=g) for i in range(K)], dim=1)
    uniforms = torch.rand(TRIALS, K, generator=g)
    noise = torch.empty(TRIALS, K + 1, V).exponential_(generator=g)
    return p, q, drafts, uniforms, noise


def output_positions(tokens: torch.Tensor, num_accepted: torch.Tensor):
    """(position j, the tokens emitted at output position j by the rows that reached it)."""
    for j in range(K + 1):
        rows = num_accepted >= j
        yield j, tokens[rows, j]


def test_sampled_drafts_follow_the_target(setting):
    p, q, drafts, uniforms, noise = setting
    tokens, num_accepted = rejection_sample(p.expand(TRIALS, -1, -1), drafts, q.expand(TRIALS, -1, -1), uniforms, noise)
    for j, out in output_positions(tokens, num_accepted):
        assert (out >= 0).all()
        assert out.shape[0] > 2_000, f"too few rows reach position {j} for the test to mean anything"
        assert chi_square_pvalue(out, p[j]) > 1e-4, f"output position {j} does not follow the target"
    # acceptance at the first draft: sum_x min(p(x), q(x))
    expected = torch.minimum(p[0], q[0]).sum().item()
    assert abs((num_accepted >= 1).double().mean().item() - expected) < 0.01
    # the emitted drafts are the drafts, and nothing follows the emitted token
    for n in range(200):
        a = int(num_accepted[n])
        assert tokens[n, :a].tolist() == drafts[n, :a].tolist() and (tokens[n, a + 1 :] == -1).all()


def test_a_wrong_scheme_fails_the_test(setting):
    """Resampling from p (not the residual max(0, p - q)) after a rejection over-weights the drafts'
    tokens: the same chi-square test rejects it."""
    p, q, drafts, uniforms, noise = setting
    p_d = p[0].gather(0, drafts[:, 0])
    q_d = q[0].gather(0, drafts[:, 0])
    accept = uniforms[:, 0] * q_d < p_d
    from_p = (p[0] / noise[:, 0]).argmax(dim=1)
    wrong = torch.where(accept, drafts[:, 0], from_p)
    assert chi_square_pvalue(wrong, p[0]) < 1e-6


def test_greedy_drafts_by_coupling_follow_the_target(setting):
    """One-hot drafts (the MTP head's argmax): x ~ p at each position, accept iff x == draft."""
    p, q, _, _, noise = setting
    drafts = q.argmax(dim=-1).expand(TRIALS, -1)  # deterministic proposals
    sampled = (p / noise).argmax(dim=-1)  # the sampler's race at each position
    num_accepted = accept_drafts(sampled, drafts)
    tokens = emitted(sampled, num_accepted)
    for j, out in output_positions(tokens, num_accepted):
        assert chi_square_pvalue(out, p[j]) > 1e-4, f"output position {j} does not follow the target"
    # acceptance of the first draft is p(d): q one-hot at d in min(1, p(d) / q(d))
    assert abs((num_accepted >= 1).double().mean().item() - p[0, drafts[0, 0]].item()) < 0.01
    # a wrong coupling: accept on a uniform draw but emit the free draw x on a rejection (it may be
    # the rejected draft itself) fails
    u = torch.rand(TRIALS, generator=torch.Generator().manual_seed(1))
    wrong = torch.where(u < p[0, drafts[0, 0]], drafts[:, 0], sampled[:, 0])
    assert chi_square_pvalue(wrong, p[0]) < 1e-6


def test_greedy_rows_keep_the_matching_prefix():
    sampled = torch.tensor([[5, 6, 7, 8], [5, 9, 7, 8], [1, 6, 7, 8], [5, 6, 7, 3]])
    drafts = torch.tensor([[5, 6, 7], [5, 6, 7], [5, 6, 7], [5, 6, 7]])
    num_accepted = accept_drafts(sampled, drafts)
    assert num_accepted.tolist() == [3, 1, 0, 3]
    assert emitted(sampled, num_accepted).tolist() == [[5, 6, 7, 8], [5, 9, -1, -1], [1, -1, -1, -1], [5, 6, 7, 3]]
    # a later match after a mismatch does not count
    assert accept_drafts(torch.tensor([[1, 2, 3]]), torch.tensor([[9, 2]])).tolist() == [0]
