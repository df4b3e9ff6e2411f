"""The Python serving API in vLLM's shapes: AsyncEngine.generate (AsyncLLM's `async for out in
engine.generate(prompt, params, request_id)`) streams cumulative, delta or final outputs whose last
one equals LLM.generate's; leaving the loop aborts the request; logprobs are {token id: Logprob}
dicts with the chosen token first; and the metrics export the engine's counters under vLLM's names
(speculative decoding's included, from a speculating engine)."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
from logprob_checks import assert_entries_close
from prometheus_client.parser import text_string_to_metric_families

from deltaserve import LLM, SamplingParams
from deltaserve.cluster.config import EngineConfig
from deltaserve.cluster.core.request import Logprob, top_logprobs
from deltaserve.cluster.core.sampling_params import RequestOutputKind
from deltaserve.cluster.entrypoints.async_engine import AsyncEngine, _added_up
from deltaserve.cluster.entrypoints.metrics import ServingMetrics

pytestmark = pytest.mark.timeout(120)

PARAMS = dict(temperature=0, max_tokens=7, ignore_eos=True, logprobs=2)


@pytest.fixture(scope="module")
def reference(tiny_chat_model):
    llm = LLM(str(tiny_chat_model))
    yield llm
    llm.shutdown()


def run(tiny_chat_model, body, **settings):
    async def main():
        engine = await AsyncEngine.local(EngineConfig.from_kwargs(model=str(tiny_chat_model), **settings))
        try:
            return await body(engine)
        finally:
            await engine.shutdown()

    return asyncio.run(main())


def test_generate_streams_vllm_shaped_outputs(tiny_chat_model, reference):
    (want,) = reference.generate(["hello world"], SamplingParams(**PARAMS), use_tqdm=False)
    want_completion = want.outputs[0]

    async def body(engine: AsyncEngine):
        seen = {}
        for kind in RequestOutputKind:
            params = SamplingParams(**PARAMS, output_kind=kind)
            seen[kind] = [out async for out in engine.generate("hello world", params, f"req-{kind.name}")]
        return seen

    seen = run(tiny_chat_model, body)
    cumulative, delta, final = (seen[k] for k in RequestOutputKind)
    # cumulative: each output holds the whole completion so far, growing to the final one
    lengths = [len(o.outputs[0].token_ids) for o in cumulative]
    assert lengths == sorted(lengths) and lengths[-1] == 7 and len(cumulative) >= 2
    for out in cumulative:
        c = out.outputs[0]
        assert c.token_ids == want_completion.token_ids[: len(c.token_ids)]
        assert want_completion.text.startswith(c.text)
        assert_entries_close(c.logprobs, want_completion.logprobs[: len(c.token_ids)])
        assert c.cumulative_logprob == pytest.approx(sum(next(iter(e.values())).logprob for e in c.logprobs))
    assert [o.finished for o in cumulative] == [False] * (len(cumulative) - 1) + [True]
    # delta: each output holds only what its step added; together they are the completion
    assert sum((o.outputs[0].token_ids for o in delta), []) == want_completion.token_ids
    assert "".join(o.outputs[0].text for o in delta) == want_completion.text
    assert delta[-1].outputs[0].finish_reason == "length"
    # final only: one output, equal to LLM.generate's
    (last,) = final
    c = last.outputs[0]
    assert (c.token_ids, c.text, c.finish_reason) == (want_completion.token_ids, want_completion.text, "length")
    assert_entries_close(c.logprobs, want_completion.logprobs)
    assert last.metrics.first_scheduled_time >= last.metrics.arrival_time
    assert last.metrics.finished_time >= last.metrics.first_token_time


def test_leaving_generate_aborts_and_bad_input_raises(tiny_chat_model):
    async def body(engine: AsyncEngine):
        params = SamplingParams(temperature=0, max_tokens=300, ignore_eos=True)
        async for out in engine.generate("hello", params, "long"):
            if len(out.outputs[0].token_ids) >= 2:
                break
        for _ in range(100):
            stats = await engine.stats()
            if stats["running"] == 0 and stats["free_slots"] == stats["total_slots"]:
                break
            await asyncio.sleep(0.02)
        with pytest.raises(ValueError, match="^temperature: "):
            SamplingParams(temperature=-1)
        with pytest.raises(ValueError, match="^max_tokens: "):
            async for _ in engine.generate("hello", SamplingParams(max_tokens=10**6), "too-long"):
                pass
        return stats

    stats = run(tiny_chat_model, body)
    assert (stats["running"], stats["waiting"], stats["free_pages"]) == (0, 0, stats["total_pages"])


def test_top_logprobs_put_the_chosen_token_back_in_its_rank():
    # the chosen token (rank 2) is one of the top 3: it appears once, first, and goes back to place 2
    entry = {7: Logprob(-1.2, 2, "b"), 5: Logprob(-0.5, 1, "a"), 9: Logprob(-2.0, 3, "c")}
    assert [t for t, _ in top_logprobs(entry, 3)] == [5, 7, 9]
    # outside the top 2 it stays out of them
    entry = {4: Logprob(-3.0, 6, "z"), 5: Logprob(-0.5, 1, "a"), 7: Logprob(-1.2, 2, "b")}
    assert [t for t, _ in top_logprobs(entry, 2)] == [5, 7]
    assert top_logprobs(entry, 0) == []


def test_engine_metrics_use_vllm_names_and_take_spec_decode_counters():
    metrics = ServingMetrics("m")
    stats = {
        "running": 3,
        "waiting": 2,
        "free_pages": 30,
        "total_pages": 40,
        "free_slots": 5,
        "total_slots": 8,
        "preemptions": 4,
        "passes": 99,
        "prefix_cache": {"enabled": True, "query_tokens": 100, "hit_tokens": 60, "snapshots_held": 2},
        "spec_decode": {"enabled": False},  # what EngineCore.speculative_stats() says without speculation
    }
    metrics.update_engine(stats)
    values = parse(metrics.render())
    assert values["vllm:num_requests_running"] == 3 and values["vllm:num_requests_waiting"] == 2
    assert values["vllm:kv_cache_usage_perc"] == pytest.approx(0.25)
    assert values["vllm:num_preemptions_total"] == 4
    assert (values["vllm:prefix_cache_queries_total"], values["vllm:prefix_cache_hits_total"]) == (100, 60)
    assert values["deltaserve:gdn_state_slots_used"] == 3
    assert not any(name.startswith("vllm:spec_decode") for name in values)
    metrics.update_engine(
        {**stats, "spec_decode": {"num_drafts": 10, "num_draft_tokens": 30, "num_accepted_tokens": 21}}
    )
    values = parse(metrics.render())
    assert values["vllm:spec_decode_num_drafts_total"] == 10
    assert values["vllm:spec_decode_num_draft_tokens_total"] == 30
    assert values["vllm:spec_decode_num_accepted_tokens_total"] == 21


def test_replica_stats_add_up_for_the_metrics():
    """Two replicas' stats as one: counts (nested ones, per-position lists) summed, ratios left out."""
    one = {
        "running": 2,
        "free_pages": 10,
        "prefix_cache": {"enabled": True, "hit_tokens": 5, "query_tokens": 20, "hit_rate": 0.25},
        "spec_decode": {"enabled": True, "method": "mtp", "num_drafts": 4, "accepted_per_position": [3, 1]},
    }
    two = {
        "running": 1,
        "free_pages": 30,
        "prefix_cache": {"enabled": False},
        "spec_decode": {"enabled": True, "method": "mtp", "num_drafts": 6, "accepted_per_position": [5, 2]},
    }
    assert _added_up([one, two]) == {
        "running": 3,
        "free_pages": 40,
        "prefix_cache": {"enabled": True},
        "spec_decode": {"enabled": True, "method": "mtp", "num_drafts": 10, "accepted_per_position": [8, 3]},
    }


