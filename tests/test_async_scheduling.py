"""Async scheduling (the engine plans and launches pass N+1 before pass N's tokens are back) gives
the synchronous engine's outputs: tokens, text, finish and stop reasons, logprobs and prompt
logprobs, over a mixed batch with chunked prefill, stop ids and strings, max_tokens=1, seeded
sampling, penalties, min_tokens, an abort mid-generation and forced preemption; every page and slot
is free at the end. Also: the device-side input ids are really used, a request id reused while a
pass is in flight, a worker failure, the plan field on the wire, and penalties with a token still on
the device.

Where no request ends early (no stop, EOS or abort) both engines run the very same passes and every
output is bit-identical. A request that a stop ends at pass N still has a row in pass N+1 under
async scheduling (its token is discarded), so later passes batch different rows; the CPU float32
kernels round differently per batch shape, so logprob values then agree to ~1e-6, not bit for bit
(the same holds for the synchronous engine under different batch mixes).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from logprob_checks import assert_entries_close
from tiny_models import FAMILIES, VOCAB_SIZE

from deltaserve import SamplingParams
from deltaserve.cluster.config import EngineConfig
from deltaserve.cluster.core.engine import EngineCore
from deltaserve.cluster.core.scheduler import Scheduler
from deltaserve.cluster.entrypoints.startup import build_engine
from deltaserve.cluster.executors.base import WorkerFailure
from deltaserve.cluster.executors.local import LocalExecutor
from deltaserve.layers.config import ModelConfig
from deltaserve.workers.plan import NewRequestData, SamplingSpec
from deltaserve.workers.sampler import Sampler
from deltaserve.workers.wire import WireError, decode_plan, encode_plan

LENGTHS = [1, 3, 7, 12, 20, 33, 50, 65]
ABORTED = 7  # the request aborted once it has ABORT_AFTER tokens
ABORT_AFTER = 3

CONFIGS = {
    "whole": dict(max_num_batched_tokens=2048),
    "chunked": dict(max_num_batched_tokens=7),
    # 5 usable pages of 16 tokens: far less than the batch needs, enough for the longest alone
    "preempt": dict(block_size=16, max_num_batched_tokens=32, num_kv_blocks=6),
}


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(17)
    return [torch.randint(3, VOCAB_SIZE, (n,), generator=g).tolist() for n in LENGTHS]


def engine(path, async_scheduling: bool, **kw) -> EngineCore:
    config = EngineConfig.from_kwargs(model=str(path), max_num_seqs=8, async_scheduling=async_scheduling, **kw)
    core = build_engine(config, output_mode="delta")
    assert core.async_scheduling is async_scheduling
    return core


def run(core: EngineCore, requests: list[tuple[str, list[int], SamplingParams]], abort: str | None = None):
    """Every request to its end; `abort` is aborted once it holds ABORT_AFTER tokens."""
    for req_id, prompt, params in requests:
        core.add_request(req_id, prompt, params)
    final = {}
    while core.has_unfinished():
        for out in core.step():
            if out.finished:
                final[out.request_id] = out
        req = core.scheduler.requests.get(abort) if abort else None
        if req is not None and len(req.output_token_ids) >= ABORT_AFTER:
            final[abort] = core.abort(abort)
    assert len(final) == len(requests)
    return [final[r] for r, _, _ in requests]


def summary(out) -> dict:
    c = out.outputs[0]
    return dict(
        token_ids=list(c.token_ids),
        text=c.text,
        logprobs=c.logprobs,
        prompt_logprobs=out.prompt_logprobs,
        finish_reason=c.finish_reason,
        stop_reason=c.stop_reason,
    )


def assert_same(sync: list[dict], asyn: list[dict], exact: bool, atol: float = 1e-5) -> None:
    """Equal outputs; logprob values bit-identical when `exact`, else within `atol` (float32 rounding)."""
    for i, (a, b) in enumerate(zip(sync, asyn, strict=True)):
        if exact:
            assert a == b, (i, a, b)
            continue
        plain = ("token_ids", "text", "finish_reason", "stop_reason")
        assert {k: a[k] for k in plain} == {k: b[k] for k in plain}, (i, a, b)
        for key in ("logprobs", "prompt_logprobs"):
            assert (a[key] is None) == (b[key] is None), (i, key)
            assert_entries_close(a[key] or [], b[key] or [], atol=atol, where=(i, key))


def assert_pools_full(core: EngineCore) -> None:
    assert not core.has_unfinished()
    assert core.blocks.num_free == core.blocks.capacity
    assert core.slots.num_free == core.slots.capacity
    assert not core.scheduler._rows_in_flight
    runner = core.executor.runner
    assert not runner._unresolved


@pytest.fixture(scope="module", params=FAMILIES)
def mixed(request, tiny_checkpoints):
    """A family's checkpoint and its mixed batch; stop ids and strings picked from a free run so that
    they fire mid-generation."""
    path = tiny_checkpoints[request.param][0]
    ps = prompts()
    free = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    ref = run(engine(path, False), [("s3", ps[3], free), ("s4", ps[4], free)])
    stop_id = ref[0].outputs[0].token_ids[3]
    text = ref[1].outputs[0].text
    assert len(text) >= 6, text
    stop_str = text[2:4]
    params = [
        SamplingParams(temperature=0, max_tokens=12),
        SamplingParams(temperature=0, max_tokens=1, logprobs=3, prompt_logprobs=2),
        SamplingParams(temperature=1.0, top_p=0.9, top_k=40, seed=7, max_tokens=10, ignore_eos=True, logprobs=1),
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop_token_ids=[stop_id]),
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop=[stop_str]),
        SamplingParams(
            temperature=0.8,
            seed=3,
            repetition_penalty=1.5,
            presence_penalty=0.7,
            frequency_penalty=0.3,
            max_tokens=12,
            ignore_eos=True,
            logprobs=2,
        ),
        SamplingParams(temperature=0, repetition_penalty=1.3, frequency_penalty=0.5, min_tokens=5, max_tokens=10),
        SamplingParams(temperature=0, max_tokens=14, ignore_eos=True),
    ]
    requests = [(f"r{i}", p, sp) for i, (p, sp) in enumerate(zip(ps, params, strict=True))]
    return path, requests, stop_id, stop_str


@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_async_gives_the_synchronous_outputs(mixed, config):
    path, requests, stop_id, stop_str = mixed
    results = {}
    for mode in (False, True):
        core = engine(path, mode, **CONFIGS[config])
        results[mode] = [summary(o) for o in run(core, requests, abort=f"r{ABORTED}")]
        assert_pools_full(core)
        if config == "preempt":
            assert core.scheduler.stats.num_preemptions > 0
        if mode:
            # tokens of requests that a stop ended while the next pass ran were computed and dropped
            assert core.scheduler.stats.num_discarded_tokens > 0
        else:
            assert core.scheduler.stats.num_discarded_tokens == 0
    sync, asyn = results[False], results[True]
    assert_same(sync, asyn, exact=False)
    by_id = dict(zip([r for r, _, _ in requests], sync, strict=True))
    assert by_id["r1"]["finish_reason"] == "length" and len(by_id["r1"]["token_ids"]) == 1
    assert len(by_id["r1"]["prompt_logprobs"]) == LENGTHS[1]
    assert by_id["r3"]["finish_reason"] == "stop" and by_id["r3"]["stop_reason"] == stop_id
    assert by_id["r4"]["finish_reason"] == "stop" and by_id["r4"]["stop_reason"] == stop_str
    assert len(by_id["r6"]["token_ids"]) >= 5
    assert by_id[f"r{ABORTED}"]["finish_reason"] == "abort"
    assert len(by_id[f"r{ABORTED}"]["token_ids"]) == ABORT_AFTER


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("budget", [2048, 7])
def test_same_passes_and_bit_identical_outputs_when_nothing_stops_early(tiny_checkpoints, family, budget):
    """Requests that end only by max_tokens: the async engine runs exactly the synchronous engine's
    passes (it never plans a row for a token that max_tokens would discard), so every token and
    logprob is bit-identical: seeded draws, penalties on the token still on the device, chunked
    prefill whose last chunk feeds the next decode pass on the device."""
    path = tiny_checkpoints[family][0]
    params = [
        SamplingParams(temperature=0, max_tokens=9, ignore_eos=True, logprobs=2),
        SamplingParams(temperature=0, max_tokens=1, ignore_eos=True, logprobs=3, prompt_logprobs=2),
        SamplingParams(temperature=1.0, top_p=0.9, top_k=40, seed=7, max_tokens=10, ignore_eos=True, logprobs=1),
        SamplingParams(
            temperature=0.8,
            seed=3,
            repetition_penalty=1.5,
            presence_penalty=0.7,
            frequency_penalty=0.3,
            max_tokens=12,
            ignore_eos=True,
            logprobs=2,
        ),
        SamplingParams(temperature=0, repetition_penalty=1.3, frequency_penalty=0.5, max_tokens=6, ignore_eos=True),
        SamplingParams(temperature=0.6, seed=11, presence_penalty=1.0, max_tokens=2, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=11, ignore_eos=True, prompt_logprobs=0),
        SamplingParams(temperature=1.2, seed=1, max_tokens=5, ignore_eos=True, min_tokens=5),
    ]
    requests = [(f"r{i}", p, sp) for i, (p, sp) in enumerate(zip(prompts(), params, strict=True))]
    results, passes = {}, {}
    for mode in (False, True):
        core = engine(path, mode, max_num_batched_tokens=budget)
        seen = passes[mode] = []
        launch = core.executor.execute_async  # both modes launch through it (the sync step then waits)

        def spy(plan, launch=launch, seen=seen):
            seen.append((list(plan.req_ids), plan.query_start_loc.tolist()))
            return launch(plan)

        core.executor.execute_async = spy
        results[mode] = [summary(o) for o in run(core, requests)]
        assert_pools_full(core)
        assert core.scheduler.stats.num_discarded_tokens == 0
    assert passes[False] == passes[True]
    assert_same(results[False], results[True], exact=True)


@pytest.mark.parametrize("family", FAMILIES)
def test_preempting_a_request_whose_token_is_in_flight(tiny_checkpoints, family, monkeypatch):
    """Decoding requests outgrow a small page pool: the newest is preempted while its latest token
    is still in flight; that token is appended when it arrives, and the request resumes (recomputed
    from prompt and outputs) only once it is known."""
    path = tiny_checkpoints[family][0]
    ps = prompts()
    params = [
        SamplingParams(temperature=0, max_tokens=14, ignore_eos=True),
        SamplingParams(temperature=0.9, seed=4, repetition_penalty=1.4, max_tokens=14, ignore_eos=True, logprobs=1),
        SamplingParams(temperature=0, presence_penalty=0.8, max_tokens=14, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
    ]
    requests = [(f"q{i}", ps[j], sp) for i, (j, sp) in enumerate(zip([2, 3, 2, 4], params, strict=True))]
    preempt = Scheduler._preempt
    victims = []

    def spy(self, victim):
        victims.append(victim.num_pending_outputs)
        preempt(self, victim)

    monkeypatch.setattr(Scheduler, "_preempt", spy)
    results = {}
    for mode in (False, True):
        victims.clear()
        core = engine(path, mode, block_size=4, num_kv_blocks=12, max_num_batched_tokens=16)
        results[mode] = [summary(o) for o in run(core, requests)]
        assert_pools_full(core)
        assert victims and (any(victims) if mode else not any(victims))
    assert_same(results[False], results[True], exact=False)


def test_flag_reaches_the_engine(tiny_checkpoints, tmp_path):
    from deltaserve import LLM
    from deltaserve.cli import build_parser
    from deltaserve.cluster.entrypoints.cli import engine_config

    path = str(tiny_checkpoints["qwen3_5"][0])
    assert LLM(path).engine.async_scheduling  # on by default, CPU included
    assert not LLM(path, async_scheduling=False).engine.async_scheduling
    for argv, on in (([], None), (["--no-async-scheduling"], False), (["--async-scheduling"], True)):
        args = build_parser().parse_args(["serve", "--model", str(tmp_path), *argv])
        assert engine_config(args, "local").scheduler.async_scheduling is on


def test_decode_inputs_come_from_the_device(tiny_checkpoints):
    """Under async scheduling decode rows take their input ids from the previous pass's sampled ids
    (input_from_prev); the synchronous engine never needs to."""
    path = tiny_checkpoints["qwen3_5"][0]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    for mode in (False, True):
        core = engine(path, mode)
        plans = []
        launch = core.executor.execute_async  # both modes launch through it

        def spy(plan, launch=launch, plans=plans):
            plans.append(plan)
            return launch(plan)

        core.executor.execute_async = spy
        run(core, [("a", prompts()[4], params), ("b", prompts()[2], params)])
        from_device = [p for p in plans if p.input_from_prev is not None and (p.input_from_prev >= 0).any()]
        assert bool(from_device) is mode
        for p in from_device:  # the placeholder in input_ids is what the worker replaces
            rows = np.flatnonzero(p.input_from_prev >= 0)
            assert (p.input_ids[p.query_start_loc[rows]] == 0).all() and (rows < p.num_decode_rows).all()
        assert_pools_full(core)


def test_request_id_reused_while_its_pass_is_in_flight(tiny_checkpoints):
    """An aborted request's token still in flight must not land on a new request of the same id."""
    path = tiny_checkpoints["qwen3_next"][0]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    (ref,) = run(engine(path, False), [("a", prompts()[5], params)])
    core = engine(path, True)
    core.add_request("a", prompts()[3], params)
    for _ in range(3):
        core.step()
    assert core.has_unfinished() and core._in_flight is not None
    core.abort("a")
    (out,) = run(core, [("a", prompts()[5], params)])
    assert out.outputs[0].token_ids == ref.outputs[0].token_ids
    assert_pools_full(core)


