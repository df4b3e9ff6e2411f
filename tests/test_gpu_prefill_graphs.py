"""Prefill CUDA graphs on a CUDA device (skipped on CPU): each replayed pass against the eager pass of
the same plan from the same pools (logits and pools after it), and the engine's tokens with the
graphs against an engine that runs every pass eagerly, prefix-cache hits (captures in the graph)
included."""

from __future__ import annotations

import pytest
import torch
from prefill_checks import CheckedGraphs
from tiny_models import FAMILIES, VOCAB_SIZE

from deltaserve import LLM, SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (the H200 runs these)"),
]

# the tiny models have 512 positions: passes whose block table spans more run eagerly
POOL = dict(num_kv_blocks=1024, max_num_seqs=8, max_model_len=512, prefix_snapshot_interval=128)
LENGTHS = [1, 15, 16, 17, 63, 64, 65, 200, 256, 300]
PARAMS = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def ids(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB_SIZE, (n,), generator=g).tolist()


def prompts() -> list[list[int]]:
    """Short prompts, then a shared prefix and prompts that hit it (their captures in the graph), and
    resends that hit what those captured."""
    prefix = ids(150, seed=7)
    out = [ids(n, seed=n) for n in LENGTHS]
    out.append(prefix + ids(9, seed=8))
    out += [prefix + ids(n, seed=1000 + n) for n in (1, 17, 64, 200)]
    out += [prefix + ids(n, seed=1000 + n) for n in (1, 17, 64, 200)]
    return out


@pytest.mark.parametrize(
    "family, attention", [*((f, "auto") for f in FAMILIES), ("qwen3_5_moe", "sdpa")]
)  # fmt: skip
def test_replayed_passes_match_their_eager_runs(tiny_checkpoints, family, attention, monkeypatch):
    """attention "sdpa": fresh prompts' graphs attend by flash over their padded tokens (captured
    with it), hits' graphs by the paged kernel; the eager runs by SDPA over each chunk's keys."""
    monkeypatch.setenv("TRITON_F32_DEFAULT", "ieee")
    monkeypatch.setenv("DELTASERVE_PREFILL_ATTENTION", attention)
    path = str(tiny_checkpoints[family][0])
    graphed = LLM(path, device="cuda", dtype="float32", **POOL)
    eager = LLM(path, device="cuda", dtype="float32", enforce_eager=True, **POOL)
    runner = graphed.engine.executor.runner
    assert runner.prefill_graphs is not None and runner.prefill_graphs.graphs
    assert eager.engine.executor.runner.prefill_graphs is None
    checked = CheckedGraphs(runner, runner.prefill_graphs)
    runner.prefill_graphs = checked
    for prompt in prompts():  # one at a time: each prompt's prefill is one pass of one row
        got = graphed.generate([prompt], PARAMS, use_tqdm=False)[0]
        want = eager.generate([prompt], PARAMS, use_tqdm=False)[0]
        assert got.outputs[0].token_ids == want.outputs[0].token_ids
    assert checked.graphs.replays == checked.passes >= len(prompts()) - 1
    assert checked.with_captures >= 8
    # the graphs pad the pass and fix its split-K spans: float32 sums in another order
    assert checked.logit_diff <= 1e-3 and checked.pool_diff <= 1e-3, (checked.logit_diff, checked.pool_diff)


def test_engine_tokens_with_graphs_equal_eager(tiny_checkpoints, monkeypatch):
    monkeypatch.setenv("TRITON_F32_DEFAULT", "ieee")
    path = str(tiny_checkpoints["qwen3_5_moe"][0])
    graphed = LLM(path, device="cuda", dtype="float32", **POOL)
    eager = LLM(path, device="cuda", dtype="float32", enforce_eager=True, **POOL)
    graphs = graphed.engine.executor.runner.prefill_graphs
    before = graphs.replays
    work = prompts()
    got = [graphed.generate([p], PARAMS, use_tqdm=False)[0] for p in work]
    want = [eager.generate([p], PARAMS, use_tqdm=False)[0] for p in work]
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert graphs.replays - before >= len(work) - 1
    assert max(o.num_cached_tokens for o in got) >= 150  # the hits hit


def test_a_prefix_hit_replays_a_graph(tiny_checkpoints, monkeypatch):
    """16 blocks of cached prefix, 64 new tokens: the hit's one pass (its prompt-end and last-block
    captures) is a graph replay, and a resend of the whole prompt hits what it captured."""
    monkeypatch.setenv("TRITON_F32_DEFAULT", "ieee")
    path = str(tiny_checkpoints["qwen3_5_moe"][0])
    llm = LLM(path, device="cuda", dtype="float32", **POOL)
    graphs = llm.engine.executor.runner.prefill_graphs
    prefix = ids(256, seed=3)
    llm.generate([prefix + ids(5, seed=4)], PARAMS, use_tqdm=False)
    prompt = prefix + ids(64, seed=5)
    before = graphs.replays
    hit = llm.generate([prompt], PARAMS, use_tqdm=False)[0]
    assert hit.num_cached_tokens == 256 and graphs.replays == before + 1
    again = llm.generate([prompt], PARAMS, use_tqdm=False)[0]
    assert again.num_cached_tokens >= len(prompt) - 16
    assert again.outputs[0].token_ids == hit.outputs[0].token_ids
