"""`deltaserve bench spec` on a tiny checkpoint (CPU): the report's pass timings exist for every batch
and k, and the per-token runs decode with the drafts they were given (agreement 1.0: every draft
accepted, k + 1 tokens a row each step)."""

from __future__ import annotations

import argparse

from deltaserve.bench.spec import add_parser, run


def test_bench_spec_reports(tiny_checkpoints):
    path, _ = tiny_checkpoints["qwen3_5"]
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers())
    args = parser.parse_args(
        ["spec", "--model", str(path), "--load-format", "auto", "--ks", "1,3", "--batches", "2", "--k", "2",
         "--token-batches", "2", "--agreements", "1.0", "--context", "9", "--steps", "3", "--repeats", "1"]
    )  # fmt: skip
    report = run(args)
    (row,) = report["passes"]
    assert row["batch"] == 2 and row["k1"]["verify_ms"] > 0 and row["k3"]["draft_ms"] > 0
    # floors in bytes (no bandwidth on the CPU, so no times)
    assert row["k3"]["floor"]["bytes"]["drafts"] > row["k1"]["floor"]["bytes"]["drafts"] > 0
    assert row["decode_floor"]["bytes"]["drafts"] == 0 and "ms" not in row["k1"]["floor"]
    assert report["goal"]["k"] == 2 and report["goal"]["floor"]["bytes"]["total"] > 0
    head, full = report["tokens"]["2"]
    assert head["agreement"] is None and head["tokens_per_row_step"] >= 1
    assert full["acceptance"] == 1.0 and full["tokens_per_row_step"] == 3.0


def test_spec_floor_bytes():
    """The floor of a speculative step: k = 0 is bench offline's decode floor of one token (top_k
    distinct experts a layer); each draft adds the head's passes (the lm_head each) and the verify's
    experts grow as random routing says, never past every expert."""
    import dataclasses

    from deltaserve.bench.offline import decode_floor_bytes, weight_bytes
    from deltaserve.bench.presets import preset_config
    from deltaserve.bench.spec import expected_distinct_experts, goal_floor, spec_floor_bytes, tokens_per_step

    c = dataclasses.replace(preset_config("qwen3_5_35b_a3b"), num_mtp_layers=1)
    moe_layers = sum(t == "moe" for t in c.mlp_types)
    assert expected_distinct_experts(256, 8, 1) == 8
    assert 31 > expected_distinct_experts(256, 8, 4) > 30 and expected_distinct_experts(256, 8, 10_000) <= 256
    plain = spec_floor_bytes(c, 1, 0, 512)
    assert plain["drafts"] == 0
    assert abs(plain["total"] - decode_floor_bytes(c, 1, 513, moe_layers * 8)["total"]) < 1
    lm_head = c.vocab_size * c.hidden_size * 2
    _, expert = weight_bytes(c, 2)
    k1, k3 = spec_floor_bytes(c, 1, 1, 512), spec_floor_bytes(c, 1, 3, 512)
    assert k3["drafts"] > 3 * lm_head and k1["drafts"] > lm_head and k3["drafts"] < 3 * (lm_head + 0.2e9)
    assert k3["verify_experts"] == moe_layers * expected_distinct_experts(256, 8, 4) * expert
    assert abs(tokens_per_step(0.8, 3) - 2.952) < 1e-9 and tokens_per_step(1.0, 3) == 4
    goal = goal_floor(c, 3, 512, bandwidth=4e12)
    assert goal["goal_step_ms"] == tokens_per_step(0.8, 3) * 1.0
    assert goal["floor"]["ms"] == k3["total"] / 4e12 * 1e3
    assert "floor" in goal["line"] and "ms" not in goal_floor(c, 3, 512, None)["floor"]


def test_decisive_model_decodes_the_successor_chain(tiny_checkpoints):
    """make_decisive: greedy output is the seeded successor of the last token, step after step, with
    and without speculation (the head's own drafts); a tied lm_head is refused."""
    import pytest

    from deltaserve import LLM, SamplingParams
    from deltaserve.bench.spec_drafts import decisive_successor, make_decisive

    path, _ = tiny_checkpoints["qwen3_5_moe"]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompts = [[5, 9, 31], [77, 3]]
    for spec in (None, {"method": "mtp", "num_speculative_tokens": 3}):
        llm = LLM(str(path), max_num_seqs=4, speculative_config=spec)
        model = llm.engine.executor.runner.model
        make_decisive(model, seed=4)
        successor = decisive_successor(model.config.vocab_size, seed=4)
        for prompt, out in zip(prompts, llm.generate(prompts, params, use_tqdm=False), strict=True):
            tokens = [prompt[-1], *out.outputs[0].token_ids]
            assert all(int(successor[a]) == b for a, b in zip(tokens[:-1], tokens[1:], strict=True)), tokens
        llm.shutdown()
    tied = LLM(str(tiny_checkpoints["qwen3_5"][0]), max_num_seqs=2)
    with pytest.raises(ValueError, match="lm_head"):
        make_decisive(tied.engine.executor.runner.model)
    tied.shutdown()
