"""Structured output's pieces against xgrammar's own matcher: constraints parse (or fail naming the
field), bounded JSON strings keep control characters out, choices are exact; the sampler masks
greedy and sampled rows to what a fresh matcher allows; a request's grammar replays its history and
advances with its tokens; the compiler reports each grammar once; the speculative-decoding hooks
agree with feeding drafts to fresh matchers; the constraint crosses the wire; OpenAI's
response_format converts."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import xgrammar as xgr
from xgrammar.testing import _is_grammar_accept_string as accepts

from deltaserve.cluster.core.sampling_params import SamplingParams, StructuredOutputsParams
from deltaserve.cluster.core.tokenizer import Tokenizer
from deltaserve.cluster.entrypoints.demo_model import VOCAB_SIZE, ensure_demo_model
from deltaserve.layers.kernels.bitmask.naive import allowed_tokens
from deltaserve.workers import grammar as grammar_module
from deltaserve.workers.grammar import (
    GrammarCompiler,
    RequestGrammar,
    error_text,
    fill_draft_bitmasks,
    parse_grammar,
)
from deltaserve.workers.plan import GrammarSpec, NewRequestData, PassPlan, RunnerOutput, SamplingSpec
from deltaserve.workers.sampler import Sampler
from deltaserve.workers.wire import decode_output, decode_plan, encode_output, encode_plan

WORDS = -(-VOCAB_SIZE // 32)
POINT = {"type": "object", "properties": {"x": {"type": "integer"}, "tag": {"type": "string", "maxLength": 4}}}


def spec(**constraint) -> GrammarSpec:
    return StructuredOutputsParams(**constraint).to_grammar_spec()


@pytest.fixture(scope="module")
def demo():
    """(tokenizer, grammar compiler) of the demo model: the real Qwen3.5 vocabulary."""
    path = ensure_demo_model()
    tokenizer = Tokenizer(path)
    eos = [tokenizer.token_to_id("<|im_end|>"), tokenizer.token_to_id("<|endoftext|>")]
    compiler = GrammarCompiler(path, VOCAB_SIZE, eos)
    yield tokenizer, compiler, eos
    compiler.shutdown()


def compiled(compiler: GrammarCompiler, grammar_spec: GrammarSpec):
    return compiler.prepare(grammar_spec).result(timeout=120)


def mask_of(matcher) -> torch.Tensor:
    bitmask = torch.zeros((1, WORDS), dtype=torch.int32)
    matcher.fill_next_token_bitmask(bitmask)
    return bitmask


# ---- grammars ------------------------------------------------------------------------------------


def test_bounded_json_strings_keep_control_characters_out():
    grammar = parse_grammar(spec(json={"type": "string", "maxLength": 5}))
    assert accepts(grammar, '"ab c"')
    assert not accepts(grammar, '"a\tb"')  # a raw tab: not JSON (xgrammar's own class lets it in)
    assert not accepts(grammar, '"a\u0001"')
    assert not accepts(grammar, '"abcdef"')


def test_choice_is_exactly_one_of_the_strings():
    choices = ['yes "quoted"', "yes", "back\\slash", "new\nline", "ünï ✓"]
    grammar = parse_grammar(spec(choice=choices))
    assert all(accepts(grammar, c) for c in choices)
    assert not any(accepts(grammar, c) for c in ("ye", "yes ", "no", "new", '"yes"'))


def test_json_object_is_any_object_and_only_objects():
    grammar = parse_grammar(spec(json_object=True))
    assert accepts(grammar, '{"a": [1, {"b": null}], "c": "d"}') and accepts(grammar, "{}")
    assert not any(accepts(grammar, s) for s in ("[1]", '"x"', "3", "null"))
    compact = parse_grammar(spec(json_object=True, disable_any_whitespace=True))
    assert accepts(compact, '{"a": 1}') and not accepts(compact, '{ "a" :1}')


@pytest.mark.parametrize(
    "constraint,field",
    [
        ({"json": {"type": "objekt"}}, "structured_outputs.json"),
        ({"regex": "(a"}, "structured_outputs.regex"),
        ({"grammar": "root ::= undefined_rule"}, "structured_outputs.grammar"),
    ],
)
def test_parse_errors_name_the_field_in_one_short_line(constraint, field):
    with pytest.raises(ValueError) as error:
        parse_grammar(spec(**constraint))
    text = str(error.value)
    assert text.startswith(f"{field}: does not compile: ") and "\n" not in text and ".cc:" not in text


def test_error_text_drops_the_cpp_prefix_and_cuts_long_messages():
    assert error_text(RuntimeError("[03:49:44] /project/cpp/x.cc:94: Unclosed '['\nmore")) == "Unclosed '['"
    assert len(error_text(RuntimeError("y" * 1000))) == 200


def test_equal_schemas_share_one_key_and_properties_keep_their_order():
    a = spec(json={"type": "object", "properties": {"a": {"type": "integer"}}})
    b = spec(json='{ "type" : "object",\n "properties": {"a": {"type": "integer"}} }')
    assert a == b and a.key == b.key
    grammar = parse_grammar(spec(json={**POINT, "required": ["x", "tag"]}, disable_any_whitespace=True))
    assert accepts(grammar, '{"x": 1, "tag": "ab"}') and not accepts(grammar, '{"tag": "ab", "x": 1}')
    assert spec(json=POINT).key != spec(json=POINT, disable_any_whitespace=True).key
    assert spec(regex="a+").any_whitespace  # whitespace is a JSON setting only


# ---- the compiler and a request's grammar --------------------------------------------------------


def test_compiler_reports_each_grammar_once(demo):
    _, compiler, _ = demo
    good = spec(regex="[0-9]{3}")
    assert compiler.prepare(good) is compiler.prepare(good)  # one compile per key
    compiled(compiler, good)
    assert compiler.take_ready() == {good.key: None}
    assert compiler.take_ready() == {}
    bad = GrammarSpec("grammar", "root ::= nope")  # the driver would have refused it
    with pytest.raises(ValueError):
        compiler.prepare(bad).result(timeout=60)
    assert compiler.take_ready()[bad.key].startswith("structured_outputs.grammar: does not compile")
    compiler.prepare(bad)  # asked again: reported again
    assert bad.key in compiler.take_ready()


def test_a_request_grammar_replays_its_history_and_ends_at_eos(demo):
    tokenizer, compiler, eos = demo
    point = spec(json=POINT, disable_any_whitespace=True)
    text_ids = tokenizer.encode('{"x": 12, "tag": "ab"}')
    fresh = xgr.GrammarMatcher(compiled(compiler, point))
    for t in text_ids[:5]:
        assert fresh.accept_token(t)
    resumed = RequestGrammar(point.key, compiler.prepare(point), text_ids[:5])  # a preempted request
    assert resumed.start() is None
    assert torch.equal(mask_of(resumed.matcher), mask_of(fresh))
    for t in text_ids[5:]:
        assert resumed.accept(t) is None
    assert not resumed.terminated
    assert allowed_tokens(mask_of(resumed.matcher), VOCAB_SIZE)[0].nonzero().view(-1).tolist() == sorted(eos)
    assert resumed.accept(eos[0]) is None and resumed.terminated
    assert resumed.accept(5) is None  # a token past the end (a pass in flight): ignored
    wrong = RequestGrammar(point.key, compiler.prepare(point), tokenizer.encode("[1]"))
    assert wrong.start().startswith("structured_outputs: token")


def test_a_constraint_after_the_reasoning(demo):
    """reasoning_end (the HTTP server's under --reasoning-parser): any text up to the first end of the
    reasoning block, then the constraint; on the real vocabulary, the reasoning's tokens (a `{` among
    them) pass, the answer is held to the schema, and the request ends after it."""
    end = "</think>\n\n"
    for constraint, answer, wrong in (
        (dict(json=POINT), '{"x": 3}', "[3]"),
        (dict(choice=["yes", "no"]), "no", "maybe"),
    ):
        after = spec(**constraint, reasoning_end=end)
        assert after.key != spec(**constraint).key
        grammar = parse_grammar(after)
        assert accepts(grammar, "Let me {think} < a </think> bit.\n" + end + answer)
        assert not accepts(grammar, answer)  # the reasoning comes first
        assert not accepts(grammar, "x" + end + wrong)
        assert not accepts(grammar, "x" + end + "y" + end + answer)  # the first end closes the reasoning
    tokenizer, compiler, eos = demo
    after = spec(json=POINT, disable_any_whitespace=True, reasoning_end=end)
    grammar = RequestGrammar(after.key, compiler.prepare(after), tokenizer.encode("{hmm} ok\n" + end))
    assert grammar.start() is None
    for t in tokenizer.encode('{"x": 7}'):
        assert grammar.accept(t) is None
    assert allowed_tokens(mask_of(grammar.matcher), VOCAB_SIZE)[0].nonzero().view(-1).tolist() == sorted(eos)
    wrong = RequestGrammar(after.key, compiler.prepare(after), tokenizer.encode("ok" + end + "[1]"))
    assert wrong.start().startswith("structured_outputs: token")
    with pytest.raises(ValueError, match="^structured_outputs.reasoning_end: "):
        StructuredOutputsParams(json=POINT, reasoning_end="")


def test_the_sampler_masks_greedy_and_sampled_rows_to_what_xgrammar_allows(demo):
    tokenizer, compiler, _ = demo
    sampler = Sampler(VOCAB_SIZE, grammars=compiler)
    point = spec(json=POINT, disable_any_whitespace=True)
    prefix = tokenizer.encode('{"x": 1')
    rows = [
        ("greedy", SamplingSpec(temperature=0, grammar=point), prefix),
        ("sampled", SamplingSpec(temperature=1.0, seed=3, grammar=point), prefix),
        ("top-k", SamplingSpec(temperature=0.7, top_k=5, seed=4, grammar=spec(regex="[a-c]{2}")), []),
        ("free", SamplingSpec(temperature=0), []),
    ]
    for req_id, sampling, history in rows:
        sampler.add(NewRequestData(req_id, [1, 2, 3], history, sampling))
    expected = []
    for _, sampling, history in rows:
        if sampling.grammar is None:
            expected.append(None)
            continue
        matcher = xgr.GrammarMatcher(compiled(compiler, sampling.grammar))
        for t in history:
            matcher.accept_token(t)
        expected.append(allowed_tokens(mask_of(matcher), VOCAB_SIZE)[0])
    logits = torch.randn(len(rows), VOCAB_SIZE, generator=torch.Generator().manual_seed(0))
    for _ in range(20):  # seeds move on with each draw; the histories are put back each time
        tokens, _ = sampler.sample([r[0] for r in rows], logits.clone())
        for (req_id, _, history), allowed, token in zip(rows, expected, tokens, strict=True):
            state = sampler.states[req_id]
            if allowed is not None:
                assert allowed[token], (req_id, token)
                if req_id == "greedy":
                    masked = logits[0].masked_fill(~allowed, float("-inf"))
                    assert token == int(masked.argmax())
                state.grammar = RequestGrammar(state.grammar.key, compiler.prepare(state.spec.grammar), history)
            state.output_token_ids = list(history)
    assert tokens[3] == int(logits[3].argmax())  # the free row is untouched


# ---- speculative decoding ------------------------------------------------------------------------


def test_draft_hooks_agree_with_fresh_matchers(demo):
    tokenizer, compiler, eos = demo
    grammar = compiled(compiler, spec(json=POINT, disable_any_whitespace=True))
    good = tokenizer.encode('{"x": 123, "tag": "ab"}')
    bracket = tokenizer.encode("]")[0]
    noise = np.random.default_rng(0).integers(0, 100_000, 3).tolist()
    cases = [
        (0, good[:6]),
        (0, noise),
        (2, good[2:8]),
        (2, good[2:4] + [bracket] + good[5:7]),  # rejected in the middle
        (2, good[2:] + [eos[0]] + good[:2]),  # the grammar ends at EOS: nothing after it
    ]
    for start, draft in cases:
        matcher = xgr.GrammarMatcher(grammar)
        for t in good[:start]:
            assert matcher.accept_token(t)
        before = mask_of(matcher)
        want, masks = 0, []  # the reference: a fresh matcher for each prefix of the draft
        for j in range(len(draft) + 1):
            ref = xgr.GrammarMatcher(grammar)
            if not all(ref.accept_token(t) for t in good[:start] + draft[:j]):
                break
            want = j
            masks.append(None if ref.is_terminated() else mask_of(ref))
        bitmask = torch.zeros((len(draft) + 1, WORDS), dtype=torch.int32)
        assert fill_draft_bitmasks(matcher, draft, bitmask) == want
        for j, mask in enumerate(masks):
            assert (bitmask[j] == -1).all() if mask is None else torch.equal(bitmask[j : j + 1], mask), (start, j)
        assert (bitmask[want + 1 :] == -1).all()  # past the rejection: every token (its sample is dropped)
        assert torch.equal(mask_of(matcher), before)


def test_forced_drafts_follow_the_grammar_and_keep_what_it_allows(demo):
    """Against the real vocabulary: a refused draft token becomes the next of xgrammar's jump-forward
    tokens (the required key, its quotes and colon), an allowed one stays, the first refused token
    with a choice ends the repair (the rest stays), the only allowed stop token ends the JSON, and
    the matcher is left as it was."""
    tokenizer, compiler, eos = demo
    named = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}
    grammar = compiled(compiler, spec(json=named, disable_any_whitespace=True))
    noise = tokenizer.encode(" zebra crossing")
    bitmask = torch.zeros((1, WORDS), dtype=torch.int32)

    def feed(tokens, grammar=grammar) -> xgr.GrammarMatcher:
        matcher = xgr.GrammarMatcher(grammar)
        for t in tokens:
            assert matcher.accept_token(t)
        return matcher

    brace = tokenizer.encode("{")
    matcher = feed(brace)
    before = mask_of(matcher)
    draft = noise * 2
    got = grammar_module.forced_draft(matcher, draft, bitmask)
    assert torch.equal(mask_of(matcher), before)
    # '"name' and '":' forced; the space and quote after them have longer spellings: no jump token
    assert tokenizer.decode(got[:2]) == '"name":' and got[2:] == draft[2:]
    feed(brace + got[:2])
    spelled = tokenizer.encode('"name": "')  # allowed as drafted, though the jump tokens differ
    assert grammar_module.forced_draft(feed(brace), spelled, bitmask) == spelled
    inside = feed(brace + spelled + tokenizer.encode("ab"))
    raw_newline = [tokenizer.encode("\n")[0], *noise]  # refused in a string, where anything else goes
    assert grammar_module.forced_draft(inside, raw_newline, bitmask) == raw_newline
    closed = brace + spelled + tokenizer.encode('ab"}')
    assert grammar_module.forced_draft(feed(closed), noise[:1], bitmask) == noise[:1]  # two stop tokens
    one_stop = GrammarCompiler(compiler.tokenizer_dir, VOCAB_SIZE, eos[:1])
    try:
        single = compiled(one_stop, spec(json=named, disable_any_whitespace=True))
        assert grammar_module.forced_draft(feed(closed, single), noise[:2], bitmask) == [eos[0], noise[1]]
    finally:
        one_stop.shutdown()


# ---- the wire and the API ------------------------------------------------------------------------


def test_the_constraint_and_the_readiness_cross_the_wire():
    point = spec(json=POINT)
    plan = PassPlan(
        pass_id=3,
        req_ids=["a"],
        num_decode_rows=0,
        input_ids=np.array([1, 2], np.int32),
        positions=np.array([0, 1], np.int32),
        slot_mapping=np.array([0, 1]),
        query_start_loc=np.array([0, 2], np.int32),
        seq_lens=np.array([2], np.int32),
        block_tables=np.zeros((1, 1), np.int32),
        state_slots=np.zeros(1, np.int32),
        has_initial_state=np.zeros(1, bool),
        sample_rows=np.ones(1, bool),
        prompt_logprob_rows=np.zeros(1, bool),
        new_requests=[
            NewRequestData(
                "a", [1, 2], [], SamplingParams(structured_outputs=StructuredOutputsParams(json=POINT)).to_spec()
            )
        ],
        grammars=[point, spec(choice=["x"])],
    )
    back = decode_plan(encode_plan(plan))
    assert back.grammars == plan.grammars and back.new_requests[0].sampling.grammar == point
    out = RunnerOutput(3, ["a"], [7], grammars_ready={point.key: None, "k": "bad"}, grammar_errors={"a": "why"})
    again = decode_output(encode_output(out))
    assert again.grammars_ready == out.grammars_ready and again.grammar_errors == out.grammar_errors


def test_response_format_converts_and_errors_name_its_fields():
    convert = StructuredOutputsParams.from_response_format
    assert convert(None) is None and convert({"type": "text"}) is None
    assert convert({"type": "json_object"}) == StructuredOutputsParams(json_object=True)
    schema = {"type": "object", "properties": {"a": {"type": "string"}}}
    got = convert({"type": "json_schema", "json_schema": {"name": "thing", "schema": schema, "strict": True}})
    assert got == StructuredOutputsParams(json=schema)
    assert convert({"type": "json_schema", "json_schema": {"name": "any"}}) == StructuredOutputsParams(json_object=True)
    for bad, field in (
        ({"type": "xml"}, "response_format.type"),
        ("json", "response_format:"),
        ({"type": "json_schema"}, "response_format.json_schema:"),
        ({"type": "json_schema", "json_schema": {"schema": [1]}}, "response_format.json_schema.schema"),
        ({"type": "json_schema", "json_schema": {"name": 3, "schema": {}}}, "response_format.json_schema.name"),
    ):
        with pytest.raises(ValueError, match=f"^{field}"):
            convert(bad)


def test_a_grammar_spec_from_msgpack_is_a_grammar_spec():
    point = spec(json=POINT)
    assert SamplingSpec(grammar={"kind": "json", "text": point.text, "any_whitespace": True}).grammar == point
    assert json.loads(point.text) == POINT


def test_a_config_without_eos_ids_takes_the_tokenizers_own():
    """A checkpoint whose config names no EOS id: grammars still compile, ending on the tokenizer's
    EOS (xgrammar refuses an empty stop list)."""
    path = ensure_demo_model()
    info = grammar_module.tokenizer_info(str(path), VOCAB_SIZE, ())
    assert info.stop_token_ids == [Tokenizer(path).token_to_id("<|endoftext|>")]
