"""Speculative decoding with the MTP head, through the engine (CPU float32, tiny checkpoints with random
mtp.* weights): the output with speculation is the output without it.

Drafts: the head's own (random weights: almost never right), or a ReferenceDrafter proposing the
reference run's tokens at a set agreement, so that verify rows accept 0 .. k drafts and write-on-
accept, the head's catch-up and the truncation of accepted tokens at a stop all run."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from logprob_checks import assert_entries_close
from tiny_models import FAMILIES, VOCAB_SIZE, save_tiny

from deltaserve import LLM, SamplingParams
from deltaserve.bench.spec_drafts import ReferenceDrafter
from deltaserve.layers.config import ModelConfig

MAX_TOKENS = 10
EXTRA = 16  # reference tokens past MAX_TOKENS, so that every draft has one


def spec(k: int) -> dict:
    return {"method": "mtp", "num_speculative_tokens": k}


def workload() -> tuple[list[list[int]], list[SamplingParams]]:
    """Prompts of several lengths (chunked under the small token budget, so prefills share passes
    with verify rows), greedy, and one with a repetition penalty (its verify positions count the
    drafts before them)."""
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(3, VOCAB_SIZE, (n,), generator=g).tolist() for n in (3, 30, 9, 17)]
    params = [SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True) for _ in prompts]
    params[2] = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, repetition_penalty=1.3)
    return prompts, params


def engine(path, k: int | None, **kw) -> LLM:
    kw.setdefault("max_num_batched_tokens", 24)
    kw.setdefault("enable_prefix_caching", False)
    return LLM(str(path), max_num_seqs=8, speculative_config=spec(k) if k else None, **kw)


def token_ids(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, tiny_checkpoints):
    """(checkpoint, the workload's reference outputs without speculation, MAX_TOKENS + EXTRA long)."""
    path, _ = tiny_checkpoints[request.param]
    prompts, params = workload()
    longer = [dataclasses.replace(p, max_tokens=MAX_TOKENS + EXTRA) for p in params]
    ref = token_ids(engine(path, None).generate(prompts, longer, use_tqdm=False))
    return path, {tuple(p): out for p, out in zip(prompts, ref, strict=True)}


def run_with(path, k, reference, agreement, **kw):
    llm = engine(path, k, **kw)
    if agreement is not None:
        llm.engine.scheduler.drafter = ReferenceDrafter(reference, agreement, VOCAB_SIZE, seed=k)
    prompts, params = workload()
    return llm, token_ids(llm.generate(prompts, params, use_tqdm=False))


def expected(reference, n=MAX_TOKENS) -> list[list[int]]:
    prompts, _ = workload()
    return [reference[tuple(p)][:n] for p in prompts]


@pytest.mark.parametrize("k", [1, 2, 3, 4, 7, 8])
def test_greedy_identical_with_partial_acceptance(family, k):
    path, reference = family
    llm, out = run_with(path, k, reference, agreement=0.7)
    assert out == expected(reference)
    stats = llm.engine.speculative_stats()
    assert 0 < stats["num_accepted_tokens"] < stats["num_draft_tokens"]
    rates = stats["acceptance_rate_per_position"]
    assert all(a >= b for a, b in zip(rates, rates[1:], strict=False))  # a draft counts after the earlier ones


@pytest.mark.parametrize("k", [2])
def test_head_drafts_random_weights_same_output(family, k):
    """The head's own drafts (random weights): about nothing accepted, the same output."""
    path, reference = family
    llm, out = run_with(path, k, reference, agreement=None)
    assert out == expected(reference)
    stats = llm.engine.speculative_stats()
    assert stats["num_drafts"] > 0
    assert stats["num_accepted_tokens"] <= 0.05 * stats["num_draft_tokens"]


def test_target_drafts_are_all_accepted(family):
    """A draft that is the target's own next token is always accepted: every verify row emits k + 1."""
    path, reference = family
    llm, out = run_with(path, 4, reference, agreement=1.0)
    assert out == expected(reference)
    stats = llm.engine.speculative_stats()
    assert stats["num_accepted_tokens"] == stats["num_draft_tokens"] > 0
    assert stats["mean_acceptance_length"] == 5.0


def test_preemption(family):
    """A page pool too small for the batch: requests are preempted and recomputed mid-speculation."""
    path, reference = family
    llm, out = run_with(path, 3, reference, agreement=0.7, num_kv_blocks=14, block_size=4)
    assert llm.engine.scheduler.stats.num_preemptions > 0
    assert out == expected(reference)


def test_prefix_cache_hits(family):
    """The same prompts again on a caching engine: hits restore GDN snapshots and shared KV (the
    head's KV included), and the output stays the same."""
    path, reference = family
    llm = engine(path, 3, enable_prefix_caching=True)
    llm.engine.scheduler.drafter = ReferenceDrafter(reference, 0.7, VOCAB_SIZE)
    prompts, params = workload()
    first = token_ids(llm.generate(prompts, params, use_tqdm=False))
    second = token_ids(llm.generate(prompts, params, use_tqdm=False))
    assert first == second == expected(reference)
    assert llm.engine.prefix_cache_stats()["hit_tokens"] > 0


@pytest.fixture(scope="module")
def moe(tiny_checkpoints):
    path, _ = tiny_checkpoints["qwen3_5_moe"]
    prompts, _ = workload()
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS + EXTRA, ignore_eos=True)
    ref = token_ids(engine(path, None).generate(prompts, params, use_tqdm=False))
    return path, {tuple(p): out for p, out in zip(prompts, ref, strict=True)}


