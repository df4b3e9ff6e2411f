"""Adapters through the engine (LLM, CPU, float32): greedy tokens equal PEFT's merged model's greedy
by uncached forwards for each family and target set (more adapters than device slots: loaded and
evicted LRU, reloaded from host memory); a batch with 4 adapters and base-model rows gives each row
its tokens alone; the prefix cache never shares blocks across adapters; bad adapters are errors
naming the field or file and the engine keeps serving; adapters load and unload at run time."""

from __future__ import annotations

import json

import pytest
import torch
from lora_adapters import TARGET_SETS, greedy, peft_adapter, write_adapter
from test_model_vs_transformers import prompt
from tiny_models import FAMILIES

from deltaserve import LLM, LoRARequest, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def make_llm(path, **kw) -> LLM:
    settings = dict(dtype="float32", device="cpu", enable_lora=True, max_lora_rank=8, max_num_seqs=8)
    return LLM(str(path), **{**settings, **kw})


def tokens(out) -> list[int]:
    return list(out.outputs[0].token_ids)


@pytest.fixture(scope="module")
def adapters(tiny_checkpoints, tmp_path_factory):
    """family -> [(target set, LoRARequest, PEFT's merged model)]."""
    out = {}
    for family in FAMILIES:
        path, hf = tiny_checkpoints[family]
        root = tmp_path_factory.mktemp(f"lora-{family}")
        out[family] = [
            (which, LoRARequest(f"{family}-{which}", i + 1, str(root / which)),
             peft_adapter(hf, family, which, root / which, seed=10 + i))
            for i, which in enumerate(TARGET_SETS)
        ]  # fmt: skip
    return out


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_matches_peft_merged(family, tiny_checkpoints, adapters):
    """Two device slots for four adapters: later ones evict earlier ones (LRU); the second round
    reloads them from the rank's host memory (max_cpu_loras) and must give the same tokens."""
    path, hf = tiny_checkpoints[family]
    llm = make_llm(path, max_loras=2, max_cpu_loras=4)
    ids = prompt(13, seed=21)
    for _ in range(2):
        for which, lora, merged in adapters[family]:
            (out,) = llm.generate([ids], GREEDY, lora_request=lora, use_tqdm=False)
            assert tokens(out) == greedy(merged, ids, GREEDY.max_tokens), which
    (base,) = llm.generate([ids], GREEDY, use_tqdm=False)
    assert tokens(base) == greedy(hf, ids, GREEDY.max_tokens)
    assert {r.lora_int_id for r in llm.list_loras()} == {1, 2, 3, 4}


def test_mixed_batch_four_adapters_and_base_rows(tiny_checkpoints, adapters):
    """One batch: four adapters and two base-model rows (prompts of different lengths, so rows of the
    same pass are prefill and decode); each row's tokens are its tokens alone."""
    path, hf = tiny_checkpoints["qwen3_5_moe"]
    llm = make_llm(path, max_loras=4, max_num_batched_tokens=24)  # chunked: decode and prefill rows mix
    loras = [lora for _, lora, _ in adapters["qwen3_5_moe"]]
    rows = [
        (prompt(9 + 3 * i, seed=30 + i), lora)
        for i, lora in enumerate([loras[0], None, loras[1], loras[2], None, loras[3]])
    ]
    together = llm.generate([p for p, _ in rows], GREEDY, lora_request=[lora for _, lora in rows], use_tqdm=False)
    for (ids, lora), out in zip(rows, together, strict=True):
        (alone,) = llm.generate([ids], GREEDY, lora_request=lora, use_tqdm=False)
        assert tokens(out) == tokens(alone)
    merged = {lora.lora_int_id: m for _, lora, m in adapters["qwen3_5_moe"]}
    for (ids, lora), out in zip(rows, together, strict=True):
        ref = hf if lora is None else merged[lora.lora_int_id]
        assert tokens(out) == greedy(ref, ids, GREEDY.max_tokens)


def test_prefix_cache_is_keyed_by_adapter(tiny_checkpoints, adapters):
    """The same long prompt on adapter A, then on B, then on the base model, then on A again: only
    the repeat on A hits the cache, and every output is its uncached reference."""
    path, hf = tiny_checkpoints["qwen3_next"]
    llm = make_llm(path, max_loras=2, block_size=4, prefix_snapshot_interval=8)
    (_, a, merged_a), (_, b, merged_b) = adapters["qwen3_next"][:2]
    ids = prompt(40, seed=40)
    runs = [(a, merged_a), (b, merged_b), (None, hf), (a, merged_a)]
    cached = []
    for lora, ref in runs:
        (out,) = llm.generate([ids], GREEDY, lora_request=lora, use_tqdm=False)
        assert tokens(out) == greedy(ref, ids, GREEDY.max_tokens)
        cached.append(out.num_cached_tokens)
    assert cached[:3] == [0, 0, 0], "requests on different adapters (or none) share no cached prefix"
    assert cached[3] > 0, "the same adapter's repeat hits the cache"


@pytest.fixture(scope="module")
def engine(tiny_checkpoints, adapters):
    path, _ = tiny_checkpoints["qwen3_5_moe"]
    return make_llm(path, max_loras=2, max_lora_rank=8, enable_expert_lora=True)


