"""The start-up warm-up's LoRA and speculative passes (workers/warmup.py). Triton's compiles cannot be
seen on CPU (the GPU session's logs show them: no "after start-up" line), so these check what the
warm-up runs: adapter rows on one slot and on several beside base rows, a speculative step's parts
(eager verify with sampled rows, write-on-accept, the head's catch-up and drafts); that it leaves the
runner as it found it; and that an engine warmed up so gives exactly the tokens of one that was not."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from lora_adapters import peft_adapter
from test_model_vs_transformers import prompt

from deltaserve import LLM, LoRARequest, SamplingParams
from deltaserve.cluster.config import EngineConfig
from deltaserve.layers.config import ModelConfig
from deltaserve.layers.kernels import lora as lora_kernels
from deltaserve.layers.lora import ExpertLoraSlots, _all_slots
from deltaserve.workers import sampler as sampler_module
from deltaserve.workers.plan import PoolSizes
from deltaserve.workers.runner import ModelRunner
from deltaserve.workers.spec_decode import SpecDecoder
from deltaserve.workers.state_pool import StatePool
from deltaserve.workers.warmup import (
    SPEC_WARMUP_ROWS,
    lora_layouts,
    spec_warmup_plans,
    warmup_batches,
    warmup_fits,
)
from deltaserve.workers.wire import check_plan_ranges, check_spec_engine, decode_plan, encode_plan

SIZES = PoolSizes(num_blocks=256, block_size=16, num_slots=20)
SPEC = {"method": "mtp", "num_speculative_tokens": 2}


def make_runner(path, **kw) -> ModelRunner:
    config = EngineConfig.from_kwargs(model=str(path), **kw).worker_config()
    return ModelRunner(config, ModelConfig.from_pretrained(str(path)))


def lora_state(runner: ModelRunner):
    """Everything the adapter slots hold: what each slot holds, the per-target flags and weights."""
    sets = _all_slots(runner.model)
    weights = [t.clone() for s in sets for t in ((s.a, s.b) if hasattr(s, "a") else s.weights)]
    return list(runner.lora.held), list(runner.lora.has_experts), [list(s.present) for s in sets], weights


def runner_state(runner: ModelRunner) -> dict:
    return {
        "pool": runner.pool,
        "spec": runner.spec,
        "sizes": runner.sizes,
        "graphs": (runner.graphs, runner.verify_graphs),
        "unresolved": (runner._unresolved, list(runner._unresolved)),
        "prev": runner._prev,
        "requests": dict(runner.sampler.states),
        "generators": dict(runner.sampler._generators),
    }


@pytest.mark.parametrize("k", [1, 3])
@pytest.mark.parametrize("n", SPEC_WARMUP_ROWS)
def test_spec_warmup_plans_are_valid(n, k):
    """Each pass passes the worker's checks (the codec's, ranges, the engine's k); verify rows come
    first with k + 1 tokens; a drafting row's pages hold the head's k - 1 draft steps; a request is
    introduced before its rows; the passes' slots and pages are the requests' own."""
    plans = spec_warmup_plans(n, k, SIZES.block_size)
    sizes = PoolSizes(num_blocks=1024, block_size=16, num_slots=n + 3)
    known = set()
    pages_of = {}
    for plan in plans:
        plan = decode_plan(encode_plan(plan))
        check_plan_ranges(plan, sizes, vocab_size=10)
        check_spec_engine(plan, k)
        known |= {d.req_id for d in plan.new_requests}
        assert set(plan.req_ids) <= known and len(set(plan.req_ids)) == plan.num_rows
        assert len(set(plan.slot_mapping.tolist())) == plan.num_tokens
        starts = plan.query_start_loc
        if plan.num_spec_tokens:
            assert plan.num_spec_tokens == k and plan.draft_rows[: plan.num_decode_rows].all()
            assert np.array_equal(np.diff(starts[: plan.num_decode_rows + 1]), [k + 1] * plan.num_decode_rows)
        for row, req in enumerate(plan.req_ids):
            pages = plan.block_tables[row][: -(-int(plan.seq_lens[row]) // 16)].tolist()
            held = pages_of.setdefault((req, int(plan.state_slots[row])), pages)
            shorter = min(len(held), len(pages))
            assert held[:shorter] == pages[:shorter]  # a request's pages only grow
            pages_of[req, int(plan.state_slots[row])] = max(held, pages, key=len)
            if plan.draft_rows[row]:
                assert plan.seq_lens[row] + k - 1 <= plan.block_tables.shape[1] * 16
    slots = {slot for req, slot in pages_of}
    assert len(slots) == len(pages_of) == n + 2  # one slot per request
    all_pages = [p for pages in pages_of.values() for p in pages]
    assert len(all_pages) == len(set(all_pages))
    # the sampled rows of the verify passes: seeded draws with logprobs beside greedy rows
    specs = {d.req_id: d.sampling for p in plans for d in p.new_requests}
    verified = [specs[r] for r in plans[1].req_ids]
    assert any(not s.greedy and s.seed is not None and s.logprobs for s in verified)
    assert n == 1 or any(s.greedy for s in verified)


def test_lora_warmup_runs_adapter_rows_and_restores_the_slots(tiny_checkpoints, monkeypatch):
    """With LoRA the fitting warm-up batches run again with adapter rows: all on slot 0, and (two rows
    or more) on several slots beside base rows; every projection's adapters and the experts' deltas
    run. The slots end as they began (nothing held, no flag, weights untouched)."""
    path, _ = tiny_checkpoints["qwen3_5_moe"]
    runner = make_runner(path, max_num_batched_tokens=128, enable_lora=True, max_loras=3, max_lora_rank=8)
    before, state = lora_state(runner), runner_state(runner)
    projections, experts = [], []
    real_add, real_deltas = lora_kernels.add_lora, lora_kernels.ExpertDeltas

    def add_lora(*, rows, **kw):
        projections.append(frozenset(rows.keys.unique().tolist()))
        return real_add(rows=rows, **kw)

    def deltas(**kw):
        experts.append(frozenset(kw["token_slots"].unique().tolist()))
        return real_deltas(**kw)

    monkeypatch.setattr(lora_kernels, "add_lora", add_lora)
    monkeypatch.setattr(lora_kernels, "ExpertDeltas", deltas)
    pool = StatePool(runner.model, SIZES, dtype=runner.dtype, device=runner.device)
    passes = runner.compile_warmup(pool)
    fitting = [b for b in warmup_batches(128) if warmup_fits(b, 128, SIZES)]
    layouts = [set(s.tolist()) for b in fitting for s in lora_layouts(len(b), 3)]
    assert len(fitting) == 13 and ((0, 128),) in fitting and passes == len(fitting) + len(layouts)  # 9 short mixed
    assert {0, -1} in layouts and {0, 1, 2, -1} in layouts and {0} in layouts
    assert set(projections) == set(experts) == {frozenset(x) for x in layouts}
    moe_layers = sum(isinstance(s, ExpertLoraSlots) for s in _all_slots(runner.model))
    assert moe_layers and len(experts) == len(layouts) * moe_layers  # every MoE layer, every pass
    after = lora_state(runner)
    assert after[:3] == before[:3] and before[0] == [None] * 3
    assert all(torch.equal(a, b) for a, b in zip(after[3], before[3], strict=True))
    assert runner_state(runner) == state


def test_spec_warmup_runs_speculative_steps_and_leaves_no_state(tiny_checkpoints, monkeypatch):
    """With speculation the warm-up runs the head's catch-up over each warm-up batch and the
    speculative steps through the runner's execute path: verify rows sampled eagerly (greedy and
    seeded draws), write-on-accept, catch-up and drafts. No request is left in the sampler, its
    unseeded generator is untouched, and the runner's pool, sizes and pass bookkeeping are as before
    (the profiling pool: before allocate)."""
    path, _ = tiny_checkpoints["qwen3_5_moe"]
    runner = make_runner(path, max_num_batched_tokens=64, speculative_config=SPEC, max_num_seqs=8)
    state = runner_state(runner)
    steps, verify, accepts, draws = [], [], [], []
    real_after, real_verify = SpecDecoder.after_sampling, sampler_module.Sampler.sample_verify
    real_accept, real_draw = runner.model.write_on_accept, sampler_module.Sampler._draw

    def after_sampling(self, plan, ctx, hidden, sampled, accepted, row_tokens, index):
        drafts = real_after(self, plan, ctx, hidden, sampled, accepted, row_tokens, index)
        steps.append((plan.num_spec_tokens, plan.num_decode_rows, None if drafts is None else tuple(drafts.shape)))
        return drafts

    def sample_verify(self, req_ids, logits, *args, **kw):
        verify.append(tuple(self.states[r].spec.greedy for r in req_ids))
        return real_verify(self, req_ids, logits, *args, **kw)

    monkeypatch.setattr(SpecDecoder, "after_sampling", after_sampling)
    monkeypatch.setattr(sampler_module.Sampler, "sample_verify", sample_verify)
    monkeypatch.setattr(sampler_module.Sampler, "_draw", lambda self, *a: draws.append(1) or real_draw(self, *a))
    monkeypatch.setattr(runner.model, "write_on_accept", lambda *a, **kw: accepts.append(1) or real_accept(*a, **kw))
    pool = StatePool(runner.model, SIZES, dtype=runner.dtype, device=runner.device)
    passes = runner.compile_warmup(pool)
    fitting = [b for b in warmup_batches(64) if warmup_fits(b, 64, SIZES)]
    sequences = [n for n in SPEC_WARMUP_ROWS if n + 2 <= 8]  # the 16-row one exceeds max_num_seqs
    assert len(fitting) == 10 and passes == len(fitting) + 4 * len(sequences)  # 7 short mixed passes fit 64 tokens
    # the head's catch-up over each warm-up batch (its decode rows first), no drafts
    assert steps[: len(fitting)] == [(0, sum(c > 0 and t == 1 for c, t in b), None) for b in fitting]
    assert steps[len(fitting) :] == [
        step
        for n in sequences
        for step in ((0, 0, (n, 2)), (2, n, (n, 2)), (2, n, (n + 1, 2)), (0, n, ((n + 1) // 2, 2)))
    ]
    assert verify == [tuple(i % 2 == 1 for i in range(n)) for n in sequences for _ in range(2)]
    assert len(accepts) == 2 * len(sequences) and draws
    assert runner_state(runner) == state and not runner.sampler.states


def generate(llm: LLM, prompts, params, loras=None) -> list[list[int]]:
    outs = llm.generate(prompts, params, lora_request=loras, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def warmed(llm: LLM) -> LLM:
    """The warm-up a CUDA engine runs on its new pools (num_kv_blocks given), here on CPU."""
    runner = llm.engine.executor.runner
    assert runner.compile_warmup(runner.pool) > 0
    return llm


def sampled_params(n: int) -> list[SamplingParams]:
    """Greedy, a repetition penalty, a seeded and an unseeded draw (the sampler's generator)."""
    return [
        SamplingParams(temperature=0, max_tokens=n, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, repetition_penalty=1.3),
        SamplingParams(temperature=0.9, top_k=20, max_tokens=n, ignore_eos=True, seed=7),
        SamplingParams(temperature=0.9, max_tokens=n, ignore_eos=True),
    ]


def test_lora_engine_tokens_unchanged_by_the_warmup(tiny_checkpoints, tmp_path):
    """An engine whose adapter slots served the warm-up gives, on two adapters and base rows, the
    tokens of one that never ran it."""
    path, hf = tiny_checkpoints["qwen3_5_moe"]
    loras = []
    for i, which in enumerate(("all", "experts")):
        peft_adapter(hf, "qwen3_5_moe", which, tmp_path / which, seed=5 + i)
        loras.append(LoRARequest(which, i + 1, str(tmp_path / which)))
    settings = dict(dtype="float32", enable_lora=True, max_lora_rank=8, max_loras=2, max_num_batched_tokens=64)
    prompts = [prompt(9 + 4 * i, seed=40 + i) for i in range(4)]
    params = sampled_params(5)
    rows = [loras[0], None, loras[1], loras[0]]
    expected = generate(LLM(str(path), **settings), prompts, params, rows)
    assert generate(warmed(LLM(str(path), **settings)), prompts, params, rows) == expected


@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_5_moe"])
def test_spec_engine_tokens_unchanged_by_the_warmup(tiny_checkpoints, family):
    """A speculative engine whose pools, head and sampler served the warm-up gives the tokens of one
    that never ran it: greedy and sampled requests, one with a penalty (no drafts)."""
    path, _ = tiny_checkpoints[family]
    settings = dict(max_num_batched_tokens=24, max_num_seqs=8, enable_prefix_caching=False, speculative_config=SPEC)
    prompts = [prompt(n, seed=50 + n) for n in (3, 30, 9, 17)]
    params = sampled_params(8)
    llm = LLM(str(path), **settings)
    expected = generate(llm, prompts, params)
    assert llm.engine.speculative_stats()["num_draft_tokens"] > 0
    assert generate(warmed(LLM(str(path), **settings)), prompts, params) == expected
