"""Adapters over gRPC: `lora_name` selects a loaded adapter (its stream equals LLM.generate on that
adapter), an unknown name is NOT_FOUND, a bad adapter at load time is INVALID_ARGUMENT naming the
file, adapters load and unload at run time; `serve --lora-modules` refuses a bad adapter before
starting (exit status 2, one line naming the flag)."""

from __future__ import annotations

import subprocess
import sys

import grpc
import pytest
from lora_adapters import peft_adapter
from test_gateway import LoopThread, start_served, stop_served
from test_model_vs_transformers import prompt

from deltaserve import LLM, LoRARequest, SamplingParams
from deltaserve.cluster.config import EngineConfig
from deltaserve.cluster.entrypoints.client import GenerationClient

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