def test_seeded_sampling_same_as_without_speculation(moe):
    """Each verify position is drawn with the request's own counter-based noise for that output
    index: seeded outputs equal decoding without speculation, alone or batched."""
    path, reference = moe
    prompts, _ = workload()
    params = [
        SamplingParams(temperature=1.0, top_p=0.95, seed=40 + i, max_tokens=12, ignore_eos=True) for i in range(4)
    ]
    plain = token_ids(engine(path, None).generate(prompts, params, use_tqdm=False))
    llm = engine(path, 3)
    llm.engine.scheduler.drafter = ReferenceDrafter(reference, 0.8, VOCAB_SIZE)
    assert token_ids(llm.generate(prompts, params, use_tqdm=False)) == plain
    alone = [token_ids(llm.generate([p], sp, use_tqdm=False))[0] for p, sp in zip(prompts[:2], params, strict=False)]
    assert alone == plain[:2]
    # the drafts were tried (greedy ones: some agree with a sample at temperature 1)
    assert llm.engine.speculative_stats()["num_drafts"] > 0


def test_logit_bias_speculates_with_the_same_tokens(moe):
    """A logit bias is the same at every position: biased requests run verify rows (greedy and seeded)
    and give the tokens, and the logprobs (the model's, before the bias), of decoding without drafts."""
    path, reference = moe
    prompts, _ = workload()
    bias = {7: 4.0, 11: 3.0, 19: -100.0}
    params = [
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logit_bias=bias, logprobs=1),
        SamplingParams(temperature=1.0, seed=3, max_tokens=12, ignore_eos=True, logit_bias=bias),
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logit_bias={5: 2.5}),
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logit_bias={6: 1.0}),
    ]  # every request biased: the drafts counted below are theirs
    plain = engine(path, None).generate(prompts, params, use_tqdm=False)
    unbiased = engine(path, None).generate(prompts[:1], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    assert token_ids(plain)[0] != token_ids(unbiased)[0]  # the bias changes the output
    assert_speculation_keeps(path, prompts, params, plain, logprobs_of=0)


def assert_speculation_keeps(path, prompts, params, plain, logprobs_of: int) -> None:
    """With drafts mostly right (0.8 of the plain run's tokens), the tokens of every request and the
    logprobs of request `logprobs_of` are the plain run's, and rows accepted more than half their drafts
    on average (every request of these runs has the rule under test: the counts are theirs)."""
    reference = {tuple(p): list(o.outputs[0].token_ids) + [0] * EXTRA for p, o in zip(prompts, plain, strict=True)}
    llm = engine(path, 3)
    llm.engine.scheduler.drafter = ReferenceDrafter(reference, 0.8, VOCAB_SIZE)
    ours = llm.generate(prompts, params, use_tqdm=False)
    assert token_ids(ours) == token_ids(plain)
    assert_entries_close(ours[logprobs_of].outputs[0].logprobs, plain[logprobs_of].outputs[0].logprobs, atol=1e-4)
    stats = llm.engine.speculative_stats()
    assert stats["num_drafts"] > 0 and stats["num_accepted_tokens"] > stats["num_drafts"] / 2


def test_penalties_and_min_tokens_speculate_with_the_same_tokens(moe):
    """Penalties and min_tokens bans follow each position's history: position j of a verify row counts
    the drafts before it, so requests with repetition / presence / frequency penalties (greedy and
    seeded) and a min_tokens ban run verify rows and give the tokens and logprobs of decoding without
    drafts."""
    path, _ = moe
    prompts, _ = workload()
    # a bias makes one token likely, so that the history rule decides many positions: its count so
    # far (frequency), its having been seen (presence, repetition), the stop token's ban (min_tokens)
    params = [
        SamplingParams(temperature=0, max_tokens=14, ignore_eos=True, logit_bias={7: 4.0}, frequency_penalty=1.0),
        SamplingParams(temperature=0.9, seed=5, max_tokens=14, ignore_eos=True, logit_bias={9: 4.0},
                       presence_penalty=2.0, logprobs=1),
        SamplingParams(temperature=0, max_tokens=14, ignore_eos=True, logit_bias={11: 3.0}, repetition_penalty=2.0),
        SamplingParams(temperature=0, max_tokens=14, min_tokens=6, stop_token_ids=[13], logit_bias={13: 8.0}),
    ]  # fmt: skip
    plain = engine(path, None).generate(prompts, params, use_tqdm=False)
    assert len(token_ids(plain)[3]) == 7 and token_ids(plain)[3][-1] == 13  # stopped at its first chance
    assert all(t in ids for ids, t in zip(token_ids(plain)[:3], (7, 9, 11), strict=True))
    assert_speculation_keeps(path, prompts, params, plain, logprobs_of=1)


def test_logprobs_match(moe):
    path, reference = moe
    prompts, _ = workload()
    sp = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=2)
    plain = engine(path, None).generate(prompts, sp, use_tqdm=False)
    llm = engine(path, 4)
    llm.engine.scheduler.drafter = ReferenceDrafter(reference, 0.7, VOCAB_SIZE)
    ours = llm.generate(prompts, sp, use_tqdm=False)
    assert token_ids(ours) == token_ids(plain)
    for a, b in zip(ours, plain, strict=True):
        got, want = a.outputs[0].logprobs, b.outputs[0].logprobs
        assert len(got) == len(want) == MAX_TOKENS
        assert_entries_close(got, want, atol=1e-4)


