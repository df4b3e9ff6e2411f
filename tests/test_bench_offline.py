"""The offline benchmark's expert counter (its memory floor counts the experts a step's routing
selected): it must see every MoE block of a pass, whatever form the decoder layer calls it in."""

from __future__ import annotations

import os

import pytest
from passes import Sequences

from deltaserve.bench.offline import ExpertCounter, in_place_cost
from deltaserve.layers.kernels.options import KernelOptions
from deltaserve.layers.loader import load_model
from deltaserve.layers.moe import SparseMoeBlock


def test_expert_counter_sees_every_moe_block(tiny_checkpoints):
    path, _ = tiny_checkpoints["qwen3_5_moe"]
    model = load_model(path)
    blocks = [m for m in model.modules() if isinstance(m, SparseMoeBlock)]
    assert blocks
    counter = ExpertCounter(model)
    counter.enabled = True
    seqs = Sequences(model)
    seqs.add("a")
    seqs.add("b")
    seqs.run([("a", [5, 9, 11, 4]), ("b", [7, 3])])  # six tokens
    assert len(counter.distinct) == len(blocks)  # one count per block and pass
    for block, distinct in zip(blocks, counter.distinct, strict=True):
        assert 1 <= distinct <= min(block.num_experts, 6 * block.top_k)
    counter.enabled = False
    seqs.run([("a", [1])])
    assert len(counter.distinct) == len(blocks)  # disabled: nothing counted


def test_decode_batch_stays_whole_through_the_timed_steps(tiny_checkpoints, monkeypatch):
    """With a token budget far below the batch's prompts the first requests decode beside the later
    prefill chunks; the requests may take as many tokens as fit and are aborted after the timing, so
    every timed step runs the whole batch (before: the first requests finished mid-timing and the
    batch shrank; with a per-request budget estimated from the passes, still at 16 x 64 tokens over
    32-token passes, whose decode rows take part of each pass)."""
    from deltaserve import LLM
    from deltaserve.bench import offline

    monkeypatch.setattr(offline.torch.cuda, "synchronize", lambda *a, **k: None)  # CPU run
    path, _ = tiny_checkpoints["qwen3_5_moe"]
    llm = LLM(str(path), max_num_seqs=8, max_num_batched_tokens=32)
    result = offline.bench_decode(llm, batch=6, context=64, steps=3, counter=None, vocab=100)
    assert result["step_s"] > 0
    assert not llm.engine.has_unfinished()
    # a variant times the same batch again: its requests are new ones; no graphs on CPU to recapture
    runner = llm.engine.executor.runner
    runner.set_kernel_options(runner.kernels.with_settings({"pdl": "0"}))
    assert runner.kernels.pdl is False and runner.sampler.pdl is False
    again = offline.bench_decode(llm, batch=6, context=64, steps=3, counter=None, vocab=100, tag="b")
    assert again["step_s"] > 0 and not llm.engine.has_unfinished()
    wide = LLM(str(path), max_num_seqs=16, max_num_batched_tokens=32)
    result = offline.bench_decode(wide, batch=16, context=64, steps=1, counter=None, vocab=100)
    assert result["step_s"] > 0 and not wide.engine.has_unfinished()


def test_in_place_cost_attributes_each_op_its_end_minus_the_previous_end():
    """Overlapping kernels (programmatic dependent launch: b starts while a runs and waits) count
    only past the previous end; after an idle gap an op counts its own duration; the total is the
    busy time of the timeline (here 0-10 and 12-15: 13)."""
    ops = [(0.0, 4.0, "a"), (1.0, 6.0, "b"), (5.0, 10.0, "a"), (12.0, 15.0, "c")]
    cost = in_place_cost(ops)
    assert cost == {"a": (4.0 + 4.0, 2), "b": (2.0, 1), "c": (3.0, 1)}
    assert sum(us for us, _ in cost.values()) == 13.0
    # an op that ends first takes the time since the cluster began; the total is still the union
    nested = in_place_cost([(0.0, 10.0, "long"), (2.0, 3.0, "inside")])
    assert nested == {"inside": (3.0, 1), "long": (7.0, 1)}


