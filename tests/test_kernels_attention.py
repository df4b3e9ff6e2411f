"""Triton paged attention vs the plain-torch reference at tiny shapes: interpreted on CPU tensors
without CUDA, compiled on the GPU with it; and (marked gpu) bf16 at the real shapes."""

import itertools

import pytest
import torch

from deltaserve.layers.kernels.attention import naive
from deltaserve.layers.kernels.attention import triton_attention as ta
from deltaserve.layers.kernels.attention import triton_decode as td

# conftest: TRITON_INTERPRET without CUDA, the `device` fixture, gpu-marked tests skipped on CPU
pytestmark = pytest.mark.usefixtures("nan_fill")


def tol(device: torch.device) -> float:
    """float32 inputs: exact-ish under the interpreter; tf32 tl.dot on the GPU."""
    return 1e-5 if device.type == "cpu" else 5e-3


def make_batch(*, q_lens, ctx_lens, hq, hkv, d, block_size, dtype=torch.float32, device="cpu", seed=0):
    """Sequences with `ctx_lens` cached tokens plus `q_lens` new ones, pages in a scrambled order,
    and garbage in every page that no sequence owns."""
    g = torch.Generator().manual_seed(seed)
    seq_lens = [a + b for a, b in zip(q_lens, ctx_lens, strict=True)]
    pages_per_seq = [(n + block_size - 1) // block_size for n in seq_lens]
    max_pages = max(pages_per_seq) + 1
    num_blocks = sum(pages_per_seq) + 3
    perm = torch.randperm(num_blocks, generator=g)
    block_tables = torch.zeros(len(q_lens), max_pages, dtype=torch.int32)
    used = 0
    for i, p in enumerate(pages_per_seq):
        block_tables[i, :p] = perm[used : used + p].to(torch.int32)
        used += p
    k_cache = torch.randn(num_blocks, block_size, hkv, d, generator=g).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, hkv, d, generator=g).to(dtype)
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    q = torch.randn(int(cu[-1]), hq, d, generator=g).to(dtype)
    to = dict(device=device)
    return dict(
        q=q.to(**to),
        k_cache=k_cache.to(**to),
        v_cache=v_cache.to(**to),
        cu_seqlens_q=cu.to(**to),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=block_tables.to(**to),
    )


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert not out.isnan().any(), "NaN in the output (an element was never written)"
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


@pytest.mark.parametrize("hkv,d", [(2, 16), (3, 24)])
def test_write_kv_cache(device, hkv, d):
    g = torch.Generator().manual_seed(1)
    num_blocks, block_size = 5, 4
    key = torch.randn(6, hkv, d, generator=g).to(device)
    value = torch.randn(6, hkv, d, generator=g).to(device)
    slots = torch.tensor([13, -1, 2, 7, -1, 19], device=device)
    k_cache = torch.randn(num_blocks, block_size, hkv, d, generator=g).to(device)
    v_cache = torch.randn(num_blocks, block_size, hkv, d, generator=g).to(device)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    naive.write_kv_cache(key=key, value=value, k_cache=k_ref, v_cache=v_ref, slot_mapping=slots)
    ta.write_kv_cache(key=key, value=value, k_cache=k_cache, v_cache=v_cache, slot_mapping=slots)
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)
    # the reference itself: written slots hold the tokens, all others kept their old contents
    flat_k = k_cache.view(-1, hkv, d)
    assert torch.equal(flat_k[13], key[0]) and torch.equal(flat_k[19], key[5])
    untouched = torch.ones(num_blocks * block_size, dtype=torch.bool, device=device)
    untouched[[13, 2, 7, 19]] = False
    assert torch.equal(flat_k[untouched], k_ref.view(-1, hkv, d)[untouched])


def test_write_kv_cache_strided_key(device):
    """key / value as views of a fused projection (row stride larger than Hkv * D)."""
    kv = torch.randn(4, 2, 2 * 16, device=device)
    key, value = kv[..., :16], kv[..., 16:]
    k_cache, v_cache = torch.zeros(3, 4, 2, 16, device=device), torch.zeros(3, 4, 2, 16, device=device)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    slots = torch.tensor([0, 5, -1, 11], device=device)
    naive.write_kv_cache(key=key, value=value, k_cache=k_ref, v_cache=v_ref, slot_mapping=slots)
    ta.write_kv_cache(key=key, value=value, k_cache=k_cache, v_cache=v_cache, slot_mapping=slots)
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)


