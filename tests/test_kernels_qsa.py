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


# block_topk's three paths forced on the same rows: all pairs ranked at once, the row read once into
# registers, the row read a piece at a time on every pass (pieces of 16: odd rows end mid-piece)
TOPK_PATHS = {
    "pairs": dict(pair=256, row=256, block=16),
    "registers": dict(pair=16, row=256, block=16),
    "pieces": dict(pair=16, row=16, block=16),
}


def lowest_index_topk(scores: torch.Tensor, positions: torch.Tensor, ratio: int, top: int) -> list[list[int]]:
    """The Triton kernels' selection in plain Python: the top scores of each row's first nc blocks,
    equal scores (-0.0 == 0.0) taken in index order, ascending, -1 past the last."""
    out = []
    for row, p in zip(scores.tolist(), positions.tolist(), strict=True):
        nc = (p + 1) // ratio
        order = sorted(range(nc), key=lambda c: (-row[c], c))  # stable: ties by index
        keep = sorted(order[:top])
        out.append(keep + [-1] * (top - len(keep)))
    return out


@pytest.mark.parametrize("path", list(TOPK_PATHS))
@pytest.mark.parametrize("top_blocks, ratio", [(4, 3), (1, 4), (7, 2), (16, 1)])
def test_block_topk_matches_naive(nan_fill, top_blocks, ratio, path):
    """Distinct scores: the same set as torch.topk, ascending, -1 past it; rows with few blocks keep
    all; odd row lengths just over K, over one piece, over several."""
    torch.manual_seed(2)
    positions = torch.tensor([0, 1, 2, 5, 11, 12, 13, 17, 40, 63, 64, 100, 129], device=DEVICE)
    max_blocks = 129 // ratio + 3
    scores = torch.rand(len(positions), max_blocks, device=DEVICE) * 5
    kw = dict(scores=scores, positions=positions, compress_ratio=ratio, top_blocks=top_blocks)
    assert torch.equal(tq.block_topk(**kw, config=TOPK_PATHS[path]), naive.block_topk(**kw))


def test_block_topk_default_paths_match_naive(nan_fill):
    """The default launch (pairs, registers, pieces by row length, as this device picks them) on
    rows of 1 to 3x the register row, with a score range like the indexer's (sums of relus)."""
    cfg = tq.TOPK_GPU if DEVICE == "cuda" else tq.TOPK_INTERPRETER
    lengths = [cfg["pair"] - 1, cfg["pair"] + 1, cfg["row"], cfg["row"] + 1, 3 * cfg["row"] - 5]
    torch.manual_seed(6)
    scores = torch.rand(len(lengths), max(lengths) + 2, device=DEVICE) * 40
    positions = torch.tensor(lengths, device=DEVICE) - 1
    top = cfg["pair"] // 2 + 3
    kw = dict(scores=scores, positions=positions, compress_ratio=1, top_blocks=top)
    assert torch.equal(tq.block_topk(**kw), naive.block_topk(**kw))