def test_stops_inside_a_verify_row(moe):
    """Accepted tokens past a stop are dropped: stop ids, EOS, stop strings, max_tokens and
    max_model_len end the output where decoding without speculation ends it."""
    path, reference = moe
    prompts, _ = workload()
    prompt = prompts[1]
    ref = reference[tuple(prompt)]
    stop_id = ref[5]
    cases = [
        dict(params=SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, stop_token_ids=[stop_id])),
        dict(params=SamplingParams(temperature=0, max_tokens=7, ignore_eos=True)),
        dict(params=SamplingParams(temperature=0, max_tokens=None, ignore_eos=True), max_model_len=len(prompt) + 6),
        dict(params=SamplingParams(temperature=0, max_tokens=20), eos=stop_id),
    ]
    plain_llm = engine(path, None)
    text = plain_llm.tokenizer.decode(ref[:12])
    stop = text[len(text) // 2 :][:3]
    cases.append(dict(params=SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, stop=[stop])))
    for case in cases:
        kw = {}
        if "max_model_len" in case:
            kw["max_model_len"] = case["max_model_len"]
        if "eos" in case:
            kw["model_config"] = dataclasses.replace(ModelConfig.from_pretrained(path), eos_token_ids=(case["eos"],))
        want = engine(path, None, **kw).generate([prompt], case["params"], use_tqdm=False)[0].outputs[0]
        llm = engine(path, 4, **kw)
        llm.engine.scheduler.drafter = ReferenceDrafter(reference, 1.0, VOCAB_SIZE)
        got = llm.generate([prompt], case["params"], use_tqdm=False)[0].outputs[0]
        assert (got.token_ids, got.text, got.finish_reason, got.stop_reason) == (
            want.token_ids,
            want.text,
            want.finish_reason,
            want.stop_reason,
        ), case
        assert len(got.token_ids) < 20