PREFILL_CASES = [
    # hq, hkv, d: GQA ratios 1 and 3, head dims that are not powers of two
    (4, 4, 16),
    (6, 2, 24),
    (3, 1, 40),
]


@pytest.mark.parametrize("hq,hkv,d", PREFILL_CASES)
def test_paged_attention_varlen(device, hq, hkv, d):
    """1-token and odd rows; the last sequence spans two q tiles and a tail at every group (16 rows
    a tile on CPU: 16 + 5 tokens at group 1, 5 tokens a tile at group 3) over keys that end mid-tile."""
    batch = make_batch(q_lens=[1, 7, 21], ctx_lens=[0, 5, 12], hq=hq, hkv=hkv, d=d, block_size=4, device=device)
    ref = naive.paged_attention(**batch, scale=d**-0.5)
    out = ta.paged_attention(**batch, scale=d**-0.5)
    assert rel_err(out, ref) < tol(device)


def test_paged_attention_scans_sequences_in_blocks(device, monkeypatch):
    """More sequences than one scan block (the owner search runs several steps), one of them empty."""
    monkeypatch.setattr(ta, "PREFILL_SEQ_BLOCK", 2)
    batch = make_batch(
        q_lens=[3, 1, 0, 9, 2], ctx_lens=[4, 0, 6, 1, 13], hq=4, hkv=2, d=16, block_size=4, device=device
    )
    ref = naive.paged_attention(**batch, scale=0.25)
    out = ta.paged_attention(**batch, scale=0.25)
    assert rel_err(out, ref) < tol(device)


def test_paged_attention_empty_sequence_and_tile_shapes(device):
    """A sequence with no new tokens in the batch, strided q, and tiles of several tokens with a group
    that does not divide the tile rows (group 3 in 32 rows: 10 tokens, 2 padding rows)."""
    batch = make_batch(q_lens=[9, 0, 20, 2], ctx_lens=[3, 4, 0, 30], hq=6, hkv=2, d=16, block_size=8, device=device)
    q_wide = torch.randn(batch["q"].shape[0], 6, 48, device=device)
    q_wide[..., :16] = batch["q"]
    batch["q"] = q_wide[..., :16]
    ref = naive.paged_attention(**batch, scale=0.3)
    for cfg in [dict(block_m=32, block_n=16, num_warps=4, num_stages=1), dict(block_m=16, block_n=32, num_warps=4)]:
        cfg.setdefault("num_stages", 1)
        out = ta.paged_attention(**batch, scale=0.3, config=cfg)
        assert rel_err(out, ref) < tol(device)


SPLIT_CASES = [
    # q_lens, ctx_lens, num_splits (16-key tiles, 5 tokens a q tile at group 3):
    # few queries over a long context at the most splits (PREFILL_MAX_SPLITS): 18 full tiles, spans
    # of 2 tiles, spans 9..15 left empty, a merge of two 8-span chunks
    ([3], [300], 16),
    # odd and varlen: a 1-token sequence without context (only the masked step, in span 0; the other
    # spans empty), two q tiles over 6 full key tiles (spans of 2, the last also runs the masked tiles)
    ([5, 1, 9], [37, 0, 100], 3),
    # contexts shorter than the split: q tiles with no full key tile, one with one (span 1 empty)
    ([17, 2], [1, 61], 2),
]


@pytest.mark.parametrize("q_lens,ctx_lens,num_splits", SPLIT_CASES)
def test_paged_attention_split_k(device, q_lens, ctx_lens, num_splits):
    """Key spans per q tile merged by their log2-sum-exp: the reference's result at 2, 3 and 16
    splits, spans left empty by short contexts included (NaN-filled buffers: every row written)."""
    batch = make_batch(q_lens=q_lens, ctx_lens=ctx_lens, hq=6, hkv=2, d=24, block_size=4, device=device)
    ref = naive.paged_attention(**batch, scale=0.3)
    cfg = dict(block_m=16, block_n=16, num_warps=4, num_stages=1, num_splits=num_splits)
    out = ta.paged_attention(**batch, scale=0.3, config=cfg)
    assert rel_err(out, ref) < tol(device)


