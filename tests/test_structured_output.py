"""Structured output end to end on the demo model (random weights, the real Qwen3.5 tokenizer: nothing
parses by luck): 200 generations under 20 JSON schemas all valid by `jsonschema`, regex and choice
outputs matching, grammar outputs parsing by Python's own parser, while the same prompts without the
constraint give almost nothing valid; free requests in a batch with constrained ones give exactly
their tokens alone; async scheduling and preemption change no constrained token; a request waits for
its grammar while the others run; bad constraints are errors naming the field (and INVALID_ARGUMENT
over gRPC)."""

from __future__ import annotations

import ast
import json
import re
import time

import jsonschema
import pytest
from tiny_models import VOCAB_SIZE

from deltaserve import LLM, SamplingParams
from deltaserve.bench.spec_drafts import ReferenceDrafter
from deltaserve.cluster.core.sampling_params import StructuredOutputsParams
from deltaserve.workers.grammar import GrammarCompiler
from deltaserve.workers.sampler import Sampler

pytestmark = pytest.mark.timeout(300)


def INT(lo: int, hi: int) -> dict:
    return {"type": "integer", "minimum": lo, "maximum": hi}


def STR(n: int) -> dict:
    return {"type": "string", "maxLength": n}


def OBJ(props: dict, required: list[str] | None = None) -> dict:
    return {"type": "object", "properties": props, "required": list(props) if required is None else required}


