"""Bad input raises ValueError naming the field, before anything is queued, and leaves the engine
serving."""

from __future__ import annotations

import math

import pytest
import torch
from tiny_models import VOCAB_SIZE

from deltaserve import LLM, SamplingParams
from deltaserve.cluster.core.request import top_logprobs


@pytest.fixture(scope="module")
def llm(tiny_checkpoints):
    return LLM(str(tiny_checkpoints["qwen3_next"][0]), max_model_len=64)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"temperature": float("inf")}, "temperature"),
        ({"temperature": 1e300}, "temperature"),  # finite in float64, inf in the sampler's float32
        ({"temperature": "0.5"}, "temperature"),
        ({"top_p": float("nan")}, "top_p"),
        ({"min_p": float("inf")}, "min_p"),
        ({"repetition_penalty": float("inf")}, "repetition_penalty"),
        ({"repetition_penalty": 1e39}, "repetition_penalty"),
        ({"presence_penalty": float("-inf")}, "presence_penalty"),
        ({"frequency_penalty": float("nan")}, "frequency_penalty"),
        ({"top_k": 2**31}, "top_k"),
        ({"top_k": True}, "top_k"),
        ({"stop": 5}, "stop"),
        ({"stop_token_ids": 5}, "stop_token_ids"),
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
        ({"n": 0}, "n"),
        ({"n": 129}, "n"),
        ({"n": True}, "n"),
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
        ([5, True], "prompt_token_ids"),  # a bool is no token id, though it is an int
        ([5, 6.0], "prompt_token_ids"),
        ([5, 2**63], "prompt_token_ids"),  # past int64: the array check overflows, the loop names it
        ([5, "6"], "prompt_token_ids"),
        ([7] * 64, "prompt"),
    ],
)
def test_bad_prompts_name_the_field(llm, prompt, field):
    with pytest.raises(ValueError, match=f"^{field}:"):
        llm.generate([prompt], SamplingParams(max_tokens=2), use_tqdm=False)


def test_a_checked_prompt_keeps_its_ids_as_int32(llm):
    """The engine's prompt check hands the request its ids as an int32 array, which the plan's input ids
    and the block hashes are sliced from: the same ids as the list."""
    ids = [5, 0, VOCAB_SIZE - 1, 17, 3]
    req = llm.engine.make_request("as-int32", ids, SamplingParams(max_tokens=2))
    assert str(req.prompt_array.dtype) == "int32"
    assert req.prompt_array.tolist() == ids and req.token_array(1, 4).tolist() == ids[1:4]


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


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"stop": ["x" * 20_000]}, "stop"),
        ({"stop": [["x"] * 20_000]}, "stop"),
        ({"n": 10**5000}, "n"),  # str() of an int this long raises (4300 digits at most)
        ({"min_tokens": 10**5000}, "min_tokens"),
        ({"max_tokens": 10**5000, "min_tokens": 10**5001}, "min_tokens"),
        ({"top_k": -(10**5000)}, "top_k"),
        ({"seed": 10**5000}, "seed"),
        ({"logprobs": "x" * 20_000}, "logprobs"),
        ({"stop_token_ids": [10**5000]}, "stop_token_ids"),
    ],
)
def test_long_values_are_not_echoed_back(kwargs, field):
    with pytest.raises(ValueError, match=f"^{field}:") as e:
        SamplingParams(**kwargs)
    assert len(str(e.value)) < 200


def test_huge_numbers_in_a_request_are_not_echoed_back(llm):
    for params, field in [
        (SamplingParams(max_tokens=10**5000), "max_tokens"),
        (SamplingParams(min_tokens=10**5000, max_tokens=None), "min_tokens"),
    ]:
        with pytest.raises(ValueError, match=f"^{field}:") as e:
            llm.generate([[5, 6]], params, use_tqdm=False)
        assert len(str(e.value)) < 200
    with pytest.raises(ValueError, match="^prompt_token_ids:") as e:
        llm.generate([[5, 10**5000]], SamplingParams(max_tokens=2), use_tqdm=False)
    assert len(str(e.value)) < 200


@pytest.mark.parametrize("temperature", [1e-40, 1e-300, 5e-6])
def test_temperature_below_1e_5_is_greedy(llm, temperature):
    """vLLM's greedy threshold: a tiny temperature gives the greedy tokens, not "every token id 0"."""
    prompts = [[5, 6, 7], [40, 41, 42, 43]]
    greedy = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    params = SamplingParams(temperature=temperature, max_tokens=6, ignore_eos=True)
    assert params.greedy
    tiny = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in tiny] == [o.outputs[0].token_ids for o in greedy]
    assert any(t != 0 for o in tiny for t in o.outputs[0].token_ids)


def test_extreme_but_valid_values_generate(llm):
    """Values at the edges of their ranges run (a top_k past the vocabulary keeps every token)."""
    prompt = [[9, 10, 11]]
    base = dict(temperature=0.9, seed=11, max_tokens=6, ignore_eos=True)
    (unfiltered,) = llm.generate(prompt, SamplingParams(**base), use_tqdm=False)
    (big_k,) = llm.generate(prompt, SamplingParams(**base, top_k=2**31 - 1), use_tqdm=False)
    assert big_k.outputs[0].token_ids == unfiltered.outputs[0].token_ids
    extremes = SamplingParams(
        temperature=3e38,
        top_p=1e-300,
        min_p=1.0,
        repetition_penalty=3e38,
        presence_penalty=2.0,
        frequency_penalty=-2.0,
        max_tokens=6,
        ignore_eos=True,
        logprobs=20,
        prompt_logprobs=20,
        seed=2**63 - 1,
    )
    (out,) = llm.generate(prompt, extremes, use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 6
    for entry in out.outputs[0].logprobs + out.prompt_logprobs[1:]:
        assert len(top_logprobs(entry, 20)) == 20 and all(math.isfinite(lp.logprob) for lp in entry.values())


def test_stop_token_id_messages_state_the_range():
    with pytest.raises(ValueError, match=r"^stop_token_ids: id -1 is outside the token ids \[0, 2\*\*31\)$"):
        SamplingParams(stop_token_ids=[-1])
    with pytest.raises(ValueError, match="^max_tokens:"):
        SamplingParams(max_tokens=True)


def test_cuda_device_without_a_gpu_names_the_device(tiny_checkpoints):
    if torch.cuda.is_available():
        pytest.skip("this torch sees a GPU")
    with pytest.raises(ValueError, match="^device: 'cuda' needs a GPU, and this torch"):
        LLM(str(tiny_checkpoints["qwen3_next"][0]), device="cuda")