@pytest.mark.parametrize("num_splits", [1, 3])
def test_paged_attention_output_gate(device, num_splits):
    """The gate (a strided view, as the layer's q|gate projection gives it) applied before the one
    rounding, by the single kernel and by the split's merge; the reference is the ungated result times
    sigmoid(gate)."""
    batch = make_batch(q_lens=[2, 1, 7], ctx_lens=[37, 0, 40], hq=6, hkv=2, d=24, block_size=4, device=device)
    qg = torch.randn(batch["q"].shape[0], 6, 48, device=device)
    gate = qg[..., 24:]
    ref = naive.paged_attention(**batch, scale=0.3) * torch.sigmoid(gate)
    assert rel_err(naive.paged_attention(**batch, scale=0.3, output_gate=gate), ref) < 1e-6
    cfg = dict(block_m=16, block_n=16, num_warps=4, num_stages=1, num_splits=num_splits)
    out = ta.paged_attention(**batch, scale=0.3, output_gate=gate, config=cfg)
    assert rel_err(out, ref) < tol(device)


def test_paged_attention_splits_long_context_by_itself(device):
    """Without a config: a few queries whose block tables span more than two SPLIT_MIN_KEYS (the
    split count follows the table's width, as in the CUDA-graph tables of max_pages) split on their
    own (the interpreter's 4 "SMs"), and match the reference; the longer context fills both spans."""
    batch = make_batch(q_lens=[2, 1], ctx_lens=[300, 40], hq=4, hkv=1, d=16, block_size=16, device=device)
    width = 2 * ta.SPLIT_MIN_KEYS // 16 + 1  # pages; the columns past a sequence's own are never read
    tables = batch["block_tables"]
    batch["block_tables"] = torch.cat([tables, tables.new_zeros(2, width - tables.shape[1])], dim=1)
    info = ta.device_info(batch["q"].device)
    programs = 3 // (ta._prefill_config(16, 4, 4, info)["block_m"] // 4) + 2
    assert ta._prefill_splits(programs, width * 16, info) > 1
    ref = naive.paged_attention(**batch, scale=0.25)
    assert rel_err(ta.paged_attention(**batch, scale=0.25), ref) < tol(device)


def test_prefill_split_rule():
    """Split only when the programs leave SMs idle and the context is long; never more than the cap."""
    h200 = ta.DeviceInfo("NVIDIA H200", 132, 227 * 1024, (9, 0))
    # 256 queries (16-token tiles) x 2 kv heads over 16.6k keys: 34 programs on 132 SMs
    splits = ta._prefill_splits(34, 16640, h200)
    assert 3 <= splits <= ta.PREFILL_MAX_SPLITS and 34 * splits >= 132
    assert ta._prefill_splits(34, 1024, h200) == 1  # a short context
    assert ta._prefill_splits(1026, 16640, h200) == 1  # 8k queries fill the GPU already
    assert ta._prefill_splits(2, 1 << 20, h200) == ta.PREFILL_MAX_SPLITS


@pytest.mark.parametrize(
    "hq,hkv,d,num_splits",
    [(*PREFILL_CASES[0], None), (*PREFILL_CASES[1], 1), (*PREFILL_CASES[0], 3), (*PREFILL_CASES[1], 8)],
)
def test_paged_decode_attention(device, hq, hkv, d, num_splits):
    """Different lengths per sequence, no gate; the default config (3 splits under the interpreter),
    one split (the direct store) and the split reduce; 8 splits leave the short sequences' last
    spans empty. Each head shape meets the single-split store and the reduce."""
    batch = make_batch(q_lens=[1, 1, 1, 1], ctx_lens=[0, 4, 16, 45], hq=hq, hkv=hkv, d=d, block_size=4, device=device)
    del batch["cu_seqlens_q"]
    ref = naive.paged_decode_attention(**batch, scale=0.2)
    cfg = None if num_splits is None else dict(block_n=16, num_splits=num_splits, num_warps=4, num_stages=1)
    out = td.paged_decode_attention(**batch, scale=0.2, config=cfg)
    assert rel_err(out, ref) < tol(device)