def test_variants_parse_into_kernel_options_and_leave_the_environment_alone(monkeypatch):
    from deltaserve.bench.offline import parse_variants

    assert parse_variants(None) == [("", {})]
    spec = "base:;nopdl:pdl=0;both:pdl=0, row_gemv=0;tiles:row_tiles=2048x4096:16x8+1288x2048:8x4"
    variants = parse_variants(spec)
    assert variants == [
        ("base", {}),
        ("nopdl", {"pdl": "0"}),
        ("both", {"pdl": "0", "row_gemv": "0"}),
        ("tiles", {"row_tiles": "2048x4096:16x8+1288x2048:8x4"}),
    ]
    base = KernelOptions()
    assert base.with_settings(variants[2][1]) == KernelOptions(pdl=False, row_gemv=False)
    tiles = base.with_settings(variants[3][1]).row_tiles
    assert [(t.n, t.k, t.block_n, t.num_warps) for t in tiles] == [(2048, 4096, 16, 8), (1288, 2048, 8, 4)]
    bad_cases = (
        ("x:PDL", "NAME=VALUE"),
        (":pdl=1", "no label"),
        ("a:;a:pdl=1", "labels must differ"),
        ("a:DELTASERVE_PDL=0", "not a kernel option"),
        ("a:fused_gdn_max_seqs=x", "fused_gdn_max_seqs"),
        ("a:row_tiles=1x2", "row_tiles"),
    )
    for bad, field in bad_cases:
        with pytest.raises(ValueError, match=field):
            parse_variants(bad)
    before = dict(os.environ)
    parse_variants(spec)
    assert dict(os.environ) == before


def test_prefills_time_the_graphed_pass_and_its_eager_twin(tiny_checkpoints, monkeypatch):
    """--prefill-eager-too: a prompt that replays a prefill graph is timed again with the graphs set
    aside (eager), which runs no graph; a prompt over the largest bucket is eager and timed once."""
    import argparse

    from deltaserve import LLM
    from deltaserve.bench import offline

    monkeypatch.setattr(offline.torch.cuda, "synchronize", lambda *a, **k: None)  # CPU run
    path, _ = tiny_checkpoints["qwen3_5_moe"]
    llm = LLM(str(path), max_num_seqs=2, max_num_batched_tokens=96, num_kv_blocks=64, prefill_graph_max_tokens=64)
    runner = llm.engine.executor.runner
    runner.prefill_graphs = graphs = runner._capture_prefill_graphs(capture=False)  # the static forward
    args = argparse.Namespace(profile_prefills=[], prefill_eager_too=True)
    rows = offline.time_prefills(llm, [40, 90], vocab=100, args=args)
    assert [(r["tokens"], r["graphed"], "eager_seconds" in r) for r in rows] == [(40, True, True), (90, False, False)]
    assert graphs.replays == 3  # the graphed length's three timed prompts; none of its eager twin's
    assert runner.prefill_graphs is graphs
    assert all("gpu_busy_s" not in r for r in rows)  # no CUDA events on the CPU
    # with pass times (CUDA events on a GPU: faked here, 1 ms a pass), a row carries its passes' busy time
    engine, step = llm.engine, llm.engine.step

    def timed_step():
        out = step()
        engine.pass_device_times.append((1e-3, 0.0))
        return out

    monkeypatch.setattr(engine, "step", timed_step)
    args.prefill_eager_too = False
    (row,) = offline.time_prefills(llm, [90], vocab=100, args=args)
    assert row["gpu_busy_s"] > 0 and abs(row["gpu_busy_s"] / 1e-3 - round(row["gpu_busy_s"] / 1e-3)) < 1e-9
    # and the host's time before the first pass launched: some, and less than the prompt's wall time
    assert 0 < row["host_before_s"] < row["seconds"]
    assert "execute_async" not in vars(engine.executor)  # the timing hook is gone
