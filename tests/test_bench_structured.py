"""The structured-output benchmark runs end to end on CPU at tiny shapes (the GPU run is the lead's):
both decode modes keep the batch whole, and the compile report has each figure."""

from __future__ import annotations

import argparse

from deltaserve.bench import offline, structured
from deltaserve.cluster.entrypoints.demo_model import ensure_demo_model


def test_bench_structured_runs_on_the_demo_model(monkeypatch, tmp_path):
    monkeypatch.setattr(offline.torch.cuda, "synchronize", lambda *a, **k: None)  # CPU run
    args = argparse.Namespace(
        model=str(ensure_demo_model()), preset=None, load_format="auto", device="cpu", batch_sizes="1,3",
        context=8, steps=2, fields=12, json=None,
    )  # fmt: skip
    report = structured.run(args)
    compile_report = report["large_schema"]
    assert compile_report["compile_s"] > 0 and compile_report["fill_batch_64_rows_ms"] > 0
    assert [r["batch"] for r in report["decode"]] == [1, 3]
    assert all(r["free_ms"] > 0 and r["json_ms"] > 0 for r in report["decode"])