@pytest.mark.parametrize("num_splits", [3])
def test_paged_decode_attention_output_gate(device, num_splits):
    """The gated attention's output gate applied in the kernel (here the split reduce; the single-
    split store's gate: test_decode_odd_lengths[s1] and test_decode_kernel_on_verify_rows[3-1]):
    attention * sigmoid(gate), the gate a strided view as the layer slices it; the reference's gate
    is the ungated reference times sigmoid(gate)."""
    batch = make_batch(q_lens=[1, 1, 1], ctx_lens=[3, 0, 29], hq=4, hkv=2, d=24, block_size=4, seed=5, device=device)
    del batch["cu_seqlens_q"]
    g = torch.Generator().manual_seed(9)
    q_gate = torch.randn(3, 4, 2 * 24, generator=g).to(device)  # [N, H, q | gate]
    gate = q_gate[..., 24:]
    plain = naive.paged_decode_attention(**batch, scale=0.2)
    ref = naive.paged_decode_attention(**batch, scale=0.2, output_gate=gate)
    assert torch.allclose(ref, plain * torch.sigmoid(gate), atol=1e-6)
    cfg = dict(block_n=16, num_splits=num_splits, num_warps=4, num_stages=1)
    out = td.paged_decode_attention(**batch, scale=0.2, output_gate=gate, config=cfg)
    assert rel_err(out, ref) < tol(device)


@pytest.mark.parametrize("rows,num_splits", [(2, None), (3, 1), (4, 8)])
def test_decode_kernel_on_verify_rows(device, rows, num_splits):
    """tokens_per_row rows a sequence (a speculative verify): the same as causal attention of those
    queries through the prefill reference, gated; a sequence with no context before the pass, the
    pass's tokens across a page boundary (pages of 4) and, at 4 rows, across a key tile and span
    boundary (positions 29..32 of 16-key spans: the last span holds only pass tokens; 8 splits also
    leave spans empty), pages scrambled. The default config (2 splits on CPU), the single-split
    store, the reduce over 8 splits."""
    from deltaserve.layers.kernels import attention as attn_kernels

    ctx_lens = [0, 3, 29]
    batch = make_batch(q_lens=[rows] * 3, ctx_lens=ctx_lens, hq=4, hkv=2, d=24, block_size=4, seed=rows, device=device)
    g = torch.Generator().manual_seed(11)
    gate = torch.randn(3 * rows, 4, 2 * 24, generator=g).to(device)[..., 24:]
    ref = (naive.paged_attention(**batch, scale=0.2) * torch.sigmoid(gate)).to(gate.dtype)
    del batch["cu_seqlens_q"]
    assert rel_err(naive.paged_decode_attention(**batch, scale=0.2, output_gate=gate, tokens_per_row=rows), ref) < 1e-6
    cfg = None if num_splits is None else dict(block_n=16, num_splits=num_splits, num_warps=4, num_stages=1)
    out = td.paged_decode_attention(**batch, scale=0.2, output_gate=gate, config=cfg, tokens_per_row=rows)
    assert rel_err(out, ref) < tol(device)
    with pytest.raises(ValueError, match="tokens_per_row"):
        attn_kernels.paged_decode_attention(**batch, scale=0.2, tokens_per_row=rows + 1)


def test_decode_matches_prefill_of_one_token(device):
    batch = make_batch(q_lens=[1, 1, 1], ctx_lens=[7, 0, 22], hq=6, hkv=2, d=24, block_size=4, seed=3, device=device)
    prefill = ta.paged_attention(**batch, scale=0.25)
    del batch["cu_seqlens_q"]
    decode = td.paged_decode_attention(**batch, scale=0.25)
    assert rel_err(decode, prefill) < tol(device)


# --- split decode: span merges over odd lengths, head groups, CUDA-graph padding rows --------------


def decode_batch(ctx_lens, *, hq=8, hkv=2, d=24, block_size=4, seed=0, device="cpu", gate=True):
    """One decode query per sequence (`ctx_lens` cached tokens + the new one, pages scrambled) and
    the layer's output gate: a strided view of a [N, Hq, q | gate] projection."""
    batch = make_batch(
        q_lens=[1] * len(ctx_lens), ctx_lens=ctx_lens, hq=hq, hkv=hkv, d=d, block_size=block_size, seed=seed,
        device=device,
    )  # fmt: skip
    del batch["cu_seqlens_q"]
    if gate:
        q_gate = torch.randn(len(ctx_lens), hq, 2 * d, generator=torch.Generator().manual_seed(seed + 1))
        batch["output_gate"] = q_gate.to(device)[..., d:]
    return batch


def assert_matches_reference(device, batch, cfg, scale=0.3):
    ref = naive.paged_decode_attention(**batch, scale=scale)
    out = td.paged_decode_attention(**batch, scale=scale, config=cfg)
    assert rel_err(out, ref) < tol(device)
    return out


