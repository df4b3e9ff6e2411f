"""Triton QSA kernels (layers/kernels/qsa/triton_qsa.py) against the plain-torch reference (naive.py).

Without CUDA the kernels run on CPU float32 tensors under Triton's interpreter (tiny shapes); with
CUDA the same tests run compiled, and the `gpu`-marked tests compare bf16 kernels at real shapes.
Outputs and the caches' unwritten entries start as NaN (nan_fill / the fixtures), so an entry a
kernel should write and does not fails the comparison, and one it should not write and does too."""

from __future__ import annotations

import math

import pytest
import torch

# conftest.py sets TRITON_INTERPRET (no CUDA) before anything imports triton
from deltaserve.layers.kernels.qsa import naive
from deltaserve.layers.kernels.qsa import triton_qsa as tq

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = 2e-2 if DEVICE == "cuda" else 1e-5  # float32 dots run as tf32 on the GPU


class Batch:
    """N sequences with scrambled pages; one group of a pass: the last `new[n]` tokens of each."""

    def __init__(self, lens, new, block_size, head_dim, num_blocks=None, dtype=torch.float32, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.block_size = block_size
        pages = [-(-n // block_size) for n in lens]
        num_blocks = num_blocks or sum(pages) + 3
        perm = torch.randperm(num_blocks, generator=g)
        width = max(pages)
        self.block_tables = torch.zeros((len(lens), width), dtype=torch.int32)
        first = 0
        for i, p in enumerate(pages):
            self.block_tables[i, :p] = perm[first : first + p].to(torch.int32)
            first += p
        positions, rows = [], []
        for i, (n, k) in enumerate(zip(lens, new, strict=True)):
            positions += list(range(n - k, n))
            rows += [i] * k
        self.positions = torch.tensor(positions)
        self.rows = torch.tensor(rows)
        page = self.block_tables[self.rows, self.positions // block_size].long()
        self.slots = page * block_size + self.positions % block_size
        self.seq_lens = torch.tensor(lens, dtype=torch.int32)
        self.num_blocks, self.dtype, self.head_dim = num_blocks, dtype, head_dim
        self.max_len = max(lens)

    def to(self, device):
        for name in ("block_tables", "positions", "rows", "slots", "seq_lens"):
            setattr(self, name, getattr(self, name).to(device))
        return self

    def all_tokens(self, lens):
        """(positions, rows, slots) of every token of every sequence (to fill caches)."""
        pos = torch.cat([torch.arange(n) for n in lens]).to(self.positions.device)
        rows = torch.cat([torch.full((n,), i) for i, n in enumerate(lens)]).to(self.positions.device)
        page = self.block_tables[rows, pos // self.block_size].long()
        return pos, rows, page * self.block_size + pos % self.block_size


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """max |out - ref| / max(1, max |ref|) over the finite entries; NaN or a mismatched inf fails."""
    if not torch.equal(torch.isnan(out), torch.isnan(ref)) or not torch.equal(torch.isinf(out), torch.isinf(ref)):
        return float("inf")
    finite = torch.isfinite(ref)
    if not finite.any():
        return 0.0
    o, r = out[finite].float(), ref[finite].float()
    return ((o - r).abs().max() / r.abs().max().clamp(min=1)).item()


@pytest.mark.parametrize("block_size, ratio", [(4, 3), (4, 4), (2, 5), (16, 3), (16, 8)])
def test_write_and_compress_match_naive(nan_fill, block_size, ratio):
    """Raw keys into their slots, then block keys for the tokens that complete a block (blocks that
    end inside this group, begin in earlier passes, or span pages); padding slots write nothing."""
    torch.manual_seed(0)
    head_dim, rot = 12, 8
    lens, new = [23, 9, 40, 5], [7, 9, 1, 3]
    b = Batch(lens, new, block_size, head_dim).to(DEVICE)
    nbi = (block_size - 1) // ratio + 1
    key_cache = torch.full((b.num_blocks, block_size, head_dim), float("nan"), device=DEVICE)
    pos_all, _, slots_all = b.all_tokens(lens)
    old = torch.ones(len(pos_all), dtype=torch.bool, device=DEVICE)
    old[torch.isin(slots_all, b.slots)] = False
    key_cache.view(-1, head_dim)[slots_all[old]] = torch.randn(int(old.sum()), head_dim, device=DEVICE)
    block_cache = torch.full((b.num_blocks, nbi, head_dim), float("nan"), device=DEVICE)
    keys = torch.randn(len(b.positions), head_dim, device=DEVICE)
    slots = b.slots.clone()
    slots[1] = -1  # a padding row
    weight = torch.randn(head_dim, device=DEVICE) * 0.3
    outs = []
    for write, compress in ((naive.write_index_keys, naive.compress_blocks), (tq.write_index_keys, tq.compress_blocks)):
        kc, bc = key_cache.clone(), block_cache.clone()
        write(keys=keys, key_cache=kc, slot_mapping=slots)
        compress(
            key_cache=kc, block_cache=bc, positions=b.positions, slot_mapping=slots, token_rows=b.rows,
            block_tables=b.block_tables, norm_weight=weight, eps=1e-6, rotary_dim=rot, theta=10000.0,
            compress_ratio=ratio,
        )  # fmt: skip
        outs.append((kc, bc))
    (kc_ref, bc_ref), (kc, bc) = outs
    assert torch.equal(torch.isnan(kc), torch.isnan(kc_ref)) and rel_err(kc, kc_ref) == 0.0
    assert rel_err(bc, bc_ref) <= TOL
    assert (~torch.isnan(bc_ref)).any()  # some block was completed


def filled_block_cache(b: Batch, lens, ratio, head_dim, dtype=torch.float32):
    """A compressed-key cache with every complete block of every sequence written, NaN elsewhere."""
    nbi = (b.block_size - 1) // ratio + 1
    cache = torch.full((b.num_blocks, nbi, head_dim), float("nan"), dtype=dtype, device=b.positions.device)
    pos, _, slots = b.all_tokens(lens)
    ends = (pos + 1) % ratio == 0
    s = slots[ends]
    cache[s // b.block_size, (s % b.block_size) // ratio] = torch.randn(int(ends.sum()), head_dim, device=DEVICE).to(
        dtype
    )
    return cache


@pytest.mark.parametrize("block_size, ratio, heads", [(4, 3, 4), (16, 4, 3), (2, 5, 16), (16, 16, 5)])
def test_index_scores_match_naive(nan_fill, block_size, ratio, heads):
    torch.manual_seed(1)
    head_dim = 12
    lens, new = [70, 13, 2, 45], [5, 13, 2, 1]
    b = Batch(lens, new, block_size, head_dim).to(DEVICE)
    cache = filled_block_cache(b, lens, ratio, head_dim)
    q = torch.randn(len(b.positions), heads, head_dim, device=DEVICE)
    kw = dict(q=q, block_cache=cache, positions=b.positions, token_rows=b.rows, block_tables=b.block_tables,
              compress_ratio=ratio, block_size=block_size, max_blocks=b.max_len // ratio + 2)  # fmt: skip
    ref = naive.index_scores(**kw)
    out = tq.index_scores(**kw)
    assert rel_err(out, ref) <= TOL


@pytest.mark.parametrize("top_blocks, ratio", [(4, 3), (1, 4), (7, 2), (16, 1)])
def test_block_topk_matches_naive(nan_fill, top_blocks, ratio):
    """Distinct scores: the same set as torch.topk, ascending, -1 past it; rows with few blocks keep all."""
    torch.manual_seed(2)
    positions = torch.tensor([0, 1, 2, 5, 11, 12, 13, 40, 63, 64, 100, 129], device=DEVICE)
    max_blocks = 129 // ratio + 3
    scores = torch.rand(len(positions), max_blocks, device=DEVICE) * 5
    kw = dict(scores=scores, positions=positions, compress_ratio=ratio, top_blocks=top_blocks)
    assert torch.equal(tq.block_topk(**kw), naive.block_topk(**kw))


def test_block_topk_ties_take_the_lowest_index(nan_fill):
    """relu sums are often exactly 0: among equal scores at the cut the lowest block indices win."""
    scores = torch.tensor(
        [
            [0.0, 3.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 2.0, 0.0],  # one tie group at the cut
            [5.0, 5.0, 5.0, 5.0, 5.0, 5.0, 5.0, 5.0, 5.0, 5.0],  # all equal
            [0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 9.0],
        ],
        device=DEVICE,
    )
    positions = torch.tensor([29, 29, 29], device=DEVICE)  # 10 complete blocks of 3
    out = tq.block_topk(scores=scores, positions=positions, compress_ratio=3, top_blocks=5)
    assert out.tolist() == [[0, 1, 2, 4, 8], [0, 1, 2, 3, 4], [0, 1, 2, 3, 9]]
    # rows longer than the all-pairs path (the binary search's tie pass)
    long = torch.zeros(2, 300, device=DEVICE)
    long[0, [7, 250, 299]] = torch.tensor([1.0, 2.0, 3.0], device=DEVICE)
    long[1, 100:] = 1.0
    out = tq.block_topk(scores=long, positions=torch.tensor([299, 299], device=DEVICE), compress_ratio=1, top_blocks=6)
    assert out.tolist() == [[0, 1, 2, 7, 250, 299], [100, 101, 102, 103, 104, 105]]


@pytest.mark.parametrize(
    "block_size, ratio, top_blocks, heads, kv_heads, head_dim",
    [(4, 3, 4, 6, 2, 16), (16, 4, 3, 4, 1, 12), (2, 5, 2, 8, 2, 20), (16, 16, 2, 3, 3, 32)],
)
def test_sparse_attention_matches_naive(nan_fill, block_size, ratio, top_blocks, heads, kv_heads, head_dim):
    torch.manual_seed(3)
    lens, new = [90, 13, 1, 47], [6, 13, 1, 2]
    b = Batch(lens, new, block_size, head_dim).to(DEVICE)
    k_cache = torch.randn(b.num_blocks, block_size, kv_heads, head_dim, device=DEVICE)
    v_cache = torch.randn(b.num_blocks, block_size, kv_heads, head_dim, device=DEVICE)
    q = torch.randn(len(b.positions), heads, head_dim, device=DEVICE)
    scores = torch.rand(len(b.positions), b.max_len // ratio + 1, device=DEVICE)
    selected = naive.block_topk(scores=scores, positions=b.positions, compress_ratio=ratio, top_blocks=top_blocks)
    kw = dict(q=q, k_cache=k_cache, v_cache=v_cache, positions=b.positions, token_rows=b.rows,
              block_tables=b.block_tables, selected=selected, compress_ratio=ratio, scale=head_dim**-0.5)  # fmt: skip
    assert rel_err(tq.sparse_attention(**kw), naive.sparse_attention(**kw)) <= TOL


def test_sparse_attention_with_everything_selected_is_dense_attention(nan_fill):
    """While a query has no more complete blocks than it keeps, it attends to its whole prefix."""
    from deltaserve.layers.kernels.attention import naive as attention_naive

    torch.manual_seed(4)
    lens, new = [20, 7], [20, 7]
    b = Batch(lens, new, 4, 16).to(DEVICE)
    k_cache = torch.randn(b.num_blocks, 4, 2, 16, device=DEVICE)
    v_cache = torch.randn(b.num_blocks, 4, 2, 16, device=DEVICE)
    q = torch.randn(27, 4, 16, device=DEVICE)
    selected = naive.block_topk(scores=torch.zeros(27, 10, device=DEVICE), positions=b.positions, compress_ratio=3,
                                top_blocks=7)  # fmt: skip
    out = tq.sparse_attention(q=q, k_cache=k_cache, v_cache=v_cache, positions=b.positions, token_rows=b.rows,
                              block_tables=b.block_tables, selected=selected, compress_ratio=3, scale=0.25)  # fmt: skip
    ref = attention_naive.paged_attention(q=q, k_cache=k_cache, v_cache=v_cache, scale=0.25, seq_lens=b.seq_lens,
                                          cu_seqlens_q=torch.tensor([0, 20, 27], device=DEVICE),
                                          block_tables=b.block_tables)  # fmt: skip
    assert rel_err(out, ref) <= TOL


# ---------------------------------------------------------------------------------------------
# Real shapes on the GPU (bf16)
# ---------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("ratio, budget", [(4, 2048), (16, 2048), (64, 2048)])
@pytest.mark.parametrize("phase", ["decode", "prefill"])
def test_qsa_real_shapes_gpu(nan_fill, ratio, budget, phase):
    """The whole QSA path of one layer in bf16 against the naive reference: 32k-token sequences, pages
    of 16, 16 indexer heads of 128, 16 q heads over 2 kv heads of 256 (the bench preset's shapes). The
    selections may differ where two blocks' bf16 scores tie; the attention is compared on the
    reference's own selection, and the selections must agree on all but a sliver of entries."""
    torch.manual_seed(5)
    head_dim, heads, kv_heads, dh, bs = 128, 16, 2, 256, 16
    top = budget // ratio
    lens = [32768, 9000, 30001, 4097] if phase == "decode" else [32768]
    new = [1, 1, 1, 1] if phase == "decode" else [256]  # the reference gathers [T, budget, Hkv, 256] floats
    b = Batch(lens, new, bs, head_dim, dtype=torch.bfloat16).to("cuda")
    cache = filled_block_cache(b, lens, ratio, head_dim, torch.bfloat16)
    q = torch.randn(len(b.positions), heads, head_dim, device="cuda").bfloat16()
    kw = dict(q=q, block_cache=cache, positions=b.positions, token_rows=b.rows, block_tables=b.block_tables,
              compress_ratio=ratio, block_size=bs, max_blocks=b.max_len // ratio)  # fmt: skip
    scores, ref_scores = tq.index_scores(**kw), naive.index_scores(**kw)
    assert rel_err(scores, ref_scores) <= 2e-2
    kwt = dict(positions=b.positions, compress_ratio=ratio, top_blocks=top)
    selected, ref_selected = tq.block_topk(scores=ref_scores, **kwt), naive.block_topk(scores=ref_scores, **kwt)
    assert (selected != ref_selected).float().mean().item() <= 1e-3
    k_cache = torch.randn(b.num_blocks, bs, kv_heads, dh, device="cuda").bfloat16()
    v_cache = torch.randn(b.num_blocks, bs, kv_heads, dh, device="cuda").bfloat16()
    qa = torch.randn(len(b.positions), heads, dh, device="cuda").bfloat16()
    kwa = dict(q=qa, k_cache=k_cache, v_cache=v_cache, positions=b.positions, token_rows=b.rows,
               block_tables=b.block_tables, selected=ref_selected, compress_ratio=ratio, scale=dh**-0.5)  # fmt: skip
    assert rel_err(tq.sparse_attention(**kwa), naive.sparse_attention(**kwa)) <= 2e-2
    assert not math.isnan(scores.float().nan_to_num(neginf=0).sum().item())
