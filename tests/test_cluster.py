"""The Ray cluster on CPU actors (gloo): TP = 2 and EP = 2 give the tokens of TP = 1, bad layouts
fail before anything starts, and a worker killed mid-generation fails its requests and is replaced."""

from __future__ import annotations

import pytest
import torch
from tiny_models import TP2_OVERRIDES, VOCAB_SIZE, save_tiny

from deltaserve import LLM, SamplingParams
from deltaserve.cluster.config import EngineConfig
from deltaserve.cluster.entrypoints.startup import build_engine
from deltaserve.cluster.executors.base import WorkerFailure
from deltaserve.layers.parallel import ParallelConfigError

pytestmark = pytest.mark.ray

TP_OVERRIDES = TP2_OVERRIDES
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(3, VOCAB_SIZE, (n,), generator=g).tolist() for n in (2, 9, 30, 70)]


@pytest.fixture(scope="module")
def tp_checkpoints(tmp_path_factory):
    out = {}
    for family, overrides in TP_OVERRIDES.items():
        path = tmp_path_factory.mktemp(f"tp_{family}")
        save_tiny(family, path, **overrides)
        out[family] = str(path)
    return out


def tokens(llm: LLM) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts(), GREEDY, use_tqdm=False)]


@pytest.mark.parametrize(
    "family, expert_parallel",
    [("qwen3_next", False), ("qwen3_5", False), ("qwen3_5_moe", False), ("qwen3_next", True), ("qwen3_5_moe", True)],
)
def test_parallel_tokens_equal_single_rank(ray_session, tp_checkpoints, family, expert_parallel):
    path = tp_checkpoints[family]
    reference = tokens(LLM(path))
    llm = LLM(path, tensor_parallel_size=2, enable_expert_parallel=expert_parallel, max_num_batched_tokens=40)
    assert llm.engine.async_scheduling  # on by default over the shared-memory ring
    try:
        assert tokens(llm) == reference
    finally:
        llm.shutdown()


def test_layout_that_does_not_divide_fails_before_start(ray_session, tiny_checkpoints):
    path = str(tiny_checkpoints["qwen3_next"][0])  # 3 GDN key heads
    groups_before = len(ray_session.util.placement_group_table())
    with pytest.raises(ParallelConfigError, match="linear_num_key_heads"):
        LLM(path, tensor_parallel_size=2)
    with pytest.raises(ParallelConfigError, match="num_attention_heads"):
        LLM(path, tensor_parallel_size=4)
    assert len(ray_session.util.placement_group_table()) == groups_before  # no worker group was started


# greedy and seeded draws, with penalties (their history includes ids still on the device under
# async scheduling), min_tokens bans and logprobs (computed on TP rank 0 only)
MIXED = [
    SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
    SamplingParams(
        temperature=0.9, top_k=20, seed=7, max_tokens=8, ignore_eos=True,
        repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.3, logprobs=2,
    ),
    SamplingParams(temperature=1.0, top_p=0.9, seed=11, max_tokens=8, ignore_eos=True, frequency_penalty=0.6),
    SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, repetition_penalty=1.5, min_tokens=4),
]  # fmt: skip