def test_a_speculating_engine_exports_its_acceptance_counters(tiny_chat_model):
    """The MTP head's counters (EngineCore.speculative_stats) reach /metrics under vLLM's names."""

    async def body(engine):
        params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
        async for _ in engine.generate("hello world", params, "spec"):
            pass
        return (await engine.stats())["spec_decode"], (await engine.render_metrics()).decode()

    spec = {"method": "mtp", "num_speculative_tokens": 2}
    stats, text = run(tiny_chat_model, body, speculative_config=spec, enable_prefix_caching=False)
    assert stats["enabled"] and stats["num_drafts"] > 0
    samples = [sample for family in text_string_to_metric_families(text) for sample in family.samples]
    value = {s.name: s.value for s in samples if "position" not in s.labels}
    assert value["vllm:spec_decode_num_drafts_total"] == stats["num_drafts"]
    assert value["vllm:spec_decode_num_draft_tokens_total"] == stats["num_draft_tokens"] == 2 * stats["num_drafts"]
    assert value["vllm:spec_decode_num_accepted_tokens_total"] == stats["num_accepted_tokens"]
    per_position = {
        int(s.labels["position"]): s.value
        for s in samples
        if s.name == "vllm:spec_decode_num_accepted_tokens_per_pos_total"
    }
    assert per_position == dict(enumerate(stats["accepted_per_position"]))
    assert sum(per_position.values()) == stats["num_accepted_tokens"]


