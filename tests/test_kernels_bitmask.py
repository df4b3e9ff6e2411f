"""Structured output's bitmask kernel (kernels/bitmask) and its plain-torch reference against
xgrammar's own CPU application of the same masks: odd vocabularies, words past the vocabulary,
masks for some rows only (in any order), bf16 and float32, and rows at a stride."""

import pytest
import torch
import xgrammar as xgr

from deltaserve.layers.kernels.bitmask import naive
from deltaserve.layers.kernels.bitmask import triton_bitmask as tb


def _masks(rows: int, vocab: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    words = -(-vocab // 32)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (rows, words), generator=g, dtype=torch.int64).to(torch.int32)
    bitmask[0, 0] = -1  # every token of the first word allowed
    if words > 1:
        bitmask[-1, 1] = 0  # none of the second
    return bitmask


def _xgrammar(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int] | None) -> torch.Tensor:
    """xgrammar's CPU application (a mask row per logits row, chosen by index) on a float32 copy."""
    out = logits.float().cpu().clone()
    full = torch.full((out.shape[0], bitmask.shape[1]), -1, dtype=torch.int32)
    if rows is None:
        full = bitmask.cpu().clone()
    else:
        full[rows] = bitmask.cpu()
    xgr.apply_token_bitmask_inplace(out, full, vocab_size=out.shape[1], indices=rows)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_rows,vocab,rows,block", [(1, 31, None, 64), (3, 100, [2, 0], 64), (4, 1000, [1], 128),
                                                        (2, 4096, None, 256)])  # fmt: skip
def test_kernel_and_reference_match_xgrammar(device, dtype, num_rows, vocab, rows, block):
    g = torch.Generator().manual_seed(vocab)
    logits = torch.randn(num_rows, vocab, generator=g).to(dtype)
    bitmask = _masks(num_rows if rows is None else len(rows), vocab, vocab)
    want = _xgrammar(logits, bitmask, rows)
    ids = None if rows is None else torch.tensor(rows, device=device)
    got_ref = logits.to(device).clone()
    naive.apply_token_bitmask(logits=got_ref, bitmask=bitmask.to(device), rows=ids)
    got = logits.to(device).clone()
    tb.apply_token_bitmask(logits=got, bitmask=bitmask.to(device), rows=ids, block=block)
    assert torch.equal(got_ref.float().cpu(), want)
    assert torch.equal(got.float().cpu(), want)


def test_strided_rows_and_a_wider_mask(device):
    wide = torch.randn(3, 90, device=device)
    view = wide[:, :70]  # rows 90 apart
    bitmask = _masks(2, 96, 7).to(device)  # 3 words: bits of tokens 70..95 must be ignored
    want = _xgrammar(view, bitmask, [2, 1])
    tb.apply_token_bitmask(logits=view, bitmask=bitmask, rows=torch.tensor([2, 1], device=device), block=32)
    assert torch.equal(view.cpu(), want)
    assert torch.isfinite(wide[:, 70:]).all()  # nothing written past the view's columns


def test_allowed_tokens_reads_bit_t_of_word_t_over_32():
    bitmask = torch.zeros(1, 2, dtype=torch.int32)
    bitmask[0, 0] = (1 << 5) - 2**31  # bits 5 and 31 (the sign bit)
    bitmask[0, 1] = 1 << 2
    assert naive.allowed_tokens(bitmask, 64).nonzero()[:, 1].tolist() == [5, 31, 34]
