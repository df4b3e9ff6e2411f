"""Speculative decoding on a CUDA device (skipped on CPU): the Triton verify path (the recurrent kernel's
verify tables, the accept kernel, the paged-attention verify rows, the head's layer) and the
verify CUDA graphs give the tokens of decoding without speculation; float32 with IEEE dots, as the
engine's own graph test (bf16 rounding alone flips near-ties of these random tiny models)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from tiny_models import FAMILIES, VOCAB_SIZE

from deltaserve import LLM, SamplingParams
from deltaserve.bench.spec_drafts import ReferenceDrafter

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (the H200 runs these)"),
]

POOL = dict(num_kv_blocks=512)


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(23)
    return [torch.randint(3, VOCAB_SIZE, (n,), generator=g).tolist() for n in (1, 5, 17, 64, 65, 130, 9)]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("k", [1, 3, 8])
def test_verify_graphs_and_eager_give_plain_tokens(tiny_checkpoints, family, k, monkeypatch):
    monkeypatch.setenv("TRITON_F32_DEFAULT", "ieee")
    path = str(tiny_checkpoints[family][0])
    kw = dict(device="cuda", dtype="float32", max_num_seqs=16, **POOL)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    longer = dataclasses.replace(params, max_tokens=24 + 16)
    plain = [o.outputs[0].token_ids for o in LLM(path, **kw).generate(prompts(), longer, use_tqdm=False)]
    reference = {tuple(p): out for p, out in zip(prompts(), plain, strict=True)}
    spec = {"method": "mtp", "num_speculative_tokens": k}
    for eager in (True, False):
        llm = LLM(path, speculative_config=spec, enforce_eager=eager, **kw)
        assert (llm.engine.executor.runner.verify_graphs is None) == eager
        llm.engine.scheduler.drafter = ReferenceDrafter(reference, 0.7, VOCAB_SIZE, seed=k)
        out = [o.outputs[0].token_ids for o in llm.generate(prompts(), params, use_tqdm=False)]
        assert out == [t[:24] for t in plain]
        stats = llm.engine.speculative_stats()
        assert 0 < stats["num_accepted_tokens"] < stats["num_draft_tokens"]


def test_every_sampling_speculates_on_the_device(tiny_checkpoints, monkeypatch):
    """Constrained, penalised, min_tokens and biased requests beside plain greedy ones, with graphs on
    (their passes run eager): the tokens of decoding without speculation."""
    from deltaserve.cluster.core.sampling_params import StructuredOutputsParams

    monkeypatch.setenv("TRITON_F32_DEFAULT", "ieee")
    path = str(tiny_checkpoints["qwen3_5_moe"][0])
    kw = dict(device="cuda", dtype="float32", max_num_seqs=16, **POOL)
    greedy = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    params = [
        greedy,
        SamplingParams(temperature=0, max_tokens=20, structured_outputs=StructuredOutputsParams(regex="[a-z]{4,12}!")),
        SamplingParams(temperature=0.9, seed=2, max_tokens=20, ignore_eos=True, presence_penalty=1.5),
        SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logit_bias={7: 4.0}, frequency_penalty=1.0),
        SamplingParams(temperature=0, max_tokens=20, min_tokens=6, stop_token_ids=[13], logit_bias={13: 8.0}),
        greedy,
        SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, repetition_penalty=1.8),
    ]
    plain = LLM(path, **kw).generate(prompts(), params, use_tqdm=False)
    reference = {tuple(p): list(o.outputs[0].token_ids) + [0] * 16 for p, o in zip(prompts(), plain, strict=True)}
    llm = LLM(path, speculative_config={"method": "mtp", "num_speculative_tokens": 3}, **kw)
    llm.engine.scheduler.drafter = ReferenceDrafter(reference, 0.8, VOCAB_SIZE)
    out = llm.generate(prompts(), params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in out] == [o.outputs[0].token_ids for o in plain]
    assert llm.engine.speculative_stats()["num_accepted_tokens"] > 0
