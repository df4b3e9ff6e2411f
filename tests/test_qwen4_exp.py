"""The Qwen4-Exp stack (QSA sparse attention, hyper-connections, PLE) against transformers' uncached
forward on tiny random checkpoints (CPU, float32): whole prompts, chunked prompts (chunk boundaries
inside compressed blocks and across the budget), several sequences in one pass, token-by-token decode,
pages smaller than, equal to and larger than a compressed block, and the composite checkpoint.

Prompts are longer than the budget (4 blocks of 3 tokens: a query past position 14 selects), and
hold EOS tokens, which cut PLE's n-grams."""

from __future__ import annotations

import pytest
import torch
from passes import Sequences
from test_kernel_structure import op_calls  # noqa: F401  (a fixture)
from tiny_models import VOCAB_SIZE
from tiny_qwen4 import EOS, hf_logits, hf_model, save_tiny_qwen4

from deltaserve.layers.loader import load_model

TOL = 1e-4  # max abs error relative to the largest reference logit


def assert_close(ours: torch.Tensor, ref: torch.Tensor) -> None:
    scale = ref.abs().max().item()
    err = (ours - ref).abs().max().item()
    assert err <= TOL * scale, f"max abs error {err:.3g} exceeds {TOL} x logit scale {scale:.3g}"


def prompt(n: int, seed: int, eos_at: tuple[int, ...] = ()) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB_SIZE, (n,), generator=g).tolist()
    for i in eos_at:
        ids[i] = EOS
    return ids


class Reference:
    """transformers' logits per prompt, computed once."""

    def __init__(self, hf):
        self.hf, self.cache = hf, {}

    def __call__(self, ids: list[int]) -> torch.Tensor:
        key = tuple(ids)
        if key not in self.cache:
            self.cache[key] = hf_logits(self.hf, ids)
        return self.cache[key]


