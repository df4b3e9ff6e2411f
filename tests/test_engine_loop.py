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


def test_a_text_prompt_is_tokenized_once_off_the_loop_thread(tiny_chat_model):
    """submit tokenizes and checks a text prompt on the caller's thread; the loop thread queues the
    request it made without tokenizing again (a long prompt's tens of ms would hold every running
    request's next token). Same tokens as the engine's own path; n = 2 too."""
    import threading

    from deltaserve import LLM

    prompt = "A hybrid model keeps a recurrent state. " * 4
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    reference = LLM(str(tiny_chat_model))
    try:
        (want,) = reference.generate([prompt], params, use_tqdm=False)
    finally:
        reference.shutdown()
    outputs: queue.SimpleQueue = queue.SimpleQueue()
    loop = driver.EngineLoop(EngineConfig.from_kwargs(model=str(tiny_chat_model)), outputs.put)
    calls = []
    tokenize = loop.engine.tokenize

    def spy(text):
        calls.append(threading.current_thread().name)
        return tokenize(text)

    loop.engine.tokenize = spy
    try:
        assert loop.submit("one", prompt, params) == len(want.prompt_token_ids)
        assert loop.submit("two", prompt, SamplingParams(n=2, temperature=0, max_tokens=4, ignore_eos=True)) > 0
        finished = {}
        while len(finished) < 2:
            out = outputs.get(timeout=60)
            if out.finished:
                finished[out.request_id] = out
    finally:
        loop.stop()
    assert calls == [threading.current_thread().name] * 2  # once per submit, on the submitting thread
    assert finished["one"].outputs[0].token_ids == want.outputs[0].token_ids
    assert finished["one"].prompt == prompt and finished["one"].prompt_token_ids == want.prompt_token_ids
    assert [c.token_ids for c in finished["two"].outputs] == [want.outputs[0].token_ids] * 2