class FailingExecutor(LocalExecutor):
    """The in-process executor whose pass `fail_at` dies when its output is awaited."""

    def __init__(self, config, model_config, fail_at: int):
        super().__init__(config, model_config)
        self.fail_at = fail_at

    def execute_async(self, plan):
        launched = super().execute_async(plan)
        if plan.pass_id != self.fail_at:
            return launched

        class Dead:
            def result(self):
                launched.result()
                raise WorkerFailure(f"worker died during pass {plan.pass_id}")

        return Dead()


def test_worker_failure_fails_requests_cleanly(tiny_checkpoints):
    path = tiny_checkpoints["qwen3_5_moe"][0]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    (ref,) = run(engine(path, False), [("c", prompts()[4], params)])
    config = EngineConfig.from_kwargs(model=str(path), max_num_seqs=8)
    core = build_engine(config, executor=FailingExecutor(config, ModelConfig.from_pretrained(str(path)), fail_at=3))
    outs = run(core, [("a", prompts()[2], params), ("b", prompts()[6], params)])
    assert [o.outputs[0].finish_reason for o in outs] == ["error", "error"]
    assert all("worker died" in o.error for o in outs)
    assert_pools_full(core)
    (after,) = run(core, [("c", prompts()[4], params)])  # the engine serves on
    assert after.outputs[0].token_ids == ref.outputs[0].token_ids
    assert_pools_full(core)


