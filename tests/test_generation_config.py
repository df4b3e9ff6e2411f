"""The model's recommended sampling (generation_config.json), as vLLM applies it: requests that leave
temperature, top_p, top_k, min_p or repetition_penalty unset take the checkpoint's values, over HTTP
(completions, chat), gRPC and `LLM.generate` without SamplingParams; what a request sets wins;
`generation_config="vllm"` takes none, a folder takes its file's, `override_generation_config`
replaces entries; bad values are errors naming the setting."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import httpx
import pytest

from deltaserve import LLM, SamplingParams
from deltaserve.cluster.config import EngineConfig
from deltaserve.cluster.core.sampling_params import generation_defaults
from deltaserve.cluster.entrypoints.client import Chunk, GenerationClient
from deltaserve.cluster.entrypoints.front_doors import FrontDoors

sys.path.insert(0, str(Path(__file__).parent))
from test_http_limits import MODEL, Served  # noqa: E402

pytestmark = pytest.mark.timeout(120)

# top_k 1 makes any temperature greedy: a request that takes the default gives the greedy tokens
RECOMMENDED = {"temperature": 0.7, "top_k": 1, "top_p": 0.9, "do_sample": True, "max_new_tokens": 32768}


@pytest.fixture(scope="module")
def recommending(tiny_chat_model, tmp_path_factory) -> Path:
    """The tiny chat model with a generation_config.json that recommends sampling."""
    path = tmp_path_factory.mktemp("recommending") / "model"
    shutil.copytree(tiny_chat_model, path)
    gen = path / "generation_config.json"
    data = json.loads(gen.read_text()) if gen.is_file() else {}
    gen.write_text(json.dumps({**data, **RECOMMENDED}))
    return path


def test_the_defaults_come_from_the_file_the_folder_and_the_overrides(recommending, tmp_path):
    want = {"temperature": 0.7, "top_k": 1, "top_p": 0.9}  # do_sample and max_new_tokens are not sampling defaults
    assert generation_defaults(str(recommending)) == want
    assert generation_defaults(str(recommending), "vllm") == {}
    assert generation_defaults(str(recommending), "vllm", {"temperature": 0.2}) == {"temperature": 0.2}
    assert generation_defaults(str(recommending), overrides={"top_k": 5, "min_p": 0.1}) == {**want, "top_k": 5,
                                                                                            "min_p": 0.1}  # fmt: skip
    other = tmp_path / "other"
    other.mkdir()
    (other / "generation_config.json").write_text(json.dumps({"repetition_penalty": 1.1}))
    assert generation_defaults(str(recommending), str(other)) == {"repetition_penalty": 1.1}
    assert generation_defaults(str(tmp_path / "no-file")) == {}  # auto: a checkpoint without one
    with pytest.raises(ValueError, match="^generation_config: no generation_config.json in"):
        generation_defaults(str(recommending), str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="^override_generation_config: unknown key 'max_tokens'"):
        generation_defaults(str(recommending), overrides={"max_tokens": 5})
    with pytest.raises(ValueError, match="^generation_config: temperature"):
        generation_defaults(str(recommending), overrides={"temperature": -1.0})
    (other / "generation_config.json").write_text("{not json")
    with pytest.raises(ValueError, match="^generation_config: .* is not JSON"):
        generation_defaults(str(recommending), str(other))
    with pytest.raises(ValueError, match="override_generation_config"):
        EngineConfig.from_kwargs(model=str(recommending), override_generation_config="[1, 2]")


def test_llm_generate_without_params_takes_the_recommendation(recommending):
    llm = LLM(str(recommending))
    try:
        assert llm.get_default_sampling_params() == SamplingParams(temperature=0.7, top_k=1, top_p=0.9)
        prompt = [[5, 6, 7, 8]]
        default = llm.generate(prompt, use_tqdm=False)[0].outputs[0].token_ids
        greedy = llm.generate(prompt, SamplingParams(temperature=0), use_tqdm=False)[0].outputs[0].token_ids
        assert default == greedy  # top_k 1: the recommendation is greedy here
    finally:
        llm.shutdown()
    plain = LLM(str(recommending), generation_config="vllm")
    try:
        assert plain.get_default_sampling_params() == SamplingParams()
    finally:
        plain.shutdown()


@pytest.fixture(scope="module")
def served(recommending):
    doors = FrontDoors(host="127.0.0.1", grpc_port=0, http_port=0, grace_s=1)
    server = Served(EngineConfig.from_kwargs(model=str(recommending), served_model_name=MODEL), doors)
    yield server
    server.stop()


def test_http_and_grpc_requests_take_what_they_leave_unset(served):
    url = served.url()
    body = {"model": MODEL, "prompt": "the defaults", "max_tokens": 12, "ignore_eos": True, "seed": 3}

    def completion(**extra) -> str:
        response = httpx.post(f"{url}/v1/completions", json={**body, **extra}, timeout=60)
        assert response.status_code == 200, response.text
        return response.json()["choices"][0]["text"]

    greedy = completion(temperature=0)
    assert completion() == greedy  # top_k 1 from the file
    assert completion(top_k=-1, temperature=1.0) != greedy  # what the request sets wins
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 12, "ignore_eos": True}
    answers = [
        httpx.post(f"{url}/v1/chat/completions", json={**chat, **extra}, timeout=60).json()["choices"][0]["message"]
        for extra in ({}, {"temperature": 0})
    ]
    assert answers[0] == answers[1]
    client = GenerationClient(f"127.0.0.1:{served.stack.ports['grpc']}")

    def tokens(**sampling) -> list[int]:
        chunks = [c for c in client.generate([1, 2, 3, 4], max_tokens=12, ignore_eos=True, **sampling)]
        return [t for c in chunks if isinstance(c, Chunk) for t in c.token_ids]

    try:
        default = tokens(seed=3)
        assert len(default) == 12 and default == tokens(temperature=0)
        assert default != tokens(seed=3, top_k=-1, temperature=1.0)
    finally:
        client.close()
