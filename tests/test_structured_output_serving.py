"""Structured output behind the gRPC gateway and under tensor parallelism on a local Ray cluster (its
own file: the suite runs the files that start nothing on two workers, scripts/test)."""

from __future__ import annotations

import json

import grpc
import pytest
from test_gateway import CALL_TIMEOUT_S, LoopThread, start_served, stop_served
from test_structured_output import REGEXES, SCHEMAS, constrained, json_valid

from deltaserve import LLM, SamplingParams
from deltaserve.cluster.config import EngineConfig
from deltaserve.cluster.entrypoints.client import GenerationClient, generate_request
from deltaserve.protos import generation_pb2_grpc


@pytest.fixture(scope="module")
def llm(demo_llm):
    return demo_llm


def test_grpc_constrained_generation_and_invalid_argument(demo_path):
    aio = LoopThread()
    served = start_served(aio, EngineConfig.from_kwargs(model=demo_path))
    try:
        schema = SCHEMAS[0]
        with GenerationClient(served.target) as client:
            items = list(
                client.generate(
                    "gRPC:",
                    temperature=0,
                    max_tokens=64,
                    structured_outputs={"json": json.dumps(schema), "disable_any_whitespace": True},
                )
            )
            assert json_valid("".join(getattr(i, "text", "") for i in items), schema)
            stub = generation_pb2_grpc.GenerationStub(client.channel)
            for constraint, field in (
                ({"json": '{"type": "objekt"}'}, "structured_outputs.json"),
                ({"json": "{}", "regex": "a"}, "structured_outputs: give only one"),
                ({"disable_any_whitespace": True}, "structured_outputs: give one of"),
            ):
                with pytest.raises(grpc.RpcError) as error:
                    list(stub.Generate(generate_request("x", structured_outputs=constraint), timeout=CALL_TIMEOUT_S))
                assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert error.value.details().startswith(field), error.value.details()
    finally:
        stop_served(served)
        aio.close()


@pytest.mark.ray
def test_tensor_parallel_ranks_hold_their_own_matchers(ray_session, llm, demo_path):
    """TP = 2 over the shared-memory ring with async scheduling: each rank compiles, masks and
    advances its own matchers, rank 0 reports the grammars ready; the tokens are one rank's."""
    prompts = [f"Ranks {i}:" for i in range(6)]
    params = [constrained(i, json=SCHEMAS[i + 10], disable_any_whitespace=True) for i in range(4)]
    params += [constrained(4, regex=REGEXES[1]), SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)]
    reference = llm.generate(prompts, params, use_tqdm=False)
    parallel = LLM(demo_path, tensor_parallel_size=2, async_scheduling=True, max_num_seqs=8)
    try:
        outs = parallel.generate(prompts, params, use_tqdm=False)
    finally:
        parallel.shutdown()
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in reference]