@pytest.fixture(scope="module")
def text(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen4_text")
    hf = save_tiny_qwen4(path)
    return load_model(path), Reference(hf)


LONG = prompt(47, seed=1, eos_at=(9, 30, 31))


def test_selection_matters():
    """The prompts are long enough that QSA's selection changes the result: the same weights with a
    budget that keeps everything give other logits (so the tests below can tell)."""
    sparse, dense = hf_model(), hf_model(indexer_budget=600)
    dense.load_state_dict(sparse.state_dict())
    assert (hf_logits(sparse, LONG) - hf_logits(dense, LONG)).abs().max() > 0.05


@pytest.mark.parametrize("block_size", [2, 3, 4, 16])
def test_whole_prompt_logits(text, block_size):
    """Pages of 2 (a compressed block spans pages), 3 (one block a page), 4 and 16 (blocks straddle pages)."""
    model, ref = text
    seqs = Sequences(model, block_size=block_size, num_blocks=64 if block_size > 2 else 128)
    seqs.add("a")
    (ours,) = seqs.run([("a", LONG)])
    assert_close(ours, ref(LONG))


@pytest.mark.parametrize(
    "chunks",
    [
        [1, 4, 10, 2, 30],  # ends inside blocks (r = 3), one chunk crossing the budget (position 14)
        [14, 1, 1, 1, 30],  # one token a pass around the budget
        [16, 31],  # the first chunk ends just past the budget
        [2, 2, 2, 2, 2, 2, 2, 2, 31],
    ],
)
def test_chunked_prompt(text, chunks):
    model, ref = text
    seqs = Sequences(model)
    seqs.add("a")
    got, start = [], 0
    for size in chunks:
        (part,) = seqs.run([("a", LONG[start : start + size])])
        got.append(part)
        start += size
    assert start == len(LONG)
    assert_close(torch.cat(got), ref(LONG))


def test_varlen_batch_one_pass(text):
    """Several sequences of different lengths in one pass, two already part-cached."""
    model, ref = text
    seqs = Sequences(model)
    prompts = {"a": prompt(19, 3, (4,)), "b": prompt(44, 4), "c": prompt(1, 5), "d": prompt(33, 6, (20,))}
    for s in prompts:
        seqs.add(s)
    seqs.run([("a", prompts["a"][:5]), ("d", prompts["d"][:20])])
    out = seqs.run([("b", prompts["b"]), ("a", prompts["a"][5:]), ("c", prompts["c"]), ("d", prompts["d"][20:])])
    assert_close(out[0], ref(prompts["b"]))
    assert_close(out[1], ref(prompts["a"])[5:])
    assert_close(out[2], ref(prompts["c"]))
    assert_close(out[3], ref(prompts["d"])[20:])


def test_decode_after_prefill_in_shared_pools(text):
    """Prefill, then decode token by token (across the budget) with other sequences in the same passes."""
    model, ref = text
    seqs = Sequences(model)
    full = {"a": prompt(30, 7, (12,)), "b": prompt(40, 8), "c": prompt(24, 9, (3, 4))}
    prefill_len = {"a": 11, "b": 29, "c": 2}
    for s in full:
        seqs.add(s)
    got = {s: [] for s in full}
    for s, logits in zip(full, seqs.run([(s, full[s][: prefill_len[s]]) for s in full]), strict=True):
        got[s].append(logits)
    pos = dict(prefill_len)
    while any(pos[s] < len(full[s]) for s in full):
        rows = [(s, [full[s][pos[s]]]) for s in full if pos[s] < len(full[s])]
        for (s, _), logits in zip(rows, seqs.run(rows), strict=True):
            got[s].append(logits)
            pos[s] += 1
    for s in full:
        assert_close(torch.cat(got[s]), ref(full[s]))


def test_composite_checkpoint(tmp_path):
    """qwen4_exp (vision + text): the text part loads from model.language_model.* and matches."""
    hf = save_tiny_qwen4(tmp_path, composite=True, seed=3)
    assert any(k.startswith("model.visual.") for k in hf.state_dict())
    model = load_model(tmp_path)
    seqs = Sequences(model)
    seqs.add("a")
    ids = prompt(26, 10, (7,))
    got = seqs.run([("a", ids[:13])])[0], seqs.run([("a", ids[13:])])[0]
    assert_close(torch.cat(got), hf_logits(hf, ids))


def test_triton_qsa_kernels_in_the_model(text, monkeypatch):
    """The layer's calls into the Triton QSA kernels (interpreted on CPU): group slices, strides and
    index dtypes as the model passes them, over a chunked prompt and decode steps."""
    from deltaserve.layers.kernels import qsa
    from deltaserve.layers.kernels.qsa import triton_qsa

    for name in ("write_index_keys", "compress_blocks", "index_scores", "block_topk", "sparse_attention"):
        monkeypatch.setattr(qsa, name, getattr(triton_qsa, name))
    model, ref = text
    seqs = Sequences(model)
    seqs.add("a")
    seqs.add("b")
    other = prompt(20, 12)
    got = [seqs.run([("a", LONG[:17]), ("b", other[:3])])[0]]
    got.append(seqs.run([("a", LONG[17:44]), ("b", other[3:])])[0])
    for i in range(44, len(LONG)):
        got.append(seqs.run([("a", LONG[i : i + 1]), ("b", [other[0]])])[0])
    assert_close(torch.cat(got), ref(LONG))


def test_verify_then_write_on_accept(text):
    """Speculative decoding's verify pass over 4 tokens a row keeps the GDN and PLE slots; accepting
    2 of them (or none) leaves the state after exactly those, so that decoding on gives transformers'
    logits of the accepted sequence (rejected KV and indexer rows are rewritten by later passes)."""
    model, ref = text
    seqs = Sequences(model)
    seqs.pool.enable_verify(model, rows=4, length=4)
    p = {"a": prompt(20, 13, (15,)), "b": prompt(17, 14)}
    drafts = {"a": [EOS, 44, 55, 66], "b": [7, 8, 9, 10]}
    for s in p:
        seqs.add(s)
    seqs.run([(s, p[s]) for s in p])
    out = seqs.run([(s, drafts[s]) for s in p], verify=True)
    for s, logits in zip(p, out, strict=True):
        assert_close(logits, ref(p[s] + drafts[s])[len(p[s]) :])
    accepted = {"a": 2, "b": 0}
    slots = torch.tensor([seqs.slot[s] for s in p])
    model.write_on_accept(seqs.pool.layer_states, slots, torch.tensor([accepted[s] - 1 for s in p]))
    for s in p:
        p[s] = p[s] + drafts[s][: accepted[s]]
        seqs.cached[s] = len(p[s])
    for step in range(3):
        nxt = {s: [100 + step + len(p[s])] for s in p}
        for s, logits in zip(p, seqs.run([(s, nxt[s]) for s in p]), strict=True):
            p[s] = p[s] + nxt[s]
            assert_close(logits, ref(p[s])[-1:])


def test_ties_at_the_cut_are_broken_as_transformers_breaks_them(tmp_path, monkeypatch):
    """With one indexer head half the block scores are exactly 0 (relu), so equal scores often straddle
    the top-k cut; transformers keeps whichever of them torch.topk returns on the row's first nc scores
    (not the lowest indices). The CPU path makes the same call on the same row and matches; the
    Triton kernel keeps the lowest indices, so on such rows it cannot match transformers exactly."""
    from deltaserve.layers.kernels import qsa

    hf = save_tiny_qwen4(tmp_path, indexer_n_heads=1, indexer_budget=6, indexer_compress_ratio=2)
    model = load_model(tmp_path)
    ties, block_topk = [], qsa.block_topk

    def counting(*, scores, positions, compress_ratio, top_blocks):
        for t, nc in enumerate(((positions + 1) // compress_ratio).tolist()):
            if nc > top_blocks:
                row = scores[t, :nc]
                ties.append(int((row == row.sort(descending=True).values[top_blocks - 1]).sum()) > 1)
        return block_topk(scores=scores, positions=positions, compress_ratio=compress_ratio, top_blocks=top_blocks)

    monkeypatch.setattr(qsa, "block_topk", counting)
    ids = prompt(60, 15)
    seqs = Sequences(model)
    seqs.add("a")
    got = [seqs.run([("a", ids[:25])])[0]] + [seqs.run([("a", [t])])[0] for t in ids[25:]]
    assert any(ties)
    assert_close(torch.cat(got), hf_logits(hf, ids))


def test_kernel_options_reach_every_op(text, op_calls):  # noqa: F811 - the imported fixture
    """The pass's KernelOptions reach every kernel op the Qwen4-Exp layers call (pdl, the row-GEMV
    switch and tiles), as they reach the other families' (test_kernel_structure)."""
    from deltaserve.layers.kernels.options import KernelOptions

    model, _ = text
    tiles = KernelOptions.from_env({"DELTASERVE_ROW_TILES": "64x32:2x4"}).row_tiles
    opts = KernelOptions(pdl=False, row_gemv=False, row_tiles=tiles, route_in_up_max_tokens=0, fused_gdn_max_seqs=0)
    seqs = Sequences(model, kernels=opts)
    for s in "ab":
        seqs.add(s)
    seqs.run([("a", LONG[:20]), ("b", LONG[:3])])
    seqs.run([("a", [7]), ("b", [9])])
    names = {name for name, _ in op_calls}
    assert {"linear", "qk_norm_rope", "routed_moe", "fused_recurrent_gated_delta_rule"} <= names
    for name, kwargs in op_calls:
        assert kwargs.get("pdl", False) is False, name
        if name == "linear":
            assert kwargs["row_gemv"] is False and kwargs["row_tiles"] == tiles