def test_plan_that_reads_ids_the_runner_does_not_hold_is_rejected(tiny_checkpoints):
    path = tiny_checkpoints["qwen3_5"][0]
    core = engine(path, True)
    core.add_request("a", prompts()[2], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    core.step()
    core.step()
    plan = core._in_flight.plan
    assert plan.input_from_prev is not None
    bad = decode_plan(encode_plan(plan))  # the field survives the wire
    assert np.array_equal(bad.input_from_prev, plan.input_from_prev)
    bad.pass_id += 5
    with pytest.raises(WireError, match="input_from_prev"):
        core.executor.execute_async(bad)
    while core.has_unfinished():
        core.step()
    assert_pools_full(core)


def test_wire_rejects_input_from_prev_on_a_prefill_row():
    from test_wire import make_plan

    plan = make_plan()
    plan.input_from_prev = np.array([0, -1], np.int32)
    assert np.array_equal(decode_plan(encode_plan(plan)).input_from_prev, plan.input_from_prev)
    plan.input_from_prev = np.array([-1, 0], np.int32)  # row 1 is a 3-token prefill row
    with pytest.raises(WireError, match="input_from_prev"):
        decode_plan(encode_plan(plan))
    plan.input_from_prev = np.array([0], np.int32)
    with pytest.raises(WireError, match="input_from_prev"):
        decode_plan(encode_plan(plan))


def test_penalties_with_the_latest_token_still_on_the_device():
    """A token not yet in the history, given as a device id, is penalised as if it were there."""
    spec = SamplingSpec(
        temperature=0,
        repetition_penalty=1.7,
        presence_penalty=0.4,
        frequency_penalty=0.3,
        min_tokens=4,
        min_tokens_banned_ids=[5],
    )
    logits = torch.randn(2, 8, generator=torch.Generator().manual_seed(0))
    known = Sampler(vocab_size=8)
    known.add(NewRequestData("x", [0, 1], [3, 6, 6], spec))
    known.add(NewRequestData("y", [2], [7], spec))
    pending = Sampler(vocab_size=8)
    pending.add(NewRequestData("x", [0, 1], [3, 6], spec))
    pending.add(NewRequestData("y", [2], [7], spec))
    pending.states["x"].num_sampled += 1  # the third output was sampled; its id is on the device
    a, b = logits.clone(), logits.clone()
    known._apply_penalties(a, [known.states["x"], known.states["y"]])
    pending._apply_penalties(b, [pending.states["x"], pending.states["y"]], [0], lambda: torch.tensor([6]))
    assert torch.equal(a, b)
    assert a[0, 5] == float("-inf") and a[1, 5] == float("-inf")  # 3 and 1 outputs: under min_tokens


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("eager", [False, True])
def test_cuda_async_matches_sync_and_decode_launches_do_not_sync(tiny_checkpoints, eager):
    """On the GPU (CUDA graphs or eager): the same tokens with and without async scheduling, and
    launching a decode pass never waits for the device (CUDA's sync debug mode raises if it does)."""
    path = tiny_checkpoints["qwen3_5_moe"][0]
    params = [
        SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
        SamplingParams(temperature=0.9, seed=5, top_p=0.9, max_tokens=16, ignore_eos=True, logprobs=2),
        SamplingParams(temperature=0, repetition_penalty=1.3, presence_penalty=0.5, max_tokens=16, ignore_eos=True),
        SamplingParams(temperature=0.7, seed=9, frequency_penalty=0.4, max_tokens=16, ignore_eos=True),
    ]
    requests = [(f"g{i}", p, sp) for i, (p, sp) in enumerate(zip(prompts()[:4], params, strict=True))]
    kw = dict(device="cuda", dtype="float32", num_kv_blocks=256, enforce_eager=eager)
    sync = [summary(o) for o in run(engine(path, False, **kw), requests)]
    core = engine(path, True, **kw)
    assert (core.executor.runner.graphs is None) is eager
    launch = core.executor.execute_async
    checked = []

    def no_sync_launch(plan):
        if plan.num_decode_rows != plan.num_rows:  # prefill kernels may read lengths on the host
            return launch(plan)
        torch.cuda.set_sync_debug_mode("error")
        try:
            return launch(plan)
        finally:
            torch.cuda.set_sync_debug_mode("default")
            checked.append(plan.pass_id)

    core.executor.execute_async = no_sync_launch
    asyn = [summary(o) for o in run(core, requests)]
    assert len(checked) > 5
    assert_same(sync, asyn, exact=False, atol=1e-3)  # tokens exact; logprobs as GPU kernels round
    assert_pools_full(core)


def test_switching_overlap_off_and_on_mid_generation_keeps_the_tokens(tiny_checkpoints):
    """`set_async_scheduling` (the offline benchmark times both modes on one engine) finishes the
    pass in flight and carries on with the same tokens as an engine that never switched."""
    path = tiny_checkpoints["qwen3_5_moe"][0]
    params = SamplingParams(temperature=0.8, seed=5, max_tokens=12, ignore_eos=True)
    requests = [(f"r{i}", p, params) for i, p in enumerate(prompts()[:4])]
    reference = [o.outputs[0].token_ids for o in run(engine(path, True), requests)]
    core = engine(path, True)
    for req_id, prompt, sp in requests:
        core.add_request(req_id, prompt, sp)
    final = {}
    for step in range(40):
        if step in (3, 7):
            outs = core.set_async_scheduling(step == 7)
            assert core.async_scheduling is (step == 7)
        else:
            outs = core.step()
        final.update({o.request_id: o for o in outs if o.finished})
        if not core.has_unfinished():
            break
    assert [final[r].outputs[0].token_ids for r, _, _ in requests] == reference
    assert_pools_full(core)
