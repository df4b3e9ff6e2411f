"""The start-up warm-up on a CUDA device (skipped on CPU): an engine with LoRA adapters, and one with
speculative decoding, compile no Triton kernel while serving their first requests (prompts of several
lengths, adapter and base rows, greedy and sampled rows with logprobs). Every kernel's in-process
cache is emptied before each engine starts, as in a fresh worker (other engines in this process
compiled kernels already)."""

from __future__ import annotations

import gc

import pytest
import torch
from lora_adapters import peft_adapter
from test_model_vs_transformers import prompt

from deltaserve import LLM, LoRARequest, SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (the H200 runs these)"),
]

# None: pool sizes from the profiling pass (the warm-up on its pool); given: the warm-up on the new pools
POOLS = [None, 512]


def forget_compiled_kernels() -> None:
    """Empty every Triton kernel's in-process cache: the next launch of each goes through the compile
    hooks again."""
    from triton.runtime.jit import JITFunction

    for obj in gc.get_objects():
        if isinstance(obj, JITFunction):
            obj.device_caches.clear()


def params(n: int) -> list[SamplingParams]:
    return [
        SamplingParams(temperature=0, max_tokens=n, ignore_eos=True),
        SamplingParams(temperature=0.8, top_k=20, top_p=0.9, max_tokens=n, ignore_eos=True, seed=3, logprobs=2),
        SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, repetition_penalty=1.3),
        SamplingParams(temperature=0.7, max_tokens=n, ignore_eos=True),
    ]


def late(llm: LLM) -> list[str]:
    return [r for r, _ in llm.engine.executor.runner.late_compiles.events]


@pytest.mark.parametrize("blocks", POOLS)
def test_lora_first_requests_compile_nothing(tiny_checkpoints, tmp_path, blocks):
    path, hf = tiny_checkpoints["qwen3_5_moe"]
    loras = []
    for i, which in enumerate(("all", "experts", "attention")):
        peft_adapter(hf, "qwen3_5_moe", which, tmp_path / which, seed=i)
        loras.append(LoRARequest(which, i + 1, str(tmp_path / which)))
    forget_compiled_kernels()
    pool = {} if blocks is None else {"num_kv_blocks": blocks}
    llm = LLM(str(path), device="cuda", enable_lora=True, max_loras=4, max_lora_rank=8, max_num_seqs=16, **pool)
    assert late(llm) == []
    prompts = [prompt(n, seed=n) for n in (1, 5, 17, 64, 65, 130, 9, 300)]
    rows = [loras[0], None, loras[1], loras[2], loras[0], None, loras[1], loras[2]]
    for one in (0, None):  # one adapter alone, then adapters and base rows mixed
        outs = llm.generate(
            prompts, [params(6)[i % 4] for i in range(len(prompts))],
            lora_request=[loras[0]] * len(prompts) if one == 0 else rows, use_tqdm=False,
        )  # fmt: skip
        assert all(len(o.outputs[0].token_ids) == 6 for o in outs)
    assert late(llm) == []


@pytest.mark.parametrize("blocks", POOLS)
@pytest.mark.parametrize("k", [1, 3])
def test_spec_first_requests_compile_nothing(tiny_checkpoints, blocks, k):
    path, _ = tiny_checkpoints["qwen3_5_moe"]
    forget_compiled_kernels()
    pool = {} if blocks is None else {"num_kv_blocks": blocks}
    spec = {"method": "mtp", "num_speculative_tokens": k}
    llm = LLM(str(path), device="cuda", speculative_config=spec, max_num_seqs=16, **pool)
    prompts = [prompt(n, seed=n) for n in (1, 5, 17, 64, 65, 130, 9, 300)]
    outs = llm.generate(prompts, [params(12)[i % 4] for i in range(len(prompts))], use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 12 for o in outs)
    assert llm.engine.speculative_stats()["num_draft_tokens"] > 0
    assert late(llm) == []
