"""The pass plan's msgpack codec: round trips, and malformed plans rejected with a named error
before they reach a kernel or touch another request's state."""

from __future__ import annotations

import msgpack
import numpy as np
import pytest

from deltaserve import LLM, SamplingParams
from deltaserve.cluster.config import EngineConfig
from deltaserve.cluster.entrypoints.startup import build_engine
from deltaserve.workers.plan import NewRequestData, PassPlan, PoolSizes, RunnerOutput, SamplingSpec, TokenLogprobs
from deltaserve.workers.wire import (
    WIRE_VERSION,
    WireError,
    check_plan_ranges,
    decode_output,
    decode_plan,
    encode_output,
    encode_plan,
    rerun_codec,
)


def make_plan() -> PassPlan:
    return PassPlan(
        pass_id=7,
        req_ids=["a", "b"],
        num_decode_rows=1,
        input_ids=np.array([5, 6, 7, 8], np.int32),
        positions=np.array([9, 0, 1, 2], np.int32),
        slot_mapping=np.array([41, 16, 17, 18], np.int64),
        query_start_loc=np.array([0, 1, 4], np.int32),
        seq_lens=np.array([10, 3], np.int32),
        block_tables=np.array([[3, 2, 0], [4, 0, 0]], np.int32),
        state_slots=np.array([0, 1], np.int32),
        has_initial_state=np.array([True, False]),
        sample_rows=np.array([True, True]),
        prompt_logprob_rows=np.array([False, True]),
        next_prompt_token=np.array([-1, -1], np.int32),
        new_requests=[NewRequestData("b", [6, 7, 8], [], SamplingSpec(temperature=0.5, seed=3, logprobs=2))],
        finished_req_ids=["z"],
    )


@pytest.mark.parametrize("input_from_prev", [None, [0, -1]])
def test_plan_round_trip(input_from_prev):
    plan = make_plan()
    if input_from_prev is not None:
        plan.input_from_prev = np.array(input_from_prev, np.int32)
    back = decode_plan(encode_plan(plan))
    for name in vars(plan):
        a, b = getattr(plan, name), getattr(back, name)
        if isinstance(a, np.ndarray):
            assert a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b), name
        else:
            assert a == b, name


def test_encoder_rejects_arrays_that_disagree_with_the_rows():
    plan = make_plan()
    plan.seq_lens = np.array([10, 3, 4], np.int32)
    with pytest.raises(WireError, match=r"'seq_lens' has shape \(3,\), expected \(2,\)"):
        encode_plan(plan)


def test_output_round_trip():
    out = RunnerOutput(
        3,
        ["a"],
        [17],
        {"a": TokenLogprobs(17, -0.5, 1, [17, 3], [-0.5, -1.5])},
        {"b": [TokenLogprobs(4, -2.0, 3, [], [])]},
        0.01,
    )
    assert decode_output(encode_output(out)) == out


def _tamper(edit) -> bytes:
    msg = msgpack.unpackb(encode_plan(make_plan()), raw=False)
    edit(msg)
    return msgpack.packb(msg, use_bin_type=True)


def _with_starts(msg: dict, starts: list[int]) -> bytes:
    """The int32 buffer with query_start_loc (after input_ids and positions, 4 tokens each) replaced."""
    flat = np.frombuffer(msg["body"]["int32"], np.int32).copy()
    flat[8:11] = starts
    return flat.tobytes()


@pytest.mark.parametrize(
    "edit, match",
    [
        (lambda m: m.update(v=WIRE_VERSION + 1), "version"),
        (lambda m: m.pop("v"), "version"),
        (lambda m: m.update(kind="output"), "not a plan"),
        (lambda m: m["body"].pop("max_pages"), "'max_pages' is missing"),
        (lambda m: m["body"].pop("int64"), "'int64' is missing"),
        (lambda m: m["body"].update(int32=m["body"]["int32"][:-4]), "input_ids.* holds 88 bytes, expected 92"),
        (lambda m: m["body"].update(int64=m["body"]["int64"] + b"\0" * 8), "'int64' .*slot_mapping.* holds 40"),
        (lambda m: m["body"].update(bool=None), "'bool' .*has_initial_state.* holds NoneType"),
        (lambda m: m["body"].update(num_tokens=5), "for 5 tokens"),
        (lambda m: m["body"].update(optional=[]), "'int32' .*holds 92 bytes, expected 84"),
        (lambda m: m["body"].update(int32=_with_starts(m, [0, 3, 4])), None),
        (lambda m: m["body"].update(int32=_with_starts(m, [0, 2, 2])), "query_start_loc"),
        (lambda m: m["body"].update(num_decode_rows=5), "num_decode_rows"),
    ],
)
def test_malformed_plans_are_rejected(edit, match):
    blob = _tamper(edit)
    if match is None:
        decode_plan(blob)  # a different but valid split
    else:
        with pytest.raises(WireError, match=match):
            decode_plan(blob)