# one span (its unmasked tiles, then the masked tail), spans of 3 tiles (100 keys at 3 splits),
# spans of one tile with the rest empty (8 and 32 splits), the last span holding only the new token
# (33 keys in 16-key spans), and merges read in chunks of 2 and 4 spans (7 spans of 100 keys: the
# last chunk partial); the default chunk reads all spans at once (3 splits)
SPLIT_CONFIGS = [
    dict(block_n=16, num_splits=1, num_warps=4, num_stages=1),
    dict(block_n=16, num_splits=3, num_warps=4, num_stages=1),
    dict(block_n=16, num_splits=8, num_warps=4, num_stages=1, merge_chunk=2),
    dict(block_n=16, num_splits=32, num_warps=4, num_stages=1, merge_chunk=4),
]


@pytest.mark.parametrize("cfg", SPLIT_CONFIGS, ids=lambda c: f"s{c['num_splits']}c{c.get('merge_chunk')}")
def test_decode_odd_lengths(device, cfg):
    """Context lengths 1, 2, 17, 33, 100 (positions cached after this step; the new token is the
    last) in one batch, pages out of order, the layer's gate; outputs start as NaN (nan_fill)."""
    batch = decode_batch([0, 1, 16, 32, 99], device=device)
    out = assert_matches_reference(device, batch, cfg)
    assert not out.isnan().any()


@pytest.mark.parametrize("hq,hkv,d,splits", [(4, 4, 16, 2), (6, 2, 24, 5), (16, 2, 32, 3)])
def test_decode_head_groups(device, hq, hkv, d, splits):
    """GQA groups 1, 3 and 8; without the gate; pages of 16 (one page a key tile); 5 splits leave
    the 7-token context's spans empty."""
    batch = decode_batch([40, 7, 70], hq=hq, hkv=hkv, d=d, block_size=16, seed=2, device=device, gate=False)
    assert_matches_reference(device, batch, dict(block_n=16, num_splits=splits, num_warps=4, num_stages=1))


def test_decode_padding_rows(device):
    """CUDA-graph padding (workers/cuda_graph.py): rows past the batch have seq_len 1 and the
    scratch page first in their table row (their slot is -1: nothing was written there)."""
    batch = decode_batch([20, 63, 0, 0, 0], block_size=4, seed=4, device=device)
    scratch = batch["k_cache"].shape[0] - 1
    batch["block_tables"][2:] = 0
    batch["block_tables"][2:, 0] = scratch
    batch["seq_lens"][2:] = 1
    out = assert_matches_reference(device, batch, dict(block_n=16, num_splits=4, num_warps=4, num_stages=1))
    # a padding row attends to the scratch page's first position alone
    v0 = batch["v_cache"][scratch, 0].repeat_interleave(4, dim=0)
    assert torch.allclose(out[2], v0 * torch.sigmoid(batch["output_gate"][2]), atol=1e-5)


# --- GPU, bf16, the real shapes (16 q heads, 2 kv heads, head dim 256, pages of 16) ---------------


@pytest.mark.gpu
def test_gpu_write_kv_cache():
    key = torch.randn(300, 2, 256, device="cuda", dtype=torch.bfloat16)
    value = torch.randn_like(key)
    slots = torch.randperm(4096, device="cuda")[:300]
    slots[::7] = -1
    k_cache = torch.randn(256, 16, 2, 256, device="cuda", dtype=torch.bfloat16)
    v_cache = torch.randn_like(k_cache)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    naive.write_kv_cache(key=key, value=value, k_cache=k_ref, v_cache=v_ref, slot_mapping=slots)
    ta.write_kv_cache(key=key, value=value, k_cache=k_cache, v_cache=v_cache, slot_mapping=slots)
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)


@pytest.mark.gpu
def test_gpu_paged_attention_bf16():
    batch = make_batch(
        q_lens=[1, 130, 1000, 2047],
        ctx_lens=[0, 77, 3000, 16],
        hq=16,
        hkv=2,
        d=256,
        block_size=16,
        dtype=torch.bfloat16,
        device="cuda",
    )
    ref = naive.paged_attention(**batch, scale=256**-0.5)
    out = ta.paged_attention(**batch, scale=256**-0.5)
    assert rel_err(out, ref) < 1e-2


