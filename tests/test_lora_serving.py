"""Adapters over gRPC: `lora_name` selects a loaded adapter (its stream equals LLM.generate on that
adapter), an unknown name is NOT_FOUND, a bad adapter at load time is INVALID_ARGUMENT naming the
file, adapters load and unload at run time; over HTTP the OpenAI `model` field names the adapter (as
vLLM), /v1/models lists it beside the base model, an unknown name is a 404; `serve --lora-modules`
refuses a bad adapter before starting (exit status 2, one line naming the flag)."""

from __future__ import annotations

import subprocess
import sys

import grpc
import httpx
import openai
import pytest
from lora_adapters import peft_adapter
from test_gateway import LoopThread, start_served, stop_served
from test_http_limits import Served
from test_model_vs_transformers import prompt

from deltaserve import LLM, LoRARequest, SamplingParams
from deltaserve.cluster.config import EngineConfig
from deltaserve.cluster.entrypoints.client import GenerationClient
from deltaserve.cluster.entrypoints.front_doors import FrontDoors

pytestmark = pytest.mark.timeout(120)

GREEDY = dict(temperature=0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def setup(tiny_checkpoints, tmp_path_factory):
    path, hf = tiny_checkpoints["qwen3_5_moe"]
    root = tmp_path_factory.mktemp("grpc-lora")
    peft_adapter(hf, "qwen3_5_moe", "all", root / "all", seed=3)
    peft_adapter(hf, "qwen3_5_moe", "attention", root / "attention", seed=4)
    aio = LoopThread()
    config = EngineConfig.from_kwargs(model=str(path), enable_lora=True, max_loras=2, max_lora_rank=8)
    served = start_served(aio, config)
    yield served, path, root
    stop_served(served)
    aio.close()


def test_grpc_adapters(setup):
    served, path, root = setup
    ids = prompt(12, seed=9)
    with GenerationClient(served.target) as client:
        loaded = client.load_lora_adapter("all", str(root / "all"))
        assert loaded.lora_name == "all" and loaded.lora_int_id >= 1
        streamed = [
            t for item in client.generate(ids, lora_name="all", **GREEDY) for t in getattr(item, "token_ids", [])
        ]
        base = [t for item in client.generate(ids, **GREEDY) for t in getattr(item, "token_ids", [])]
        with pytest.raises(grpc.RpcError) as err:
            list(client.generate(ids, lora_name="nope", **GREEDY))
        assert err.value.code() == grpc.StatusCode.NOT_FOUND and "lora_name" in err.value.details()
        with pytest.raises(grpc.RpcError) as err:
            client.load_lora_adapter("bad", str(root / "missing"))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "missing" in err.value.details()
        client.load_lora_adapter("attention", str(root / "attention"))
        assert {a.lora_name for a in client.list_lora_adapters()} == {"all", "attention"}
        client.unload_lora_adapter("attention")
        with pytest.raises(grpc.RpcError) as err:
            client.unload_lora_adapter("attention")
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
        assert [a.lora_name for a in client.list_lora_adapters()] == ["all"]
    llm = LLM(str(path), enable_lora=True, max_lora_rank=8)
    (out,) = llm.generate([ids], SamplingParams(**GREEDY), lora_request=LoRARequest("all", 1, str(root / "all")))
    assert streamed == list(out.outputs[0].token_ids)
    assert streamed != base


def test_http_model_names_the_adapter(setup):
    _, path, root = setup
    ids = prompt(12, seed=9)
    config = EngineConfig.from_kwargs(
        model=str(path), served_model_name="base", enable_lora=True, max_loras=2, max_lora_rank=8
    )
    served = Served(config, FrontDoors(host="127.0.0.1", grpc_port=None, http_port=0, grace_s=1))
    try:
        served.run(served.stack.engine.load_lora("sql", str(root / "all")))
        client = openai.OpenAI(base_url=served.url() + "/v1", api_key="unused", max_retries=0, timeout=60)
        cards = {card.id: card for card in client.models.list().data}
        assert set(cards) == {"base", "sql"}
        assert (cards["sql"].parent, cards["sql"].root) == ("base", str(root / "all"))
        body = dict(prompt=ids, max_tokens=6, temperature=0, extra_body={"ignore_eos": True, "return_token_ids": True})
        on_adapter = client.completions.create(model="sql", **body)
        base = client.completions.create(model="base", **body)
        with pytest.raises(openai.NotFoundError) as err:
            client.completions.create(model="nope", **body)
        assert err.value.body["param"] == "model" and err.value.body["code"] == "model_not_found"
        runtime_routes(served.url(), client, body, root, on_adapter.choices[0].token_ids)
    finally:
        served.stop()
    llm = LLM(str(path), enable_lora=True, max_lora_rank=8)
    (out,) = llm.generate([ids], SamplingParams(**GREEDY), lora_request=LoRARequest("sql", 1, str(root / "all")))
    assert on_adapter.model == "sql"
    assert on_adapter.choices[0].token_ids == list(out.outputs[0].token_ids)
    assert on_adapter.choices[0].token_ids != base.choices[0].token_ids


def runtime_routes(url: str, client, body: dict, root, sql_tokens: list[int]) -> None:
    """vLLM's POST /v1/load_lora_adapter and /v1/unload_lora_adapter: the same adapter loaded under a
    second name gives the first one's tokens; a name loaded twice, a missing folder and a missing field
    are 400s naming the field or file; an unloaded name is then a 404, and unloading it again too."""
    post = lambda route, payload: httpx.post(f"{url}/v1/{route}", json=payload, timeout=60)  # noqa: E731
    answer = post("load_lora_adapter", {"lora_name": "sql2", "lora_path": str(root / "all")})
    assert answer.status_code == 200 and "sql2" in answer.text, answer.text
    assert "sql2" in {card.id for card in client.models.list().data}
    assert client.completions.create(model="sql2", **body).choices[0].token_ids == sql_tokens
    again = post("load_lora_adapter", {"lora_name": "sql2", "lora_path": str(root / "all")})
    assert again.status_code == 400 and again.json()["error"]["param"] == "lora_name", again.text
    missing = post("load_lora_adapter", {"lora_name": "gone", "lora_path": str(root / "missing")})
    assert missing.status_code == 400 and "missing" in missing.json()["error"]["message"], missing.text
    no_path = post("load_lora_adapter", {"lora_name": "x"})
    assert no_path.status_code == 400 and no_path.json()["error"]["param"] == "lora_path", no_path.text
    gone = post("unload_lora_adapter", {"lora_name": "sql2"})
    assert gone.status_code == 200 and "removed" in gone.text, gone.text
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="sql2", **body)
    twice = post("unload_lora_adapter", {"lora_name": "sql2"})
    assert twice.status_code == 404 and twice.json()["error"]["param"] == "lora_name", twice.text


def test_serve_refuses_a_bad_lora_module(tiny_checkpoints, tmp_path):
    path, _ = tiny_checkpoints["qwen3_5"]
    cmd = [sys.executable, "-m", "deltaserve.cli", "serve", "--model", str(path), "--backend", "local", "--port", "0"]
    bad = subprocess.run(
        [*cmd, "--enable-lora", "--lora-modules", f"x={tmp_path}/none"], capture_output=True, text=True, timeout=60
    )
    assert bad.returncode == 2
    assert "--lora-modules 'x'" in bad.stderr and "is not a directory" in bad.stderr
    off = subprocess.run([*cmd, "--lora-modules", f"x={tmp_path}"], capture_output=True, text=True, timeout=60)
    assert off.returncode == 2 and "--enable-lora" in off.stderr
