"""Sampling through the engine (seeds, top-k 1, stops, logprobs, prompt logprobs) and the sampler's
filters and penalties against direct computations."""

from __future__ import annotations

import pytest
import torch
from tiny_models import VOCAB_SIZE

from deltaserve import LLM, SamplingParams
from deltaserve.cluster.core.request import top_logprobs
from deltaserve.workers.plan import NewRequestData, SamplingSpec
from deltaserve.workers.sampler import Sampler, _filter, logprob_tensors, seeded_exponentials


@pytest.fixture(scope="module")
def moe(tiny_checkpoints):
    path, hf = tiny_checkpoints["qwen3_5_moe"]
    return LLM(str(path), max_num_seqs=8), hf


def some_prompts(n: int = 6) -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    return [torch.randint(3, VOCAB_SIZE, (4 + 5 * i,), generator=g).tolist() for i in range(n)]


def test_seeded_sampling_same_alone_and_in_batch(moe):
    llm, _ = moe
    params = [
        SamplingParams(temperature=1.3, top_p=0.95, top_k=50, seed=100 + i, max_tokens=10, ignore_eos=True)
        for i in range(6)
    ]
    batch = llm.generate(some_prompts(), params, use_tqdm=False)
    alone = [llm.generate([p], sp, use_tqdm=False)[0] for p, sp in zip(some_prompts(), params, strict=True)]
    assert [o.outputs[0].token_ids for o in batch] == [o.outputs[0].token_ids for o in alone]
    # a different seed draws differently (the runs are not secretly greedy)
    other = llm.generate(
        some_prompts()[:1],
        SamplingParams(temperature=1.3, top_p=0.95, top_k=50, seed=7, max_tokens=10, ignore_eos=True),
        use_tqdm=False,
    )
    assert other[0].outputs[0].token_ids != batch[0].outputs[0].token_ids


def test_unseeded_sampling_varies(moe):
    llm, _ = moe
    sp = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)
    a, b = llm.generate([some_prompts()[0]] * 2, sp, use_tqdm=False)
    assert a.outputs[0].token_ids != b.outputs[0].token_ids


def test_top_k_one_is_greedy(moe):
    llm, _ = moe
    greedy = llm.generate(some_prompts(), SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    topk1 = llm.generate(some_prompts(), SamplingParams(temperature=0.8, top_k=1, max_tokens=8), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in greedy] == [o.outputs[0].token_ids for o in topk1]


def test_stop_token_id_and_max_tokens(moe):
    llm, _ = moe
    (free,) = llm.generate(
        [some_prompts()[2]], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True), use_tqdm=False
    )
    ids = free.outputs[0].token_ids
    assert len(ids) == 10 and free.outputs[0].finish_reason == "length"
    stop_id = ids[4]
    first = ids.index(stop_id)
    (stopped,) = llm.generate(
        [some_prompts()[2]],
        SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, stop_token_ids=[stop_id]),
        use_tqdm=False,
    )
    assert stopped.outputs[0].token_ids == ids[: first + 1]
    assert stopped.outputs[0].finish_reason == "stop" and stopped.outputs[0].stop_reason == stop_id


def test_stop_string_ends_text_and_is_excluded(moe):
    llm, _ = moe
    prompt = some_prompts()[3]
    (free,) = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False)
    text = free.outputs[0].text
    assert len(text) >= 6, text
    stop = text[3:5]
    cut = text.index(stop)
    (stopped,) = llm.generate(
        [prompt], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, stop=[stop]), use_tqdm=False
    )
    out = stopped.outputs[0]
    assert out.text == text[:cut]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    (kept,) = llm.generate(
        [prompt],
        SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, stop=[stop], include_stop_str_in_output=True),
        use_tqdm=False,
    )
    assert kept.outputs[0].text == text[: cut + len(stop)]