@pytest.mark.parametrize("path", list(TOPK_PATHS))
def test_block_topk_ties_take_the_lowest_index(nan_fill, path):
    """relu sums are often exactly 0 (of either sign): among equal scores at the cut the lowest block
    indices win, on every path (10-block rows rank all pairs under every config; the 100-block rows
    take the config's own path: pairs, registers, or 7 pieces of 16, the last ending mid-piece)."""
    cfg = TOPK_PATHS[path]
    scores = torch.tensor(
        [
            [0.0, 3.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 2.0, 0.0],  # one tie group at the cut
            [5.0, 5.0, 5.0, 5.0, 5.0, 5.0, 5.0, 5.0, 5.0, 5.0],  # all equal
            [0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 9.0],
            [-0.0, 0.0, -0.0, 0.0, 0.0, -0.0, 0.0, 0.0, 4.0, 0.0],  # -0.0 and 0.0 are equal scores
        ],
        device=DEVICE,
    )
    positions = torch.tensor([29, 29, 29, 29], device=DEVICE)  # 10 complete blocks of 3
    out = tq.block_topk(scores=scores, positions=positions, compress_ratio=3, top_blocks=5, config=cfg)
    assert out.tolist() == [[0, 1, 2, 4, 8], [0, 1, 2, 3, 4], [0, 1, 2, 3, 9], [0, 1, 2, 3, 8]]
    # longer rows: past the registers' 16-block pairs and the pieces' 16-block rows, within the pairs'
    # and the registers' 256 (each config's own path)
    long = torch.zeros(4, 100, device=DEVICE)
    long[0, [7, 60, 99]] = torch.tensor([1.0, 2.0, 3.0], device=DEVICE)
    long[1, 40:] = 1.0
    long[2, 1::2] = -0.0
    long[2, [5, 77]] = 1.0
    long[3, :] = torch.arange(100, device=DEVICE) % 4  # 20 ties at the top value: cut inside them
    pos = torch.tensor([99, 99, 99, 81], device=DEVICE)  # the last row: its first 82 blocks
    out = tq.block_topk(scores=long, positions=pos, compress_ratio=1, top_blocks=6, config=cfg)
    assert out.tolist() == [[0, 1, 2, 7, 60, 99], [40, 41, 42, 43, 44, 45], [0, 1, 2, 3, 5, 77],
                            [3, 7, 11, 15, 19, 23]]  # fmt: skip
    assert out.tolist() == lowest_index_topk(long, pos, 1, 6)