@pytest.mark.parametrize(
    "config, match",
    [
        ({"method": "eagle", "num_speculative_tokens": 2}, "speculative_config: method 'eagle'"),
        ({"method": "mtp", "num_speculative_tokens": 0}, "speculative_config: num_speculative_tokens"),
        ({"method": "mtp", "num_speculative_tokens": 16}, "speculative_config: num_speculative_tokens"),
        ({"method": "mtp", "num_speculative_tokens": "3"}, "speculative_config: num_speculative_tokens"),
        ({"method": "mtp"}, "speculative_config: num_speculative_tokens"),
        ({"method": "mtp", "num_speculative_tokens": 2, "draft_model": "x"}, "speculative_config: unknown key"),
        ("mtp", "speculative_config: must be"),
    ],
)
def test_bad_config_names_the_field(moe, config, match):
    path, _ = moe
    with pytest.raises(ValueError, match=match):
        LLM(str(path), speculative_config=config)


def test_checkpoint_without_mtp_is_an_error(tmp_path):
    save_tiny("qwen3_5", tmp_path / "no_weights", mtp=False)
    with pytest.raises(ValueError, match=r"mtp\.\*"):
        LLM(str(tmp_path / "no_weights"), speculative_config=spec(2))
    save_tiny("qwen3_next", tmp_path / "no_head", mtp=False, num_nextn_predict_layers=0)
    with pytest.raises(ValueError, match="declares none"):
        LLM(str(tmp_path / "no_head"), speculative_config=spec(2))


class Recording:
    """Keeps every draft the head proposed (with the tokens it followed) and passes on another
    drafter's: the head's KV and hidden-state bookkeeping is checked under partial acceptance."""

    def __init__(self, inner):
        self.inner, self.seen = inner, []

    def propose(self, req, k, head_drafts):
        self.seen.append((req.prompt_token_ids + req.output_token_ids, list(head_drafts)))
        return self.inner.propose(req, k, head_drafts)


def test_head_drafts_match_its_reference(family, request):
    """The drafts the engine's head proposes after each step (its catch-up over prefill chunks and
    the accepted verify positions, then its own draft steps) are those of the plain-torch head over
    the whole sequence so far."""
    from mtp_reference import Reference

    path, reference = family
    fam = request.node.callspec.params["family"]
    ref = Reference(fam, path, request.getfixturevalue("tiny_checkpoints")[fam][1])
    llm = engine(path, 3)
    recording = Recording(ReferenceDrafter(reference, 0.7, VOCAB_SIZE))
    llm.engine.scheduler.drafter = recording
    prompts, params = workload()
    llm.generate(prompts, params, use_tqdm=False)
    assert len(recording.seen) > 10
    for tokens, drafts in recording.seen:
        assert drafts == ref.drafts(tokens, 3), len(tokens)


def test_flag_and_kwarg_give_the_same_config(tmp_path):
    """`--speculative-config '{json}'` on serve's command line and LLM(speculative_config=...) build
    the same tree; a flag that is not a JSON object is an argparse error naming the flag."""
    from deltaserve.cli import build_parser
    from deltaserve.cluster.config import EngineConfig
    from deltaserve.cluster.entrypoints.cli import engine_config

    parser = build_parser(["serve"])
    args = parser.parse_args(["serve", "--model", str(tmp_path), "--speculative-config", json.dumps(spec(3))])
    config = engine_config(args, "local")
    assert config == EngineConfig.from_kwargs(model=str(tmp_path), speculative_config=spec(3), executor="local")
    assert config.worker_config().runner.num_speculative_tokens == 3
    for text in ("{method: mtp}", "[3]"):
        with pytest.raises(SystemExit):
            parser.parse_args(["serve", "--model", str(tmp_path), "--speculative-config", text])
    with pytest.raises(ValueError, match="^speculative_config: num_speculative_tokens"):
        engine_config(parser.parse_args(["serve", "--speculative-config", '{"num_speculative_tokens": 99}']), "local")


def test_replicas_counters_add_up():
    """GetModelInfo with data-parallel replicas: the counters of one stats object that recorded every
    replica's verify rows are the replicas' counters added up."""
    from deltaserve.cluster.core.speculative import SpecStats, SpeculativeInfo

    accepted = [[0, 2, 3], [1, 1], [3, 0, 0, 2]]  # each replica's verify rows
    replicas, together = [SpecStats(3) for _ in accepted], SpecStats(3)
    for stats, rows in zip(replicas, accepted, strict=True):
        for n in rows:
            stats.record(n)
            together.record(n)
    assert SpeculativeInfo.total([s.info() for s in replicas]) == together.info()
    assert SpeculativeInfo.total([SpecStats(2).info()]).mean_acceptance_length == 0.0
