"""Bad input raises ValueError naming the field, before anything is queued, and leaves the engine
serving."""

from __future__ import annotations

import pytest
from tiny_models import VOCAB_SIZE

from deltaserve import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm(tiny_checkpoints):
    return LLM(str(tiny_checkpoints["qwen3_next"][0]), max_model_len=64)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"min_p": 2.0}, "min_p"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"presence_penalty": 3.0}, "presence_penalty"),
        ({"frequency_penalty": -2.5}, "frequency_penalty"),
        ({"logprobs": 50}, "logprobs"),
        ({"prompt_logprobs": -1}, "prompt_logprobs"),
        ({"stop": [""]}, "stop"),
        ({"stop": ["x"] * 40}, "stop"),
        ({"seed": -1}, "seed"),
        ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"),
        ({"n": 2}, "n"),
    ],
)
def test_sampling_params_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=f"^{field}:"):
        SamplingParams(**kwargs)


@pytest.mark.parametrize(
    "prompt, field",
    [
        ("", "prompt"),
        ([], "prompt"),
        ([5, VOCAB_SIZE], "prompt_token_ids"),
        ([5, -1], "prompt_token_ids"),
        ([7] * 64, "prompt"),
    ],
)
def test_bad_prompts_name_the_field(llm, prompt, field):
    with pytest.raises(ValueError, match=f"^{field}:"):
        llm.generate([prompt], SamplingParams(max_tokens=2), use_tqdm=False)


def test_stop_token_id_outside_vocab(llm):
    with pytest.raises(ValueError, match="^stop_token_ids:"):
        llm.generate([[5, 6]], SamplingParams(stop_token_ids=[VOCAB_SIZE + 3]), use_tqdm=False)


def test_one_bad_prompt_queues_nothing_and_engine_keeps_serving(llm):
    with pytest.raises(ValueError, match="prompt_token_ids"):
        llm.generate([[5, 6, 7], [5, VOCAB_SIZE + 1]], SamplingParams(max_tokens=2), use_tqdm=False)
    assert not llm.engine.has_unfinished()
    (out,) = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True), use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 3


def test_generation_stops_at_max_model_len(llm):
    (out,) = llm.generate([[9] * 60], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True), use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 4 and out.outputs[0].finish_reason == "length"