@pytest.mark.gpu
def test_gpu_split_prefill_few_queries_over_long_context():
    """The prefix-cache hit's shape: 256 new tokens after 16,384 cached ones (split-K chosen by
    itself), and a batch of varlen continuations; one compiled prefill variant for every split count."""
    batch = make_batch(
        q_lens=[256], ctx_lens=[16384], hq=16, hkv=2, d=256, block_size=16, dtype=torch.bfloat16, device="cuda"
    )
    ref = naive.paged_attention(**batch, scale=256**-0.5)
    assert rel_err(ta.paged_attention(**batch, scale=256**-0.5), ref) < 1e-2
    cfg = ta._prefill_config(256, 8, 2, ta.device_info(torch.device("cuda")))
    counts = []
    for splits in (1, 2, 5, 16):
        out = ta.paged_attention(**batch, scale=256**-0.5, config=dict(cfg, num_splits=splits))
        assert rel_err(out, ref) < 1e-2
        counts.append(sum(len(c[0]) for c in ta._prefill_kernel.device_caches.values()))
    assert counts[1:] == [counts[0]] * 3
    varlen = make_batch(
        q_lens=[3, 130, 17], ctx_lens=[9000, 4001, 0], hq=16, hkv=2, d=256, block_size=16, dtype=torch.bfloat16,
        device="cuda",
    )  # fmt: skip
    ref = naive.paged_attention(**varlen, scale=256**-0.5)
    assert rel_err(ta.paged_attention(**varlen, scale=256**-0.5), ref) < 1e-2
    gate = torch.randn(150, 16, 512, device="cuda", dtype=torch.bfloat16)[..., 256:]  # the layer's q|gate view
    ref = naive.paged_attention(**varlen, scale=256**-0.5, output_gate=gate)
    for splits in (1, 4):
        cfg_s = dict(cfg, num_splits=splits)
        assert rel_err(ta.paged_attention(**varlen, scale=256**-0.5, output_gate=gate, config=cfg_s), ref) < 1e-2


def real_decode_batch(ctx_lens: list[int]) -> dict:
    """One decode query per sequence at the model's attention shape, bf16 on the GPU."""
    batch = make_batch(
        q_lens=[1] * len(ctx_lens), ctx_lens=ctx_lens, hq=16, hkv=2, d=256, block_size=16,
        dtype=torch.bfloat16, device="cuda",
    )  # fmt: skip
    del batch["cu_seqlens_q"]
    return batch


@pytest.mark.gpu
@pytest.mark.parametrize("batch_size", [1, 64])
def test_gpu_paged_decode_attention_bf16(batch_size):
    g = torch.Generator().manual_seed(batch_size)
    ctx = torch.randint(1, 4096, (batch_size,), generator=g).tolist()
    ctx[0] = 4095
    batch = real_decode_batch(ctx)
    ref = naive.paged_decode_attention(**batch, scale=256**-0.5)
    out = td.paged_decode_attention(**batch, scale=256**-0.5)
    assert rel_err(out, ref) < 1e-2


@pytest.mark.gpu
def test_gpu_decode_split_counts_share_one_compiled_variant():
    """The split count follows the batch's decode rows; it is a run-time argument, so passes with
    3, 5, 6, 7 and 9 splits run the kernels compiled for the first of them (no mid-serving compile)."""
    batch = real_decode_batch([700, 90, 1500])
    ref = naive.paged_decode_attention(**batch, scale=0.0625)

    def variants() -> int:
        return sum(
            len(cache[0]) for k in (td._decode_kernel, td._decode_reduce_kernel) for cache in k.device_caches.values()
        )

    counts = []
    for splits in (3, 5, 6, 7, 9):
        out = td.paged_decode_attention(
            **batch, scale=0.0625, config=dict(block_n=32, num_splits=splits, num_warps=4, num_stages=5)
        )
        assert rel_err(out, ref) < 1e-2
        counts.append(variants())
    assert counts[1:] == [counts[0]] * 4


@pytest.mark.gpu
def test_gpu_decode_graph_with_wide_block_tables():
    """Serving's decode graphs at a long max context: 64 calls (each its own pool) captured with PDL,
    block tables 4,096 pages wide (64 splits of which a 512-token row fills few), replayed three
    times: each call's output is its eager result (the bench case that faulted once at 754c7e3)."""
    batches = []
    for _ in range(64):
        batch = real_decode_batch([512])
        wide = torch.zeros((1, 4096), dtype=torch.int32, device="cuda")
        wide[:, : batch["block_tables"].shape[1]] = batch["block_tables"]
        batch["block_tables"] = wide
        batch["output_gate"] = torch.randn(1, 16, 256, device="cuda", dtype=torch.bfloat16)
        batches.append(batch)
    want = [td.paged_decode_attention(**b, scale=0.0625) for b in batches]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for b in batches:
            td.paged_decode_attention(**b, scale=0.0625)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = [td.paged_decode_attention(**b, scale=0.0625) for b in batches]
    for _ in range(3):
        graph.replay()
        torch.cuda.synchronize()
        assert all(torch.equal(o, w) for o, w in zip(outs, want, strict=True))


