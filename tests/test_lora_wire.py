"""The LoRA fields of a pass plan: they survive the wire, and slots outside the rank's adapter slots
(or naming no adapter) are rejected naming the field before anything runs."""

from __future__ import annotations

import numpy as np
import pytest

from deltaserve.layers.base import MoeLoraRoute
from deltaserve.workers.lora import AdapterSlots
from deltaserve.workers.plan import LoraLoad, PassPlan, PoolSizes
from deltaserve.workers.wire import WireError, check_plan_ranges, decode_plan, encode_plan


def plan(**lora) -> PassPlan:
    return PassPlan(
        pass_id=0, req_ids=["a", "b"], num_decode_rows=0, input_ids=np.array([1, 2, 3], np.int32),
        positions=np.array([0, 1, 0], np.int32), slot_mapping=np.array([0, 1, 16], np.int64),
        query_start_loc=np.array([0, 2, 3], np.int32), seq_lens=np.array([2, 1], np.int32),
        block_tables=np.array([[0], [1]], np.int32), state_slots=np.array([0, 1], np.int32),
        has_initial_state=np.zeros(2, bool), sample_rows=np.ones(2, bool), prompt_logprob_rows=np.zeros(2, bool),
        **lora,
    )  # fmt: skip


def test_lora_fields_round_trip():
    sent = plan(lora_slots=np.array([1, -1], np.int32), lora_loads=[LoraLoad(1, 7, "sql", "/adapters/sql")])
    got = decode_plan(encode_plan(sent))
    assert got.lora_slots.tolist() == [1, -1]
    assert got.lora_loads == sent.lora_loads
    assert decode_plan(encode_plan(plan())).lora_slots is None


def test_lora_slots_outside_the_ranks_slots_are_rejected():
    sizes = PoolSizes(num_blocks=4, block_size=16, num_slots=3)
    with pytest.raises(WireError, match="lora_slots"):
        check_plan_ranges(plan(lora_slots=np.array([2, -1], np.int32)), sizes, 10, num_lora_slots=2)
    with pytest.raises(WireError, match="lora_loads"):
        check_plan_ranges(plan(lora_loads=[LoraLoad(2, 1, "x", "/x")]), sizes, 10, num_lora_slots=2)
    with pytest.raises(WireError, match="lora_slots"):  # an engine without LoRA has no slots
        check_plan_ranges(plan(lora_slots=np.array([0, 0], np.int32)), sizes, 10)
    check_plan_ranges(plan(lora_slots=np.array([1, -1], np.int32)), sizes, 10, num_lora_slots=2)


def test_a_row_naming_an_empty_slot_is_an_error():
    slots = AdapterSlots.__new__(AdapterSlots)
    slots.held, slots.has_experts = [None, LoraLoad(1, 1, "x", "/x")], [False, True]
    assert slots.route(None) is MoeLoraRoute.SKIP
    assert slots.route(np.array([1, -1])) is MoeLoraRoute.FOLD
    with pytest.raises(WireError, match="slot 0"):
        slots.route(np.array([0, 1]))
