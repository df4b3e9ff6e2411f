"""Several completions of one prompt (`SamplingParams.n`): completion i is the request with n = 1 and
seed + i (greedy: n copies of the one completion), the prompt is prefilled once when prefix caching is
on (the other completions start from the first one's cached pages and GDN snapshot), and the outputs
come back in vLLM's shapes: LLM.generate's final output holds the n completions in index order, the
async API streams each completion's updates under its `index`."""

from __future__ import annotations

import asyncio

import pytest
import torch
from tiny_models import VOCAB_SIZE

from deltaserve import LLM, SamplingParams
from deltaserve.cluster.config import EngineConfig
from deltaserve.cluster.core.sampling_params import RequestOutputKind
from deltaserve.cluster.entrypoints.async_engine import AsyncEngine

pytestmark = pytest.mark.timeout(120)


def prompt(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB_SIZE, (n,), generator=g).tolist()


@pytest.fixture(scope="module")
def llm(tiny_checkpoints):
    engine = LLM(str(tiny_checkpoints["qwen3_5_moe"][0]), max_num_seqs=8, max_num_batched_tokens=64)
    yield engine
    engine.shutdown()


def ids(out) -> list[list[int]]:
    return [c.token_ids for c in out.outputs]


def test_greedy_completions_are_the_single_completion(llm):
    prompts = [prompt(70, 1), prompt(9, 2)]
    many = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=6, n=3, ignore_eos=True), use_tqdm=False)
    one = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    for got, want in zip(many, one, strict=True):
        assert got.finished and [c.index for c in got.outputs] == [0, 1, 2]
        assert ids(got) == [want.outputs[0].token_ids] * 3
        assert [c.finish_reason for c in got.outputs] == ["length"] * 3
        assert got.prompt_token_ids == want.prompt_token_ids and got.request_id.startswith("llm-")


def test_seeded_completion_i_is_the_request_seeded_seed_plus_i(llm):
    prompts = [prompt(40, 3), prompt(17, 4)]
    params = dict(temperature=1.0, top_k=20, max_tokens=8, ignore_eos=True, logprobs=1)
    many = llm.generate(prompts, SamplingParams(**params, seed=5, n=4), use_tqdm=False)
    for i in range(4):
        single = llm.generate(prompts, SamplingParams(**params, seed=5 + i), use_tqdm=False)
        for got, want in zip(many, single, strict=True):
            completion, ref = got.outputs[i], want.outputs[0]
            assert (completion.token_ids, completion.text) == (ref.token_ids, ref.text)
            assert completion.cumulative_logprob == pytest.approx(ref.cumulative_logprob, rel=1e-5)
    assert len({tuple(c.token_ids) for c in many[0].outputs}) > 1  # not one completion four times


@pytest.mark.parametrize("caching", [True, False])
def test_the_prompt_is_prefilled_once(tiny_checkpoints, caching):
    """A fresh 70-token prompt, n = 4: the other three completions wait for the first one's prompt and
    start at its last full block (64 of 70 tokens cached), from its pages and its snapshot there; the
    greedy completions are the same either way."""
    llm = LLM(str(tiny_checkpoints["qwen3_5_moe"][0]), max_num_seqs=8, enable_prefix_caching=caching)
    try:
        (out,) = llm.generate([prompt(70, 6)], SamplingParams(temperature=0, max_tokens=5, n=4), use_tqdm=False)
        (one,) = llm.generate([prompt(70, 6)], SamplingParams(temperature=0, max_tokens=5), use_tqdm=False)
        assert ids(out) == [one.outputs[0].token_ids] * 4
        stats = llm.engine.prefix_cache_stats()
        if caching:
            assert out.num_cached_tokens == 0  # the first completion's: nothing was cached before it
            assert stats["hits"] >= 3 and stats["hit_tokens"] >= 3 * 64
        else:
            assert stats == {"enabled": False}
    finally:
        llm.shutdown()