@pytest.mark.gpu
@pytest.mark.parametrize("batch_size", [1, 16])
def test_gpu_decode_output_gate_bf16(batch_size):
    """The model's shape with the gate, PDL on and off: the same bits."""
    g = torch.Generator().manual_seed(100 + batch_size)
    ctx = torch.randint(0, 1200, (batch_size,), generator=g).tolist()
    ctx[0] = 511
    batch = real_decode_batch(ctx)
    batch["output_gate"] = torch.randn(batch_size, 16, 512, device="cuda", dtype=torch.bfloat16)[..., 256:]
    ref = naive.paged_decode_attention(**batch, scale=0.0625)
    out = td.paged_decode_attention(**batch, scale=0.0625)
    assert rel_err(out, ref) < 1e-2
    assert torch.equal(td.paged_decode_attention(**batch, scale=0.0625, pdl=False), out)


@pytest.mark.gpu
def test_gpu_decode_cuda_graph_replays():
    """Captured once (PDL on, as the decode graphs), replayed with new lengths and queries."""
    batch = real_decode_batch([600, 30, 200])
    td.paged_decode_attention(**batch, scale=0.0625)  # compiles outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = td.paged_decode_attention(**batch, scale=0.0625)
    for step in range(3):
        batch["seq_lens"].copy_(torch.tensor([601 - 100 * step, 31 - 10 * step, 1 + 50 * step], dtype=torch.int32))
        batch["q"].normal_()
        graph.replay()
        torch.cuda.synchronize()
        assert rel_err(out, naive.paged_decode_attention(**batch, scale=0.0625)) < 1e-2


# ---- FP8 KV cache (kv_cache_dtype fp8: e4m3, scale 1) -------------------------------------------------
FP8 = torch.float8_e4m3fn


def fp8_batch(device, **kw):
    """make_batch with the caches rounded to e4m3 (values up to ~4: well inside its range)."""
    batch = make_batch(device=device, **kw)
    batch["k_cache"], batch["v_cache"] = batch["k_cache"].to(FP8), batch["v_cache"].to(FP8)
    return batch


def test_write_kv_cache_fp8_saturates_and_rounds_as_torch(device):
    """An e4m3 cache: out-of-range values saturate at +-448 (no NaN), the rest round to nearest even,
    bit for bit as the reference; padding slots write nothing."""
    g = torch.Generator().manual_seed(3)
    key = torch.randn(5, 2, 16, generator=g) * 3
    key[0, 0, :4] = torch.tensor([1e4, -1e4, 449.0, 1e-5])
    value = torch.randn(5, 2, 16, generator=g) * 300  # many beyond 448
    key, value = key.to(device), value.to(device)
    slots = torch.tensor([3, -1, 9, 0, 14], device=device)
    k_cache = torch.randn(4, 4, 2, 16, generator=g).to(FP8).to(device)
    v_cache = torch.randn(4, 4, 2, 16, generator=g).to(FP8).to(device)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    naive.write_kv_cache(key=key, value=value, k_cache=k_ref, v_cache=v_ref, slot_mapping=slots)
    ta.write_kv_cache(key=key, value=value, k_cache=k_cache, v_cache=v_cache, slot_mapping=slots)
    assert torch.equal(k_cache.view(torch.uint8), k_ref.view(torch.uint8))
    assert torch.equal(v_cache.view(torch.uint8), v_ref.view(torch.uint8))
    flat_k, flat_v = k_ref.view(-1, 2, 16).float(), v_ref.view(-1, 2, 16).float()
    assert flat_k[3, 0, :4].tolist() == [448.0, -448.0, 448.0, 0.0]
    assert not flat_v.isnan().any() and flat_v.abs().max() == 448.0
    assert torch.equal(flat_k[9], key[2].float().to(FP8).float())  # in range: one rounding