def test_eos_ends_generation_unless_ignored(tiny_checkpoints):
    path, hf = tiny_checkpoints["qwen3_5"]
    llm = LLM(str(path))
    # find a prompt whose greedy continuation hits EOS (id 2) quickly
    g = torch.Generator().manual_seed(0)
    for _ in range(200):
        p = torch.randint(3, VOCAB_SIZE, (6,), generator=g).tolist()
        (o,) = llm.generate([p], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
        if o.outputs[0].finish_reason == "stop":
            break
    else:
        pytest.fail("no prompt reached EOS")
    assert o.outputs[0].token_ids[-1] == 2
    (ignored,) = llm.generate([p], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    assert len(ignored.outputs[0].token_ids) == 8
    (late,) = llm.generate([p], SamplingParams(temperature=0, max_tokens=8, min_tokens=8), use_tqdm=False)
    assert 2 not in late.outputs[0].token_ids[:7]


def test_prompt_logprobs_match_transformers(moe, tiny_checkpoints):
    llm, hf = moe
    prompt = some_prompts()[5]
    chunked = LLM(str(tiny_checkpoints["qwen3_5_moe"][0]), max_num_batched_tokens=7)
    # max_tokens=1: the request finishes on the pass that computes its last prompt logprobs
    for budget_llm, max_tokens in ((llm, 2), (chunked, 2), (llm, 1), (chunked, 1)):
        (out,) = budget_llm.generate(
            [prompt],
            SamplingParams(temperature=0, max_tokens=max_tokens, prompt_logprobs=3, logprobs=2),
            use_tqdm=False,
        )
        with torch.no_grad():
            ref = torch.log_softmax(hf(torch.tensor([prompt])).logits[0].float(), dim=-1)
        assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
        for pos in range(1, len(prompt)):
            entry = out.prompt_logprobs[pos]  # vLLM's shape: {prompt token: Logprob, then the top 3}
            token, chosen = next(iter(entry.items()))
            assert token == prompt[pos]
            assert abs(chosen.logprob - ref[pos - 1, prompt[pos]].item()) < 1e-4
            top = top_logprobs(entry, 3)
            assert [t for t, _ in top] == torch.topk(ref[pos - 1], 3).indices.tolist()
            assert all(abs(lp.logprob - ref[pos - 1, t].item()) < 1e-4 for t, lp in top)
            assert [lp.rank for _, lp in top] == [1, 2, 3]
            assert chosen.rank == int((ref[pos - 1] > ref[pos - 1, prompt[pos]]).sum()) + 1
        sampled = out.outputs[0].logprobs[0]
        token, chosen = next(iter(sampled.items()))
        assert token == out.outputs[0].token_ids[0]
        assert chosen.rank == 1 and len(sampled) == 2 and top_logprobs(sampled, 2)[0][0] == token


# ---- the sampler alone ---------------------------------------------------------------------------
def spec(**kw) -> SamplingSpec:
    return SamplingSpec(**kw)


def test_filters_top_k_top_p_min_p():
    logits = torch.log(torch.tensor([[0.4, 0.3, 0.2, 0.1], [0.4, 0.3, 0.2, 0.1], [0.4, 0.3, 0.2, 0.1]]))

    class S:
        def __init__(self, s):
            self.spec = s

    out = _filter(logits, [S(spec(top_k=2)), S(spec(top_p=0.65)), S(spec(min_p=0.6))])
    kept = torch.isfinite(out)
    assert kept.tolist() == [[True, True, False, False], [True, True, False, False], [True, True, False, False]]
    out = _filter(logits, [S(spec(top_p=0.75)), S(spec(top_p=0.7)), S(spec(min_p=0.2))])
    assert torch.isfinite(out).sum(dim=1).tolist() == [3, 2, 4]


def test_penalties_applied_as_defined():
    sampler = Sampler(vocab_size=6)
    sampler.add(
        NewRequestData(
            "r",
            [0, 1],
            [1, 3, 3],
            spec(temperature=0, repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25),
        )
    )
    logits = torch.tensor([[1.0, -1.0, 0.5, 2.0, 0.0, 0.1]])
    expected = logits.clone()
    for t in (0, 1, 3):
        expected[0, t] = expected[0, t] / 2 if expected[0, t] > 0 else expected[0, t] * 2
    counts = torch.tensor([0, 1, 0, 2, 0, 0.0])
    expected[0] -= 0.25 * counts + 0.5 * (counts > 0).float()
    penalised = logits.clone()
    sampler._apply_penalties(penalised, [sampler.states["r"]])
    assert torch.allclose(penalised, expected)
    tokens, _ = sampler.sample(["r"], logits)
    assert tokens == [int(expected.argmax())]


def test_logit_bias_comes_before_the_penalties_and_leaves_the_logprobs():
    """OpenAI's logit_bias: added to the logits, then the repetition penalty on the biased values; the
    logprobs stay the model's (vLLM's default)."""
    sampler = Sampler(vocab_size=6)
    params = SamplingParams(temperature=0, repetition_penalty=2.0, logit_bias={2: 3.0, 4: -1.5}, logprobs=0)
    sampler.add(NewRequestData("r", [0, 1], [2], params.to_spec()))
    logits = torch.tensor([[1.0, -1.0, 0.5, 2.0, 0.0, 0.1]])
    expected = logits.clone()
    expected[0, 2] += 3.0
    expected[0, 4] -= 1.5
    for t in (0, 1, 2):
        expected[0, t] = expected[0, t] / 2 if expected[0, t] > 0 else expected[0, t] * 2
    biased = logits.clone()
    sampler._apply_penalties(biased, [sampler.states["r"]])
    assert torch.allclose(biased, expected)
    tokens, lps = sampler.sample(["r"], logits)
    assert tokens == [3] and lps["r"].logprob == pytest.approx(torch.log_softmax(logits[0], 0)[3].item())


def test_logit_bias_through_the_engine(moe):
    """+100 forces a token, -100 bans the greedy ones; bad keys and values name the field."""
    llm, _ = moe
    p = some_prompts(1)
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    (plain,) = llm.generate(p, greedy, use_tqdm=False)
    (forced,) = llm.generate(p, SamplingParams(**{**vars(greedy), "logit_bias": {77: 100.0}}), use_tqdm=False)
    assert forced.outputs[0].token_ids == [77] * 6
    banned = {t: -100.0 for t in plain.outputs[0].token_ids}
    (other,) = llm.generate(p, SamplingParams(**{**vars(greedy), "logit_bias": banned}), use_tqdm=False)
    assert not set(other.outputs[0].token_ids) & set(banned)
    for bias, why in (({VOCAB_SIZE: 1.0}, "outside"), ({3: 101.0}, "must be in"), ({"3": 1.0}, "outside")):
        with pytest.raises(ValueError, match=f"^logit_bias: .*{why}"):
            llm.generate(p, SamplingParams(max_tokens=2, logit_bias=bias), use_tqdm=False)


def test_a_logit_bias_decodes_without_drafts(tiny_checkpoints, moe):
    """A biased request beside drafting ones in a speculating engine: its tokens are the plain
    engine's (the verify sampler applies no bias, so it decodes one token at a time)."""
    path = str(tiny_checkpoints["qwen3_5_moe"][0])
    llm, _ = moe
    prompts = some_prompts(2)
    params = [
        SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logit_bias={5: 2.0, 7: -3.0, 77: 1.5}),
        SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
    ]
    want = llm.generate(prompts, params, use_tqdm=False)
    spec = LLM(path, max_num_seqs=8, speculative_config={"method": "mtp", "num_speculative_tokens": 2})
    try:
        got = spec.generate(prompts, params, use_tqdm=False)
        drafts = spec.engine.speculative_stats()
    finally:
        spec.shutdown()
    assert [o.outputs[0].token_ids for o in got] == [w.outputs[0].token_ids for w in want]
    assert drafts["num_drafts"] > 0  # the other request did speculate


def test_seeded_noise_is_a_function_of_seed_and_step():
    a = seeded_exponentials(42, 3, 1000, "cpu")
    assert torch.equal(a, seeded_exponentials(42, 3, 1000, "cpu"))
    assert not torch.equal(a, seeded_exponentials(42, 4, 1000, "cpu"))
    assert not torch.equal(a, seeded_exponentials(43, 3, 1000, "cpu"))
    assert abs(a.mean().item() - 1.0) < 0.1 and (a > 0).all()


def test_seeded_draws_follow_the_distribution():
    """The exponential race samples from softmax(logits): check frequencies over many seeds."""
    sampler = Sampler(vocab_size=4)
    logits = torch.log(torch.tensor([[0.5, 0.25, 0.15, 0.10]]))
    counts = torch.zeros(4)
    for seed in range(4000):
        sampler.add(NewRequestData(f"r{seed}", [0], [], spec(temperature=1.0, seed=seed)))
        (tok,), _ = sampler.sample([f"r{seed}"], logits)
        counts[tok] += 1
    assert torch.allclose(counts / counts.sum(), torch.tensor([0.5, 0.25, 0.15, 0.10]), atol=0.03)


# ---- numeric extremes ----------------------------------------------------------------------------
# Token 0 is never the right answer below: a softmax of infinities is NaN, and argmax over NaN rows
# picks token 0, which is what these bugs looked like.
EXTREME_LOGITS = torch.tensor([[-1.0, 50.0, 40.0, 0.5, -2.0, 0.0]])


def draw(logits: torch.Tensor, seeds=range(8), prompt=(0,), **kw) -> list[int]:
    """One token per seed from a fresh sampler (each seed is its own request)."""
    sampler = Sampler(vocab_size=logits.shape[1])
    out = []
    for seed in seeds:
        sampler.add(NewRequestData(f"r{seed}", list(prompt), [], spec(seed=seed, **kw)))
        (token,), _ = sampler.sample([f"r{seed}"], logits.clone())
        out.append(token)
    return out


@pytest.mark.parametrize("temperature", [1e-40, 1e-46, 5e-324, 1e-6, 9.99e-6])
def test_temperature_below_the_greedy_threshold_is_greedy(temperature):
    assert draw(EXTREME_LOGITS, temperature=temperature) == [1] * 8
    # a batch mixing it with greedy and random rows, with penalties (the float32 copy's path)
    sampler = Sampler(vocab_size=6)
    sampler.add(NewRequestData("tiny", [4], [], spec(temperature=temperature, presence_penalty=0.1)))
    sampler.add(NewRequestData("zero", [4], [], spec(temperature=0)))
    sampler.add(NewRequestData("warm", [4], [], spec(temperature=1.0, seed=3)))
    tokens, _ = sampler.sample(["tiny", "zero", "warm"], EXTREME_LOGITS.repeat(3, 1))
    assert tokens[:2] == [1, 1]


@pytest.mark.parametrize(
    "penalty, allowed",
    [
        (1e300, {1, 2, 3, 5}),  # beyond float32: positive logits -> 0, negative ones -> -inf
        (float("inf"), {1, 2, 3, 5}),  # 0 * inf is NaN: that token drops out
        (1e-38, {1, 2}),  # 50 / 1e-38 and 40 / 1e-38 overflow to inf: a tie between them, not NaN
    ],
)
def test_repetition_penalty_overflow_draws_a_real_token(penalty, allowed):
    seen = list(range(6))
    for temperature in (0.0, 1.0):
        tokens = draw(EXTREME_LOGITS, prompt=seen, temperature=temperature, repetition_penalty=penalty)
        assert set(tokens) <= allowed, (temperature, tokens)


def test_huge_temperature_is_uniform_not_nan():
    tokens = draw(EXTREME_LOGITS, seeds=range(300), temperature=3e38)
    assert set(tokens) == set(range(6))


@pytest.mark.parametrize("top_k", [6, 7, 10**6, 2**70])
def test_top_k_beyond_the_vocabulary_keeps_every_token(top_k):
    logits = torch.log(torch.tensor([[0.3, 0.25, 0.2, 0.1, 0.1, 0.05]]))
    assert draw(logits, seeds=range(40), temperature=1.0, top_k=top_k) == draw(logits, seeds=range(40), temperature=1.0)


def test_logprobs_beyond_the_vocabulary_return_the_whole_vocabulary():
    sampler = Sampler(vocab_size=6)
    sampler.add(NewRequestData("r", [0], [], spec(temperature=0, logprobs=20)))
    (token,), logprobs = sampler.sample(["r"], EXTREME_LOGITS)
    assert token == 1 and logprobs["r"].top_ids == [1, 2, 3, 5, 0, 4] and logprobs["r"].rank == 1


def test_logprobs_of_infinite_logits_are_finite():
    logits = torch.tensor([[float("inf"), 1.0, float("-inf"), 0.0], [0.0, float("-inf"), 2.0, 1.0]])
    chosen, rank, top = logprob_tensors(logits, torch.tensor([0, 2]), 4)
    assert torch.isfinite(chosen).all() and torch.isfinite(top.values).all()
    assert chosen.tolist()[0] == 0.0 and rank.tolist() == [1, 1]
    assert top.indices.tolist()[1] == [2, 3, 0, 1] and top.indices.tolist()[0][0] == 0
    assert chosen[1].item() == pytest.approx(torch.log_softmax(torch.tensor([0.0, 2.0, 1.0]), 0)[1].item())
