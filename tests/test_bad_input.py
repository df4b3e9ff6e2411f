"""Bad input raises ValueError naming the field, before anything is queued, and leaves the engine
serving."""

from __future__ import annotations

import pytest
import torch
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


def test_max_tokens_beyond_max_model_len_is_refused(llm):
    """A 60-token prompt leaves 4 tokens of max_model_len=64: asking for 20 is an error naming max_tokens
    (as vLLM's server answers); None asks for as many as fit, and those stop with "length"."""
    with pytest.raises(ValueError, match=r"^max_tokens: 20 .* max_model_len=64 \(at most 4 fit"):
        llm.generate([[9] * 60], SamplingParams(max_tokens=20), use_tqdm=False)
    for max_tokens in (None, 4):
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        (out,) = llm.generate([[9] * 60], params, use_tqdm=False)
        assert len(out.outputs[0].token_ids) == 4 and out.outputs[0].finish_reason == "length"
    with pytest.raises(ValueError, match="^min_tokens:"):
        llm.generate([[9] * 60], SamplingParams(max_tokens=None, min_tokens=5), use_tqdm=False)


@pytest.mark.parametrize("prompts", [123, None, 1.5, [[1, 2], 7], [None]])
def test_prompts_of_the_wrong_type_name_the_field(llm, prompts):
    with pytest.raises(ValueError, match="^prompts?:"):
        llm.generate(prompts, SamplingParams(max_tokens=2), use_tqdm=False)
    assert not llm.engine.has_unfinished()


def test_sampling_params_of_the_wrong_type_name_the_field(llm):
    with pytest.raises(ValueError, match="^sampling_params:"):
        llm.generate([[5, 6]], {"max_tokens": 2}, use_tqdm=False)


def test_long_values_are_not_echoed_back():
    with pytest.raises(ValueError, match="^stop:") as e:
        SamplingParams(stop=["x" * 20_000])
    assert len(str(e.value)) < 200


def test_stop_token_id_messages_state_the_range():
    with pytest.raises(ValueError, match=r"^stop_token_ids: id -1 is outside the token ids \(>= 0\)$"):
        SamplingParams(stop_token_ids=[-1])
    with pytest.raises(ValueError, match="^max_tokens:"):
        SamplingParams(max_tokens=True)


def test_cuda_device_without_a_gpu_names_the_device(tiny_checkpoints):
    if torch.cuda.is_available():
        pytest.skip("this torch sees a GPU")
    with pytest.raises(ValueError, match="^device: 'cuda' needs a GPU, and this torch"):
        LLM(str(tiny_checkpoints["qwen3_next"][0]), device="cuda")