def test_garbage_is_rejected():
    for blob in (b"", b"\xc1\xc1", b"not msgpack at all", msgpack.packb([1, 2, 3])):
        with pytest.raises(WireError):
            decode_plan(blob)


def test_out_of_range_indices_are_rejected():
    sizes = PoolSizes(num_blocks=16, block_size=4, num_slots=4)
    check_plan_ranges(make_plan(), sizes, vocab_size=320)
    for field, value in [
        ("state_slots", [0, 4]),
        ("block_tables", [[3, 2, 16], [4, 0, 0]]),
        ("slot_mapping", [41, 16, 17, 64]),
        ("input_ids", [5, 6, 7, 10**6]),
    ]:
        plan = make_plan()
        setattr(plan, field, np.array(value, dtype=getattr(plan, field).dtype))
        with pytest.raises(WireError, match=field):
            check_plan_ranges(plan, sizes, vocab_size=320)


def test_rejected_plan_leaves_running_requests_intact(tiny_checkpoints):
    """A bad plan sent between two passes changes nothing the running requests compute."""
    path = str(tiny_checkpoints["qwen3_5"][0])
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    (reference,) = LLM(path).generate([[5, 6, 7, 8, 9]], params, use_tqdm=False)
    engine = build_engine(EngineConfig.from_kwargs(model=path))
    engine.add_request("a", [5, 6, 7, 8, 9], params)
    engine.step()
    bad = make_plan()
    bad.state_slots = np.array([0, engine.slots.num_slots], np.int32)
    with pytest.raises(WireError, match="state_slots"):
        engine.executor.execute(bad)
    tokens = []
    while engine.has_unfinished():
        for out in engine.step():
            tokens = out.outputs[0].token_ids
    assert tokens == reference.outputs[0].token_ids


def test_rerun_codec_reports_failure_instead_of_raising():
    plan, out = make_plan(), RunnerOutput(3, ["a"], [17])
    assert rerun_codec(plan=plan, plan_blob=encode_plan(plan), output=out, output_blob=encode_output(out))
    assert not rerun_codec(plan_blob=b"not a plan")


def test_prefix_cache_tables_round_trip():
    plan = _plan_with_tables()
    back = decode_plan(encode_plan(plan))
    for name in ("slot_saves", "slot_restores", "page_copies", "captures"):
        assert np.array_equal(getattr(back, name), getattr(plan, name)), name


def _plan_with_tables() -> PassPlan:
    return PassPlan(
        pass_id=3,
        req_ids=["a", "b"],
        num_decode_rows=1,
        input_ids=np.array([5, 6, 7, 8], np.int32),
        positions=np.array([9, 0, 1, 2], np.int32),
        slot_mapping=np.array([9, 16, 17, 18], np.int64),
        query_start_loc=np.array([0, 1, 4], np.int32),
        seq_lens=np.array([10, 3], np.int32),
        block_tables=np.array([[0], [1]], np.int32),
        state_slots=np.array([0, 1], np.int32),
        has_initial_state=np.array([True, False]),
        sample_rows=np.array([True, True]),
        prompt_logprob_rows=np.array([False, False]),
        slot_saves=np.array([[2, 9]], np.int32),
        slot_restores=np.array([[10, 1], [11, 0]], np.int32),
        page_copies=np.array([[4, 1]], np.int32),
        captures=np.array([[1, 2, 12]], np.int32),
    )


def test_malformed_table_is_rejected():
    msg = msgpack.unpackb(encode_plan(_plan_with_tables()), raw=False)
    msg["body"]["tables"]["captures"][0] = 5
    with pytest.raises(WireError, match="captures"):
        decode_plan(msgpack.packb(msg, use_bin_type=True))