# bounded languages (lengths, ranges, item counts): a random model meets the end before max_tokens
SCHEMAS = [
    OBJ({"name": STR(12), "age": INT(0, 150)}),
    {"type": "boolean"},
    {"enum": ["red", "green", "blue", 42, None]},
    {"type": "array", "items": INT(-50, 50), "minItems": 1, "maxItems": 4},
    OBJ({"ok": {"type": "boolean"}, "code": INT(100, 599)}),
    STR(16),
    {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"},
    OBJ({"point": OBJ({"x": INT(0, 99), "y": INT(0, 99)})}),
    {"type": "array", "items": STR(5), "maxItems": 3},
    OBJ({"id": INT(1, 9999), "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3}}),
    {"anyOf": [INT(0, 10), STR(4)]},
    OBJ({"kind": {"const": "user"}, "active": {"type": "boolean"}}),
    {"type": "null"},
    OBJ({"date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"}}),
    OBJ({"a": INT(0, 9), "b": {"type": ["string", "null"], "maxLength": 6}}),
    {"type": "array", "prefixItems": [{"type": "boolean"}, INT(0, 5)], "items": False, "minItems": 2},
    INT(-1000, 1000),
    OBJ(
        {
            "user": OBJ({"name": {"type": "string", "minLength": 1, "maxLength": 8}, "admin": {"type": "boolean"}}),
            "ids": {"type": "array", "items": INT(0, 99), "maxItems": 2},
        }
    ),
    OBJ({"status": {"enum": ["open", "closed"]}, "priority": INT(1, 5), "note": STR(5)}, ["status", "priority"]),
    {"type": "array", "items": {"type": "boolean"}, "minItems": 2, "maxItems": 2},
]
REGEXES = [
    r"[a-z]{3,8}@[a-z]{2,6}\.(com|org|net)",
    r"\d{4}-\d{2}-\d{2}",
    r"\+?[0-9]{2,3} [0-9]{3}-[0-9]{4}",
    r"#[0-9a-f]{6}",
    r"(yes|no|maybe), because [a-z ]{5,20}\.",
    r"[A-Z][a-z]{1,9} [A-Z][a-z]{1,9}",
]
CHOICES = ['yes "quoted"', "yes", "back\\slash", "new\nline", "ünïcödé ✓", "a|b"]
ARITHMETIC = """
root ::= expr
expr ::= term (("+" | "-") term){0,2}
term ::= factor (("*" | "/") factor){0,1}
factor ::= num | "(" num (("+" | "-") num){1,2} ")"
num ::= [1-9] [0-9]?
"""  # at most 65 characters


def constrained(i: int, max_tokens: int = 64, **constraint) -> SamplingParams:
    """Greedy for most prompts, seeded sampling for every fifth: both kinds of rows are masked."""
    sampled = i % 5 == 4
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=0.8 if sampled else 0.0,
        seed=i if sampled else None,
        structured_outputs=StructuredOutputsParams(**constraint),
    )


def json_valid(text: str, schema: dict) -> bool:
    try:
        jsonschema.validate(json.loads(text), schema)  # json.loads: strict (no raw control characters)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


@pytest.fixture(scope="module")
def llm(demo_llm):
    return demo_llm


def test_200_generations_under_20_json_schemas_are_valid(llm):
    prompts, params, schemas = [], [], []
    for k, schema in enumerate(SCHEMAS):
        for i in range(10):
            prompts.append(f"Item {i} of kind {k}, as JSON:")
            params.append(constrained(i, json=schema, disable_any_whitespace=True))
            schemas.append(schema)
    outs = llm.generate(prompts, params, use_tqdm=False)
    invalid = [
        (o.outputs[0].text, s) for o, s in zip(outs, schemas, strict=True) if not json_valid(o.outputs[0].text, s)
    ]
    assert not invalid, invalid[:3]
    assert {o.outputs[0].finish_reason for o in outs} == {"stop"}  # the grammar ended each one
    assert len({o.outputs[0].text for o in outs}) > 120  # not one answer per schema
    # the same prompts without the constraint: almost nothing is valid
    free = llm.generate(prompts[::10], SamplingParams(max_tokens=24, temperature=0), use_tqdm=False)
    assert sum(json_valid(o.outputs[0].text, s) for o, s in zip(free, SCHEMAS, strict=True)) <= 1


def test_json_object_outputs_are_objects(llm):
    # any object's keys are unbounded strings, which a random model rarely closes: those that ended
    # are objects, the others are cut inside their first key
    outs = llm.generate(
        [f"Object {i}:" for i in range(12)],
        [constrained(i, max_tokens=24, json_object=True, disable_any_whitespace=True) for i in range(12)],
        use_tqdm=False,
    )
    ended = [o.outputs[0].text for o in outs if o.outputs[0].finish_reason == "stop"]
    assert ended and all(isinstance(json.loads(text), dict) for text in ended), ended
    assert all(o.outputs[0].text.startswith('{"') for o in outs if o.outputs[0].finish_reason == "length")


def test_regex_and_choice_outputs_match(llm):
    prompts, params, checks = [], [], []
    for k, pattern in enumerate(REGEXES):
        for i in range(3):
            prompts.append(f"Example {i} of {k}:")
            params.append(constrained(i + 2, regex=pattern))  # i + 2 = 4: one sampled row per regex
            checks.append(lambda text, p=pattern: re.fullmatch(p, text) is not None)
    for i in range(10):
        prompts.append(f"Pick one ({i}):")
        params.append(constrained(i, choice=CHOICES))
        checks.append(lambda text: text in CHOICES)
    outs = llm.generate(prompts, params, use_tqdm=False)
    texts = [o.outputs[0].text for o in outs]
    assert all(check(t) for check, t in zip(checks, texts, strict=True)), texts
    assert len(set(texts[-10:])) > 1  # the choice depends on the prompt
    free = llm.generate(prompts[::3], SamplingParams(max_tokens=16, temperature=0), use_tqdm=False)
    assert not any(check(o.outputs[0].text) for check, o in zip(checks[::3], free, strict=True))


def _arithmetic_value(text: str) -> float:
    """Python's parser reads the output as an expression of integers, + - * / and parentheses only."""
    tree = ast.parse(text, mode="eval")
    allowed = (ast.Expression, ast.BinOp, ast.Constant, ast.Add, ast.Sub, ast.Mult, ast.Div)
    assert all(isinstance(node, allowed) for node in ast.walk(tree)), text
    return eval(compile(tree, "<output>", "eval"))  # only numbers and operators, checked above


def test_grammar_outputs_parse(llm):
    outs = llm.generate(
        [f"Compute {i}:" for i in range(12)],
        [constrained(i, max_tokens=80, grammar=ARITHMETIC) for i in range(12)],
        use_tqdm=False,
    )
    for o in outs:
        _arithmetic_value(o.outputs[0].text)
        assert o.outputs[0].finish_reason == "stop"
    free = llm.generate(
        [f"Compute {i}:" for i in range(12)], SamplingParams(max_tokens=16, temperature=0), use_tqdm=False
    )
    parsed = 0
    for o in free:
        try:
            _arithmetic_value(o.outputs[0].text)
            parsed += 1
        except (SyntaxError, AssertionError, ValueError):
            pass
    assert parsed <= 1


FREE = [
    SamplingParams(max_tokens=12, temperature=0, ignore_eos=True),
    SamplingParams(max_tokens=12, temperature=0.9, seed=7, ignore_eos=True),
    SamplingParams(max_tokens=12, temperature=0.7, top_k=20, seed=8, repetition_penalty=1.3, ignore_eos=True),
    SamplingParams(max_tokens=12, temperature=0, presence_penalty=0.5, ignore_eos=True, logprobs=2),
]


def test_free_requests_beside_constrained_ones_give_their_tokens_alone(llm):
    free_prompts = [f"Free prompt number {i}" for i in range(len(FREE))]
    alone = llm.generate(free_prompts, FREE, use_tqdm=False)
    prompts, params = [], []
    for i, p in enumerate(FREE):  # interleaved: constrained rows between the free ones
        prompts += [free_prompts[i], f"Constrained {i}:"]
        params += [p, constrained(i, json=SCHEMAS[i], disable_any_whitespace=True)]
    mixed = llm.generate(prompts, params, use_tqdm=False)
    for i in range(len(FREE)):
        a, m = alone[i].outputs[0], mixed[2 * i].outputs[0]
        assert m.token_ids == a.token_ids, i
        if a.logprobs is not None:
            assert [list(entry) for entry in m.logprobs] == [list(entry) for entry in a.logprobs]
        assert json_valid(mixed[2 * i + 1].outputs[0].text, SCHEMAS[i])


def test_async_scheduling_changes_no_constrained_token(llm):
    prompts = [f"Async {i}:" for i in range(8)]
    params = [constrained(i, json=SCHEMAS[i + 7], disable_any_whitespace=True) for i in range(8)]
    params += [constrained(8, regex=REGEXES[0]), constrained(9, choice=CHOICES)]
    prompts += ["Async regex:", "Async choice:"]
    assert llm.engine.async_scheduling
    overlapped = llm.generate(prompts, params, use_tqdm=False)
    llm.engine.set_async_scheduling(False)
    try:
        synchronous = llm.generate(prompts, params, use_tqdm=False)
    finally:
        llm.engine.set_async_scheduling(True)
    assert [o.outputs[0].token_ids for o in overlapped] == [o.outputs[0].token_ids for o in synchronous]


def test_preempted_constrained_requests_resume_their_grammar(llm, demo_path):
    prompts = [f"Preempt me {i}, please:" for i in range(6)]
    schema = OBJ({"name": STR(20), "note": STR(20), "n": INT(0, 9999)})
    params = [constrained(i, json=schema, disable_any_whitespace=True) for i in range(6)]
    roomy = llm.generate(prompts, params, use_tqdm=False)
    tight = LLM(demo_path, max_num_seqs=8, block_size=16, max_num_batched_tokens=32, num_kv_blocks=8)
    try:
        squeezed = tight.generate(prompts, params, use_tqdm=False)
        assert tight.engine.scheduler.stats.num_preemptions > 0
    finally:
        tight.shutdown()
    assert [o.outputs[0].token_ids for o in squeezed] == [o.outputs[0].token_ids for o in roomy]
    assert all(json_valid(o.outputs[0].text, schema) for o in squeezed)


@pytest.mark.parametrize("drafts", ["reference", "head"])
def test_constrained_requests_speculate_with_the_tokens_of_decoding(tiny_checkpoints, monkeypatch, drafts):
    """With MTP speculation constrained requests run verify rows like the free ones: each position is
    masked to what the grammar allows after the drafts before it, and the accepted tokens advance the
    grammar. Greedy and seeded, with drafts mostly right (the reference run's, at 0.8) or the head's
    own, every token is the one decoding without speculation gives."""
    path = str(tiny_checkpoints["qwen3_5_moe"][0])  # a byte-level tokenizer and an MTP head
    prompts = [[5, 6, 7], [8, 9, 10, 11], [12, 13], [14, 15, 16, 17, 18], [19, 20], [21, 22, 23]]
    free = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": INT(0, 999)}, "required": ["ok", "n"]}
    params = [
        free,
        constrained(0, regex="[a-z]{3,9}!"),
        free,
        constrained(4, choice=["yes", "no", "maybe so"]),  # seeded
        constrained(1, json=schema),
        constrained(9, json=schema),  # seeded
    ]
    plain = LLM(path, max_num_seqs=8)
    want = plain.generate(prompts, params, use_tqdm=False)
    plain.shutdown()
    speculative = LLM(path, max_num_seqs=8, speculative_config={"method": "mtp", "num_speculative_tokens": 3})
    try:
        if drafts == "reference":
            reference = {tuple(p): list(o.outputs[0].token_ids) for p, o in zip(prompts, want, strict=True)}
            speculative.engine.scheduler.drafter = ReferenceDrafter(reference, 0.8, VOCAB_SIZE)
        plans = _record_plans(speculative.engine, monkeypatch)
        got = speculative.generate(prompts, params, use_tqdm=False)
        stats = speculative.engine.speculative_stats()
    finally:
        speculative.shutdown()
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert re.fullmatch("[a-z]{3,9}!", got[1].outputs[0].text) and got[3].outputs[0].text in ("yes", "no", "maybe so")
    for i in (4, 5):
        jsonschema.validate(json.loads(got[i].outputs[0].text), schema)
    constrained_ids = {got[i].request_id for i in (1, 3, 4, 5)}
    verified = {r for _, p in plans if p.num_spec_tokens for r in p.req_ids[: p.num_decode_rows]}
    assert constrained_ids <= verified
    if drafts == "reference":  # rows of several accepted tokens, constrained ones among them
        assert stats["num_accepted_tokens"] > stats["num_drafts"] / 2


def test_forced_tokens_replace_refused_drafts(tiny_checkpoints, monkeypatch):
    """Where the grammar allows one token (a JSON key, its quotes and colon), that token replaces a
    draft the grammar refuses: the head's random drafts are then accepted there, and every token is
    still the one decoding without speculation gives (greedy and seeded)."""
    path = str(tiny_checkpoints["qwen3_5_moe"][0])  # a byte-level tokenizer and an MTP head
    keys = ["a_rather_long_key_name", "another_key_the_grammar_spells_out"]
    schema = {"type": "object", "properties": {k: INT(0, 9) for k in keys}, "required": keys}
    prompts = [[5, 6, 7], [8, 9, 10, 11], [12, 13]]
    params = [constrained(i, max_tokens=100, json=schema, disable_any_whitespace=True) for i in (0, 3)]
    params.append(SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    plain = LLM(path, max_num_seqs=8)
    want = plain.generate(prompts, params, use_tqdm=False)
    plain.shutdown()
    runs = {}
    for forced in (True, False):
        if not forced:  # the head's drafts as they come
            monkeypatch.setattr(Sampler, "grammar_drafts", lambda self, req_ids, drafts: drafts)
        speculative = LLM(path, max_num_seqs=8, speculative_config={"method": "mtp", "num_speculative_tokens": 3})
        try:
            got = speculative.generate(prompts, params, use_tqdm=False)
            runs[forced] = speculative.engine.speculative_stats()
        finally:
            speculative.shutdown()
        assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    for o in got[:2]:
        assert set(json.loads(o.outputs[0].text)) == set(keys)
    forced_keys = sum(len(k) + 3 for k in keys)  # each key's characters, its quotes and colon: forced bytes
    assert runs[True]["num_accepted_tokens"] - runs[False]["num_accepted_tokens"] >= forced_keys
    assert runs[True]["num_drafts"] < runs[False]["num_drafts"]  # fewer verify passes for the same tokens


class _SlowCompiles:
    """The worker's compiles take `delay_s` longer (or fail): a grammar still compiling for a while."""

    def __init__(self, monkeypatch, delay_s: float = 0.0, error: str | None = None):
        original = GrammarCompiler._compile

        def slow(compiler, spec):
            time.sleep(delay_s)
            if error is not None:
                raise RuntimeError(error)
            return original(compiler, spec)

        monkeypatch.setattr(GrammarCompiler, "_compile", slow)


def _record_plans(engine, monkeypatch) -> list:
    """The plans the engine launches from now on, as (launch time, plan)."""
    plans = []
    for name in ("execute", "execute_async"):  # synchronous passes, overlapped ones
        launch = getattr(engine.executor, name)

        def recording(plan, launch=launch):
            plans.append((time.monotonic(), plan))
            return launch(plan)

        monkeypatch.setattr(engine.executor, name, recording)
    return plans


def test_a_request_waits_for_its_grammar_while_others_run(llm, monkeypatch):
    engine = llm.engine
    plans = _record_plans(engine, monkeypatch)
    _SlowCompiles(monkeypatch, delay_s=1.0)
    engine.add_request("free", "Keep going", SamplingParams(max_tokens=200, temperature=0, ignore_eos=True))
    for _ in range(3):
        engine.step()
    fresh = {"type": "object", "properties": {"waited": INT(0, 9)}, "required": ["waited"]}  # never compiled yet
    engine.add_request("guided", "Wait for it:", constrained(0, json=fresh, disable_any_whitespace=True))
    outputs = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out
        if "guided" in outputs:
            engine.abort("free")
    sent = next(i for i, (_, p) in enumerate(plans) if any(g.kind == "json" for g in p.grammars))
    admitted = next(i for i, (_, p) in enumerate(plans) if "guided" in p.req_ids)
    assert plans[admitted][0] - plans[sent][0] >= 0.9  # not before its grammar was compiled
    assert admitted - sent >= 2  # passes ran meanwhile, and the free request decoded in each
    assert all("free" in p.req_ids for _, p in plans[sent:admitted])
    assert json_valid(outputs["guided"].outputs[0].text, fresh)


def test_alone_a_request_runs_while_its_grammar_compiles(llm, monkeypatch):
    engine = llm.engine
    plans = _record_plans(engine, monkeypatch)
    _SlowCompiles(monkeypatch, delay_s=0.3)
    fresh = {"type": "array", "items": {"const": "alone"}, "minItems": 1, "maxItems": 2}
    (out,) = llm.generate("Nothing else runs:", constrained(0, json=fresh, disable_any_whitespace=True), use_tqdm=False)
    first = plans[0][1]
    assert first.req_ids[0].startswith("llm-") and first.grammars  # admitted in the pass that sends its grammar
    assert json_valid(out.outputs[0].text, fresh)


def test_a_grammar_that_fails_on_the_workers_fails_its_requests_only(llm, monkeypatch):
    engine = llm.engine
    _SlowCompiles(monkeypatch, delay_s=0.2, error="compiler exploded")
    engine.add_request("free", "Keep going", SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))
    engine.step()
    broken = {"type": "object", "properties": {"broken": {"type": "boolean"}}}
    engine.add_request("doomed", "Fail:", constrained(0, json=broken))
    outputs = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out
    assert outputs["doomed"].outputs[0].finish_reason == "error"
    assert "compiler exploded" in outputs["doomed"].error
    assert len(outputs["free"].outputs[0].token_ids) == 40


def test_a_grammar_the_driver_forgot_is_sent_and_waited_for_again(llm, monkeypatch):
    """The driver keeps fewer ready grammars than a worker keeps compiled: one it forgot is sent
    again (and waited for), never assumed compiled on a worker that may have dropped it."""
    from deltaserve.cluster.core import scheduler as scheduler_module

    monkeypatch.setattr(scheduler_module, "READY_GRAMMARS", 2)
    plans = _record_plans(llm.engine, monkeypatch)
    choices = [[f"forgotten {i}"] for i in range(3)]
    for choice in [*choices, choices[0], choices[2]]:
        (out,) = llm.generate("x", constrained(0, choice=choice), use_tqdm=False)
        assert out.outputs[0].text == choice[0]
    sent = [json.loads(g.text) for _, p in plans for g in p.grammars]
    assert sent == [*choices, choices[0]]  # the oldest was forgotten, the newest was not


@pytest.mark.parametrize(
    "constraint,field",
    [
        ({"json": {"type": "objekt"}}, "structured_outputs.json: does not compile"),
        ({"regex": "[a-"}, "structured_outputs.regex: does not compile"),
        ({"grammar": 'root ::= "a" | b'}, "structured_outputs.grammar: does not compile"),
        (
            {"json": '{"type": "object", "properties": {"x": {"type": "integer", "minimum": 5, "maximum": 1}}}'},
            "structured_outputs.json: does not compile",
        ),
    ],
)
def test_constraints_that_do_not_compile_name_the_field(llm, constraint, field):
    params = SamplingParams(max_tokens=8, structured_outputs=StructuredOutputsParams(**constraint))
    with pytest.raises(ValueError, match=f"^{re.escape(field)}"):
        llm.generate("bad", params, use_tqdm=False)
    (ok,) = llm.generate("good", constrained(0, choice=["fine"]), use_tqdm=False)  # the engine still serves
    assert ok.outputs[0].text == "fine"


@pytest.mark.parametrize(
    "kwargs,field",
    [
        ({"choice": []}, "structured_outputs.choice: must not be empty"),
        ({"choice": ["a", ""]}, "structured_outputs.choice"),
        (
            {"json": {"type": "object"}, "regex": "a+"},
            "structured_outputs: give only one constraint, got json and regex",
        ),
        ({}, "structured_outputs: give one of"),
        ({"json": "{not json"}, "structured_outputs.json: is not valid JSON"),
        ({"json": [1, 2]}, "structured_outputs.json: must be a JSON schema object"),
        ({"json_object": "yes"}, "structured_outputs.json_object"),
        ({"regex": ""}, "structured_outputs.regex"),
    ],
)
def test_malformed_constraints_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=f"^{re.escape(field)}"):
        StructuredOutputsParams(**kwargs)