@pytest.mark.parametrize(
    "block_size, ratio, top_blocks, heads, kv_heads, head_dim",
    [(4, 3, 4, 6, 2, 16), (16, 4, 3, 4, 1, 12), (2, 5, 2, 8, 2, 20), (16, 16, 2, 3, 3, 32)],
)
def test_sparse_attention_matches_naive(nan_fill, block_size, ratio, top_blocks, heads, kv_heads, head_dim):
    torch.manual_seed(3)
    # queries: the last 3 of 90 tokens, 7..13 of a 13-token prefill, a 1-token sequence, 46..47 of 47
    lens, new = [90, 13, 1, 47], [3, 7, 1, 2]
    b = Batch(lens, new, block_size, head_dim).to(DEVICE)
    k_cache = torch.randn(b.num_blocks, block_size, kv_heads, head_dim, device=DEVICE)
    v_cache = torch.randn(b.num_blocks, block_size, kv_heads, head_dim, device=DEVICE)
    q = torch.randn(len(b.positions), heads, head_dim, device=DEVICE)
    scores = torch.rand(len(b.positions), b.max_len // ratio + 1, device=DEVICE)
    selected = naive.block_topk(scores=scores, positions=b.positions, compress_ratio=ratio, top_blocks=top_blocks)
    kw = dict(q=q, k_cache=k_cache, v_cache=v_cache, positions=b.positions, token_rows=b.rows,
              block_tables=b.block_tables, selected=selected, compress_ratio=ratio, scale=head_dim**-0.5)  # fmt: skip
    assert rel_err(tq.sparse_attention(**kw), naive.sparse_attention(**kw)) <= TOL


@pytest.mark.parametrize("num_splits", [None, 1, 7])
def test_sparse_attention_split_matches_naive(nan_fill, num_splits):
    """Each query's position list cut into spans of whole 16-entry tiles (flash-decoding) and merged:
    lists shorter than one span, odd lengths ending mid-tile, queries with fewer spans than splits
    (the merge reads only theirs), a query that attends to itself through its just-completed block.
    7 splits: spans of one tile, most of them empty; the default: one program a query for the batch,
    and spans of two tiles for the lone decode row (2 splits on CPU)."""
    torch.manual_seed(7)
    ratio, top, heads, kv_heads, head_dim = 3, 20, 6, 2, 16
    # lists (selected blocks' tokens + tail): 62, 4, 1, 47 / 48 (pos 47 closes its own block), 60
    lens, new = [95, 4, 1, 48, 66], [1, 1, 1, 2, 1]
    b = Batch(lens, new, 4, head_dim).to(DEVICE)
    k_cache = torch.randn(b.num_blocks, 4, kv_heads, head_dim, device=DEVICE)
    v_cache = torch.randn(b.num_blocks, 4, kv_heads, head_dim, device=DEVICE)
    q = torch.randn(len(b.positions), heads, head_dim, device=DEVICE)
    scores = torch.rand(len(b.positions), b.max_len // ratio + 1, device=DEVICE)
    selected = naive.block_topk(scores=scores, positions=b.positions, compress_ratio=ratio, top_blocks=top)
    kw = dict(q=q, k_cache=k_cache, v_cache=v_cache, positions=b.positions, token_rows=b.rows,
              block_tables=b.block_tables, selected=selected, compress_ratio=ratio, scale=head_dim**-0.5)  # fmt: skip
    ref = naive.sparse_attention(**kw)
    assert rel_err(tq.sparse_attention(**kw, num_splits=num_splits), ref) <= TOL
    # one decode row alone: the default cuts its list (6 tokens x 2 kv heads fill the interpreter's
    # grid, 1 x 2 do not)
    one = dict(kw, q=q[:1], positions=b.positions[:1], token_rows=b.rows[:1], selected=selected[:1])
    assert rel_err(tq.sparse_attention(**one, num_splits=num_splits), ref[:1]) <= TOL
    if num_splits is None and DEVICE == "cpu":
        auto = dict(num_kv_heads=kv_heads, max_list=(top + 1) * ratio - 1, block_n=16, num_sms=4)
        assert tq.sparse_splits(num_tokens=1, **auto) > 1 == tq.sparse_splits(num_tokens=6, **auto)


def test_sparse_splits_follow_the_grid():
    """At the benchmark's shapes on an H200 (132 SMs, a list of 2,063 entries, 32-entry tiles):
    decode at batch 1 and 16 is cut, in spans of at least two tiles; prefill chunks and large batches
    keep one program per token and kv head."""
    kw = dict(num_kv_heads=2, max_list=2063, block_n=32, num_sms=132)
    one, sixteen = tq.sparse_splits(num_tokens=1, **kw), tq.sparse_splits(num_tokens=16, **kw)
    assert 16 <= one <= tq.MAX_SPLITS and 4 <= sixteen < one
    span = math.ceil(math.ceil(2063 / one) / 32) * 32  # the kernel's span: whole tiles
    assert span >= 2 * 32 and math.ceil(2063 / span) == one  # at least two tiles each, no empty span
    assert tq.sparse_splits(num_tokens=2048, **kw) == 1 and tq.sparse_splits(num_tokens=256, **kw) == 1
    assert tq.sparse_splits(num_tokens=1, num_kv_heads=2, max_list=40, block_n=32, num_sms=132) == 1


def test_sparse_attention_with_everything_selected_is_dense_attention(nan_fill):
    """While a query has no more complete blocks than it keeps, it attends to its whole prefix."""
    from deltaserve.layers.kernels.attention import naive as attention_naive

    torch.manual_seed(4)
    # the last 4 of 20 tokens (lists of 17..20: two tiles) and of 7 (a block and a tail)
    lens, new = [20, 7], [4, 4]
    b = Batch(lens, new, 4, 16).to(DEVICE)
    k_cache = torch.randn(b.num_blocks, 4, 2, 16, device=DEVICE)
    v_cache = torch.randn(b.num_blocks, 4, 2, 16, device=DEVICE)
    q = torch.randn(8, 4, 16, device=DEVICE)
    selected = naive.block_topk(scores=torch.zeros(8, 10, device=DEVICE), positions=b.positions, compress_ratio=3,
                                top_blocks=7)  # fmt: skip
    out = tq.sparse_attention(q=q, k_cache=k_cache, v_cache=v_cache, positions=b.positions, token_rows=b.rows,
                              block_tables=b.block_tables, selected=selected, compress_ratio=3, scale=0.25)  # fmt: skip
    ref = attention_naive.paged_attention(q=q, k_cache=k_cache, v_cache=v_cache, scale=0.25, seq_lens=b.seq_lens,
                                          cu_seqlens_q=torch.tensor([0, 4, 8], device=DEVICE),
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
