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
    head, full = report["tokens"]["2"]
    assert head["agreement"] is None and head["tokens_per_row_step"] >= 1
    assert full["acceptance"] == 1.0 and full["tokens_per_row_step"] == 3.0