def test_prompt_logprobs_stops_and_more_completions_than_sequences(tiny_checkpoints):
    """The prompt's logprobs are the single request's (asked of the first completion only); each
    completion stops on its own stop string; eight completions queue behind a two-sequence cap."""
    llm = LLM(str(tiny_checkpoints["qwen3_5_moe"][0]), max_num_seqs=2)
    try:
        p = prompt(30, 7)
        params = dict(temperature=1.0, max_tokens=6, prompt_logprobs=1, seed=11)
        (many,) = llm.generate([p], SamplingParams(**params, n=8), use_tqdm=False)
        (one,) = llm.generate([p], SamplingParams(**params), use_tqdm=False)
        assert len(many.outputs) == 8 and many.outputs[0].token_ids == one.outputs[0].token_ids
        assert len(many.prompt_logprobs) == len(p) and many.prompt_logprobs[0] is None
        for got, want in zip(many.prompt_logprobs[1:], one.prompt_logprobs[1:], strict=True):
            assert got.keys() == want.keys()
            assert [lp.logprob for lp in got.values()] == pytest.approx([lp.logprob for lp in want.values()], abs=1e-5)
        stop = many.outputs[3].text[2:4]
        assert len(stop) == 2
        (cut,) = llm.generate([p], SamplingParams(**{**params, "prompt_logprobs": None}, n=8, stop=[stop]))
        assert cut.outputs[3].finish_reason == "stop" and cut.outputs[3].text == many.outputs[3].text[:2]
        for got, whole in zip(cut.outputs, many.outputs, strict=True):
            assert whole.text.startswith(got.text) and (got.finish_reason == "stop") == (stop in whole.text)
    finally:
        llm.shutdown()


def test_an_id_in_use_and_aborting_every_completion(llm):
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=50, n=3, ignore_eos=True)
    engine.add_request("group", prompt(10, 8), params)
    with pytest.raises(ValueError, match="^request_id: "):
        engine.add_request("group", prompt(10, 8), SamplingParams(max_tokens=2))
    engine.step()
    out = engine.abort("group")
    assert out.request_id == "group" and out.finished and [c.index for c in out.outputs] == [0, 1, 2]
    assert {c.finish_reason for c in out.outputs} == {"abort"}
    assert engine.abort("group") is None
    later = []
    while engine.has_unfinished():  # the pass in flight (async scheduling) lands; nothing more comes of it
        later += engine.step()
    assert later == []
    assert engine.blocks.num_free == engine.blocks.capacity and engine.slots.num_free == engine.slots.capacity


def test_async_streams_each_completion_under_its_index(tiny_checkpoints, llm):
    p = prompt(20, 9)
    base = dict(temperature=1.0, seed=3, max_tokens=7, ignore_eos=True, n=3)
    (want,) = llm.generate([p], SamplingParams(**base), use_tqdm=False)

    async def main():
        engine = await AsyncEngine.local(EngineConfig.from_kwargs(model=str(tiny_checkpoints["qwen3_5_moe"][0])))
        try:
            seen = {}
            for kind in RequestOutputKind:
                params = SamplingParams(**base, output_kind=kind)
                seen[kind] = [out async for out in engine.generate(p, params, f"n-{kind.name}")]
            return seen
        finally:
            await engine.shutdown()

    seen = asyncio.run(main())
    for kind, outs in seen.items():
        final = outs[-1]
        assert final.finished and [o.finished for o in outs[:-1]] == [False] * (len(outs) - 1)
        if kind is not RequestOutputKind.DELTA:
            assert ids(final) == ids(want) and [c.text for c in final.outputs] == [c.text for c in want.outputs]
    for i, completion in enumerate(want.outputs):
        cumulative = [o.outputs[0] for o in seen[RequestOutputKind.CUMULATIVE][:-1] if o.outputs[0].index == i]
        grown = [len(c.token_ids) for c in cumulative]
        assert grown == sorted(grown) and all(
            completion.token_ids[: len(c.token_ids)] == c.token_ids for c in cumulative
        )
        deltas = [o.outputs[0] for o in seen[RequestOutputKind.DELTA] if o.outputs[0].index == i]
        assert sum((d.token_ids for d in deltas), []) == completion.token_ids
        assert "".join(d.text for d in deltas) == completion.text
        assert [d.finish_reason for d in deltas][-1] == "length"
    assert len(seen[RequestOutputKind.FINAL_ONLY]) == 1


def test_completions_with_mtp_speculation(tiny_checkpoints, llm):
    """Each completion verifies its own drafts: greedy n = 2 under MTP speculation gives the single
    completion twice, as without speculation."""
    path = str(tiny_checkpoints["qwen3_5_moe"][0])
    prompts = [prompt(25, 10), prompt(6, 11)]
    want = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=9, ignore_eos=True), use_tqdm=False)
    spec = LLM(path, max_num_seqs=8, speculative_config={"method": "mtp", "num_speculative_tokens": 2})
    try:
        got = spec.generate(prompts, SamplingParams(temperature=0, max_tokens=9, ignore_eos=True, n=2), use_tqdm=False)
    finally:
        spec.shutdown()
    assert [ids(o) for o in got] == [[w.outputs[0].token_ids] * 2 for w in want]