@pytest.mark.parametrize("num_splits", [1, 3])
def test_paged_attention_fp8_cache(device, num_splits):
    """Prefill over e4m3 pages (the single kernel and split-K): the tiles upcast to q's dtype, so the
    result is the reference's over the same (dequantized) pages."""
    batch = fp8_batch(device, q_lens=[1, 7, 21], ctx_lens=[0, 5, 40], hq=6, hkv=2, d=24, block_size=4)
    ref = naive.paged_attention(**batch, scale=0.3)
    cfg = dict(block_m=16, block_n=16, num_warps=4, num_stages=1, num_splits=num_splits)
    out = ta.paged_attention(**batch, scale=0.3, config=cfg)
    assert rel_err(out, ref) < tol(device)


@pytest.mark.parametrize("rows,num_splits", [(1, 1), (1, 3), (3, 2)])
def test_paged_decode_attention_fp8_cache(device, rows, num_splits):
    """Decode over e4m3 pages (one split's direct store, the split reduce, verify rows with several
    tokens a sequence), gated: the reference's result over the same pages."""
    from deltaserve.layers.kernels import attention as attn_kernels

    ctx_lens = [0, 3, 29]
    batch = fp8_batch(device, q_lens=[rows] * 3, ctx_lens=ctx_lens, hq=4, hkv=2, d=24, block_size=4, seed=4)
    del batch["cu_seqlens_q"]
    gate = torch.randn(batch["q"].shape, generator=torch.Generator().manual_seed(5)).to(device)
    ref = naive.paged_decode_attention(**batch, scale=0.2, output_gate=gate, tokens_per_row=rows)
    cfg = dict(block_n=16, num_splits=num_splits, num_warps=4, num_stages=1)
    out = td.paged_decode_attention(**batch, scale=0.2, output_gate=gate, config=cfg, tokens_per_row=rows)
    assert rel_err(out, ref) < tol(device)
    # the public op takes the same path
    out = attn_kernels.paged_decode_attention(**batch, scale=0.2, output_gate=gate, tokens_per_row=rows)
    assert rel_err(out, ref) < tol(device)


def test_paged_decode_attention_fp8_cache_fp16_dots(device):
    """bf16 q over e4m3 pages with fp16 dots (the default; e4m3 and the probabilities are exact in
    fp16), so the result is the bf16 reference's within bf16 rounding; the same from bf16 dots on the
    GPU (the interpreter cannot run bf16 dots)."""
    batch = fp8_batch(device, q_lens=[1] * 3, ctx_lens=[0, 3, 29], hq=4, hkv=2, d=24, block_size=4, seed=6)
    del batch["cu_seqlens_q"]
    batch["q"] = batch["q"].to(torch.bfloat16)
    ref = naive.paged_decode_attention(**dict(batch, q=batch["q"].float()), scale=0.2)
    dots = (None, True, False) if device.type == "cuda" else (None, True)
    for splits, fp16_dots in itertools.product((1, 2), dots):
        cfg = dict(block_n=16, num_splits=splits, num_warps=4, num_stages=1)
        if fp16_dots is not None:
            cfg["fp16_dots"] = fp16_dots
        out = td.paged_decode_attention(**batch, scale=0.2, config=cfg)
        assert out.dtype == torch.bfloat16 and rel_err(out.float(), ref) < 1e-2, (splits, fp16_dots)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("t", "h", "d"), [(5, 3, 40), (2, 4, 64)])
def test_output_gate_kernel(device, dtype, t, h, d):
    """The SDPA path's output gate: o * sigmoid(gate) over a gate that is a strided view of the fused
    q / gate projection (per head [q | gate]), one rounding, written over o (D not a power of two)."""
    from deltaserve.layers.kernels.attention.triton_gate import apply_output_gate

    g = torch.Generator().manual_seed(t * h + d)
    o = torch.randn(t, h, d, generator=g).to(device=device, dtype=dtype)
    q_gate = (torch.randn(t, h, 2 * d, generator=g) * 3).to(device=device, dtype=dtype)
    gate = q_gate[..., d:]
    before = o.cpu().clone()
    ref = naive.output_gated(before, gate.cpu())
    got = apply_output_gate(o=o, gate=gate)
    assert got.data_ptr() == o.data_ptr() and not got.isnan().any()
    eps = torch.finfo(dtype).eps
    assert (got.cpu().float() - ref.float()).abs().max() <= eps * ref.float().abs().max()
    exact = before.float() * torch.sigmoid(gate.cpu().float())
    assert (ref.float() - exact).abs().max() <= eps * exact.abs().max()  # the reference: one rounding
