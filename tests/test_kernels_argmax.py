"""Greedy sampling's row argmax (kernels/argmax) against torch.argmax: the first index of the
maximum, across block edges and within a block, for odd vocabularies, strided rows, bf16 and
float32, rows of -inf, and NaN; the tickets are back at zero after each launch."""

import pytest
import torch

from deltaserve.layers.kernels.argmax import naive
from deltaserve.layers.kernels.argmax import triton_argmax as ta
from deltaserve.layers.kernels.device import ticket_buffers

pytestmark = pytest.mark.usefixtures("nan_fill")


def _check(logits: torch.Tensor, block: int) -> None:
    got = ta.row_argmax(logits=logits, block=block)
    want = naive.row_argmax(logits=logits)
    assert got.dtype == torch.int64 and torch.equal(got.cpu(), want.cpu())
    for tickets in ticket_buffers("row_argmax", logits.device):
        assert not tickets.any()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows,vocab,block", [(1, 1, 16), (3, 37, 16), (5, 257, 64), (2, 1000, 128)])
def test_random_rows(device, dtype, rows, vocab, block):
    g = torch.Generator().manual_seed(rows * vocab)
    _check(torch.randn(rows, vocab, generator=g).to(device=device, dtype=dtype), block)


def test_ties_take_the_first_index(device):
    logits = torch.zeros(4, 100, device=device, dtype=torch.bfloat16)
    logits[0, [7, 70]] = 3.0  # in different blocks
    logits[1, [33, 34]] = 3.0  # in one block
    logits[2, [31, 32]] = 3.0  # either side of a block edge
    # row 3: all equal, index 0
    _check(logits, 32)


def test_strided_rows_and_infinities(device):
    wide = torch.randn(3, 80, device=device)
    view = wide[:, :70]  # rows 80 apart, as the TP gather's slice
    view[1] = float("-inf")  # a row of -inf: index 0
    view[2, 50] = float("inf")
    _check(view, 16)


def test_nan_counts_as_the_largest(device):
    logits = torch.randn(2, 90, device=device)
    logits[0, 40] = float("nan")
    logits[1, 3] = float("nan")
    logits[1, 70] = float("nan")
    _check(logits, 32)


def test_no_rows(device):
    assert ta.row_argmax(logits=torch.zeros(0, 10, device=device)).shape == (0,)