def test_min_tokens_with_a_constraint_names_min_tokens():
    with pytest.raises(ValueError, match="^min_tokens:"):
        SamplingParams(min_tokens=2, structured_outputs=StructuredOutputsParams(choice=["a"]))


def test_long_bad_constraints_are_not_echoed_back(llm):
    params = SamplingParams(structured_outputs=StructuredOutputsParams(regex="(" * 5000))
    with pytest.raises(ValueError) as error:
        llm.generate("x", params, use_tqdm=False)
    assert str(error.value).startswith("structured_outputs.regex") and len(str(error.value)) < 400


def _mixed_batch() -> tuple[list[str], list[SamplingParams]]:
    """48 constrained rows (greedy and seeded sampled) beside 16 free ones."""
    prompts, params = [], []
    for i in range(64):
        prompts.append(f"Row {i}:")
        if i % 4 == 3:
            sampled = i % 8 == 7
            params.append(SamplingParams(max_tokens=20, temperature=0.9 if sampled else 0, seed=i, ignore_eos=True))
        else:
            params.append(constrained(i, json=SCHEMAS[i % len(SCHEMAS)], disable_any_whitespace=True))
    return prompts, params


@pytest.mark.gpu
def test_gpu_graphs_and_async_change_no_token_of_a_mixed_batch(demo_path, monkeypatch):
    """The race vLLM shipped (guided decoding + CUDA graphs + async copies): on the GPU, decode graphs
    with async scheduling give the tokens of eager synchronous passes (float32 with IEEE dots, so
    that the graphs' padded GEMMs round alike), and every constrained output is valid."""
    monkeypatch.setenv("TRITON_F32_DEFAULT", "ieee")
    prompts, params = _mixed_batch()
    results = []
    for eager in (False, True):
        llm = LLM(demo_path, device="cuda", dtype="float32", enforce_eager=eager, max_num_seqs=64, num_kv_blocks=1024)
        try:
            assert (llm.engine.executor.runner.graphs is None) == eager
            if eager:
                llm.engine.set_async_scheduling(False)
            # every grammar compiled first: both runs admit the batch alike, not as compiles finish
            warm = [SamplingParams(max_tokens=1, structured_outputs=p.structured_outputs) for p in params[:20]]
            llm.generate(["warm"] * len(warm), warm, use_tqdm=False)
            results.append(llm.generate(prompts, params, use_tqdm=False))
        finally:
            llm.shutdown()
    overlapped, synchronous = results
    assert [o.outputs[0].token_ids for o in overlapped] == [o.outputs[0].token_ids for o in synchronous]
    for i, (o, p) in enumerate(zip(overlapped, params, strict=True)):
        if p.structured_outputs is not None:
            assert json_valid(o.outputs[0].text, SCHEMAS[i % len(SCHEMAS)]), o.outputs[0].text


@pytest.mark.gpu
def test_gpu_first_constrained_requests_compile_no_kernel(demo_path):
    """The mask kernel (every row constrained, and some rows) ran in the start-up warm-up: a server's
    first constrained requests compile no Triton kernel (a stall for every running request)."""
    from deltaserve.layers.kernels.bitmask.triton_bitmask import _apply_bitmask_kernel

    _apply_bitmask_kernel.device_caches.clear()  # as in a fresh worker
    llm = LLM(demo_path, device="cuda", max_num_seqs=64, num_kv_blocks=1024)
    try:
        late = llm.engine.executor.runner.late_compiles
        llm.generate("Alone:", constrained(0, choice=["a", "b"]), use_tqdm=False)
        prompts, params = _mixed_batch()
        llm.generate(prompts[:8], params[:8], use_tqdm=False)
        assert [r for r, _ in late.events] == []
    finally:
        llm.shutdown()