def parse(text: bytes) -> dict[str, float]:
    return {
        sample.name: sample.value
        for family in text_string_to_metric_families(text.decode())
        for sample in family.samples
        if not sample.labels.get("le") and "finished_reason" not in sample.labels and "reason" not in sample.labels
    }


def test_the_front_doors_tokenizer_is_loaded_when_the_engine_starts(tiny_chat_model, monkeypatch):
    """The gateway's own tokenizer (decode for the Responses API and echo, the router's text prompts) is
    loaded on a thread during the start, so a request's first decode does not load it on the event loop
    (the real vocabulary's tokenizer.json takes seconds, holding every stream and health poll)."""
    from deltaserve.cluster.entrypoints import async_engine

    loaded_on = []
    tokenizer_class = async_engine.AsyncEngine._local_tokenizer

    def spy(self):
        loaded_on.append(threading.current_thread() is threading.main_thread())
        return tokenizer_class(self)

    monkeypatch.setattr(async_engine.AsyncEngine, "_local_tokenizer", spy)

    async def body(engine: AsyncEngine):
        assert engine._tokenizer is not None  # there before any request
        return engine.decode([5, 6])

    assert isinstance(run(tiny_chat_model, body), str)
    assert loaded_on[0] is False  # the start's load: off the event loop's thread


def test_a_text_prompt_is_submitted_off_the_event_loop(tiny_chat_model, reference, monkeypatch):
    """The local replica tokenizes and checks a text prompt on a thread (tens of ms for a long one, which
    the event loop's other streams would wait for): the same tokens; a submit cancelled while its thread
    runs aborts the request once queued (nothing left running)."""
    from deltaserve.cluster.entrypoints import driver

    (want,) = reference.generate(["hello world"], SamplingParams(**PARAMS), use_tqdm=False)
    threads = []
    submit = driver.EngineLoop.submit

    def spy(self, req_id, prompt, *args):
        threads.append(threading.current_thread() is threading.main_thread())
        if req_id == "slow":
            time.sleep(0.3)  # the thread is still tokenizing when the caller gives up
        return submit(self, req_id, prompt, *args)

    monkeypatch.setattr(driver.EngineLoop, "submit", spy)
    aborted = []
    abort = driver.EngineLoop.abort

    def abort_spy(self, req_id):
        aborted.append(req_id)
        return abort(self, req_id)

    monkeypatch.setattr(driver.EngineLoop, "abort", abort_spy)

    async def body(engine: AsyncEngine):
        got = [out async for out in engine.generate("hello world", SamplingParams(**PARAMS), "text")]
        forever = SamplingParams(max_tokens=None, ignore_eos=True)  # as many as fit: longer than the wait below
        task = asyncio.ensure_future(engine.submit("slow", "hello world", forever))
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        loop_engine = engine._replicas[0].loop_engine
        for _ in range(200):  # the thread queues it (0.3 s), then the abort follows through the loop's inbox
            await asyncio.sleep(0.02)
            if aborted and not loop_engine.engine.has_unfinished() and "slow" not in loop_engine._live:
                break
        return got, loop_engine.engine.has_unfinished(), "slow" in loop_engine._live

    got, unfinished, live = run(tiny_chat_model, body)
    assert got[-1].outputs[0].token_ids == want.outputs[0].token_ids
    assert threads == [False, False]  # both submits on a thread, not the event loop's
    assert not unfinished and not live
    assert aborted == ["slow"]  # by the cancelled submit, once its thread had queued it
