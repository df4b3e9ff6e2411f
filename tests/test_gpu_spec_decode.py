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
