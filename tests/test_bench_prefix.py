"""The prefix benchmark's host timeline of a hit: every stage timed, the hit a real one, and the
engine left as it was (the timing wrappers removed)."""

from __future__ import annotations

import torch

from deltaserve import LLM
from deltaserve.bench.prefix import host_timeline


def test_host_timeline_times_a_real_hit_and_unwraps(tiny_checkpoints, monkeypatch):
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)  # the CPU run has no stream
    path, _ = tiny_checkpoints["qwen3_5_moe"]
    llm = LLM(str(path), max_model_len=200, prefix_snapshot_interval=32)
    engine = llm.engine
    runner = engine.executor.runner
    ms = host_timeline(llm, shared=128, new=9, vocab=engine.model_config.vocab_size)
    for stage in ("add_request", "schedule", "lookup", "forward launches", "gdn mix", "attention mix", "mlp"):
        assert ms[stage] > 0, stage
    assert ms["lookup"] <= ms["schedule"] and ms["forward launches"] <= ms["execute_async"] <= ms["wall"]
    assert engine.prefix_cache_stats()["hit_tokens"] >= 128  # the timed request did skip its prefix
    # the wrappers were instance attributes: none is left behind
    assert "make_request" not in vars(engine) and "_forward" not in vars(runner)
    assert all("mix" not in vars(layer.mixer) for layer in runner.model.layers)
