"""The serving engine loop: requests submitted from other threads run to completion, and a step
slower than SLOW_STEP_S is logged with what the engine held (how a first-use kernel compile shows)."""

from __future__ import annotations

import logging
import queue

from deltaserve import SamplingParams
from deltaserve.cluster.config import EngineConfig
from deltaserve.cluster.entrypoints import driver


def test_loop_runs_submitted_requests_and_logs_slow_steps(tiny_checkpoints, monkeypatch, caplog):
    monkeypatch.setattr(driver, "SLOW_STEP_S", 0.0)  # every step counts as slow
    outputs: queue.SimpleQueue = queue.SimpleQueue()
    loop = driver.EngineLoop(EngineConfig.from_kwargs(model=str(tiny_checkpoints["qwen3_5"][0])), outputs.put)
    try:
        with caplog.at_level(logging.WARNING, logger=driver.__name__):
            assert loop.submit("a", [5, 6, 7], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)) == 3
            tokens = []
            while True:
                out = outputs.get(timeout=60)
                tokens += out.outputs[0].token_ids
                if out.finished:
                    break
    finally:
        loop.stop()
    assert len(tokens) == 3
    assert any("slow engine step" in r.getMessage() and "running" in r.getMessage() for r in caplog.records)