def _bad(tmp_path, name, tensors=None, **config):
    return str(write_adapter(tmp_path / name, tensors or {}, **config))


def test_bad_adapters_are_errors_naming_the_field(engine, tiny_checkpoints, adapters, tmp_path):
    path, hf = tiny_checkpoints["qwen3_5_moe"]
    h = hf.config.hidden_size
    q = "model.layers.1.self_attn.q_proj"

    def pair(rank, width):
        return {f"{q}.lora_A.weight": torch.zeros(rank, width), f"{q}.lora_B.weight": torch.zeros(192, rank)}

    cases = [
        # B x A does not match the base q_proj [192, 48]
        (_bad(tmp_path, "shape", pair(4, h + 1)), "do not match the base module"),
        (_bad(tmp_path, "rank", pair(32, h)), "exceeds max_lora_rank (8)"),
        (_bad(tmp_path, "module", {"model.layers.1.self_attn.nope.lora_A.weight": torch.zeros(4, h),
                                   "model.layers.1.self_attn.nope.lora_B.weight": torch.zeros(4, 4)}),
         "targets no projection"),
        (_bad(tmp_path, "dora", pair(4, h), use_dora=True), "use_dora"),
        (str(tmp_path / "missing"), "is not a directory"),
    ]  # fmt: skip
    (tmp_path / "nofile").mkdir()
    (tmp_path / "nofile" / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA"}))
    cases.append((str(tmp_path / "nofile"), "adapter_model.safetensors"))
    for i, (bad_path, message) in enumerate(cases):
        with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
            engine.generate([prompt(5, seed=1)], GREEDY, lora_request=LoRARequest(f"bad{i}", 100 + i, bad_path))
    known = adapters["qwen3_5_moe"][0][1]
    engine.add_lora(known)
    with pytest.raises(ValueError, match="lora_int_id"):
        engine.add_lora(LoRARequest("other-name", known.lora_int_id, known.lora_path))
    with pytest.raises(ValueError, match="lora_name"):
        engine.add_lora(LoRARequest(known.lora_name, 999, known.lora_path))
    with pytest.raises(ValueError, match="lora_int_id"):
        LoRARequest("x", 0, "/tmp")
    # the engine keeps serving, adapters included
    _, lora, merged = adapters["qwen3_5_moe"][1]
    ids = prompt(11, seed=2)
    (out,) = engine.generate([ids], GREEDY, lora_request=lora, use_tqdm=False)
    assert tokens(out) == greedy(merged, ids, GREEDY.max_tokens)


def test_expert_adapters_refused_without_expert_slots(tiny_checkpoints, adapters):
    path, _ = tiny_checkpoints["qwen3_5_moe"]
    llm = make_llm(path, max_loras=1, enable_expert_lora=False)
    _, experts_lora, _ = adapters["qwen3_5_moe"][TARGET_SETS.index("experts")]
    with pytest.raises(ValueError, match="enable_expert_lora"):
        llm.add_lora(experts_lora)
    _, attention_lora, merged = adapters["qwen3_5_moe"][0]
    ids = prompt(8, seed=3)
    (out,) = llm.generate([ids], GREEDY, lora_request=attention_lora, use_tqdm=False)
    assert tokens(out) == greedy(merged, ids, GREEDY.max_tokens)


def test_load_and_unload_at_run_time(engine, adapters):
    _, lora, _ = adapters["qwen3_5_moe"][2]
    assert engine.add_lora(lora)
    assert engine.engine.lora_request(lora.lora_name) == lora
    assert engine.remove_lora(lora.lora_int_id)
    assert engine.engine.lora_request(lora.lora_name) is None
    assert not engine.remove_lora(lora.lora_int_id)
    assert lora.lora_int_id not in {r.lora_int_id for r in engine.list_loras()}


def test_lora_request_without_enable_lora(tiny_checkpoints, adapters):
    path, _ = tiny_checkpoints["qwen3_5"]
    llm = LLM(str(path), dtype="float32", device="cpu")
    with pytest.raises(ValueError, match="enable_lora"):
        llm.generate([prompt(4, seed=1)], GREEDY, lora_request=adapters["qwen3_5"][0][1])


def test_one_slot_two_adapters_take_turns(tiny_checkpoints, adapters):
    """max_loras=1: a request whose adapter finds the only slot pinned by another waits for it."""
    path, hf = tiny_checkpoints["qwen3_5"]
    llm = make_llm(path, max_loras=1)
    (_, a, merged_a), (_, b, merged_b) = adapters["qwen3_5"][:2]
    rows = [prompt(7, seed=50), prompt(10, seed=51), prompt(5, seed=52)]
    outs = llm.generate(rows, GREEDY, lora_request=[a, b, a], use_tqdm=False)
    refs = [merged_a, merged_b, merged_a]
    assert [tokens(o) for o in outs] == [greedy(m, ids, GREEDY.max_tokens) for m, ids in zip(refs, rows, strict=True)]


def test_lora_with_speculative_decoding_is_refused(tiny_checkpoints):
    path, _ = tiny_checkpoints["qwen3_5"]
    with pytest.raises(ValueError, match="enable_lora: not served together with speculative_config"):
        make_llm(path, speculative_config={"method": "mtp", "num_speculative_tokens": 2})