def mixed_tokens(llm: LLM) -> list[list[int]]:
    outs = llm.generate(prompts(), MIXED, use_tqdm=False)
    logprobs = outs[1].outputs[0].logprobs
    assert [lp.token_id for lp in logprobs] == outs[1].outputs[0].token_ids
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("family", sorted(TP_OVERRIDES))
def test_async_scheduling_over_shm_gives_single_rank_tokens(ray_session, tp_checkpoints, family):
    """TP = 2 with passes overlapped over the shared-memory ring: decode rows read their input ids
    from the previous pass's sampled ids on every rank (each rank samples); the tokens are those of
    TP = 1 and of TP = 2 without overlap, chunked prefill included (a 24-token budget)."""
    path = tp_checkpoints[family]
    reference = mixed_tokens(LLM(path, max_num_batched_tokens=24))
    llm = LLM(path, tensor_parallel_size=2, max_num_batched_tokens=24, async_scheduling=True)
    try:
        engine = llm.engine
        executor = engine.executor
        assert executor.transport == "shm" and engine.async_scheduling
        from_prev = []
        launch = executor.execute_async

        def spy(plan):
            from_prev.append(plan.input_from_prev is not None and bool((plan.input_from_prev >= 0).any()))
            return launch(plan)

        executor.execute_async = spy
        assert mixed_tokens(llm) == reference
        assert any(from_prev)  # passes did overlap: later plans named ids only the workers held
        assert engine.blocks.num_free == engine.blocks.capacity
        assert not executor._outstanding
        engine.set_async_scheduling(False)
        assert not engine.async_scheduling
        executor.pass_stages.clear()
        assert mixed_tokens(llm) == reference
        # synchronous passes: every control stage is measured, none negative, and together with
        # rank 0's forward they fit inside the pass's wall time on the driver
        stages = executor.control_stages_s()
        assert set(stages) >= {"plan_to_worker", "plan_decode", "reply_to_driver", "other_ranks"}
        assert all(v >= 0 for v in stages.values()), stages
        wall, forward = executor.pass_times[-1]
        last = executor.pass_stages[-1]
        on_rank0 = ("launch", "device_wait", "resolve", "slowest_plan_to_worker")
        control = sum(v for k, v in last.items() if k not in on_rank0)
        assert control <= wall - forward + 1e-3
    finally:
        llm.shutdown()


@pytest.mark.parametrize("transport", ["shm", "compiled"])
def test_killed_worker_fails_requests_then_group_is_replaced(ray_session, tp_checkpoints, transport):
    path = tp_checkpoints["qwen3_5_moe"]
    config = EngineConfig.from_kwargs(model=path, tensor_parallel_size=2, async_scheduling=True)
    engine = build_engine(config, executor=_executor(config, transport))
    assert engine.executor.transport == transport
    # passes overlap over the shared-memory ring only; the compiled graph stays synchronous
    assert engine.async_scheduling is (transport == "shm")
    reference = tokens(LLM(path))
    for i, p in enumerate(prompts()):
        engine.add_request(f"r{i}", p, SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))
    for _ in range(3):
        engine.step()
    old = engine.executor.workers[1]
    ray_session.kill(old)
    finished = {}
    for _ in range(5):
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
        if len(finished) == 4:
            break
    assert sorted(finished) == ["r0", "r1", "r2", "r3"]
    assert all(o.outputs[0].finish_reason == "error" and "worker" in o.error for o in finished.values())
    assert engine.blocks.num_free == engine.blocks.capacity
    assert engine.slots.num_free == engine.slots.capacity
    assert engine.has_unfinished()  # the failures are out before the group is replaced: the next step does it
    assert engine.step() == []
    assert engine.executor.workers[1] is not old
    assert engine.async_scheduling is (transport == "shm")
    # the replaced group serves new requests with the same tokens
    for i, p in enumerate(prompts()):
        engine.add_request(f"again{i}", p, GREEDY)
    done = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
    assert [done[f"again{i}"] for i in range(4)] == reference
    engine.shutdown()


def _executor(config, transport: str):
    from deltaserve.cluster.executors.ray import RayExecutor
    from deltaserve.layers.config import ModelConfig

    return RayExecutor(config, ModelConfig.from_pretrained(config.load.model), transport=transport)


def test_llm_generate_raises_after_worker_death_and_recovers(ray_session, tp_checkpoints):
    path = tp_checkpoints["qwen3_5"]
    llm = LLM(path, tensor_parallel_size=2)
    reference = tokens(llm)
    ray_session.kill(llm.engine.executor.workers[0])
    with pytest.raises(WorkerFailure, match="worker"):
        llm.generate(prompts(), GREEDY, use_tqdm=False)
    assert tokens(llm) == reference
    llm.shutdown()
