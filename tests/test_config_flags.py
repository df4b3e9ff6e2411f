"""One configuration tree: every setting is a keyword argument and a flag with its help and default,
both reach the worker's sections, and a wrong name or value is an error naming it wherever it came from."""

# test phase: parallel ("ray" is an executor name here; nothing starts)

from __future__ import annotations

import argparse

import pytest

from deltaserve.cli import build_parser
from deltaserve.cluster.config import EngineConfig, add_engine_args, engine_kwargs, engine_settings
from deltaserve.cluster.entrypoints.cli import engine_config
from deltaserve.layers.kernels.options import KernelOptions


def parse(*argv: str) -> argparse.Namespace:
    return build_parser(["serve"]).parse_args(["serve", *argv])


def test_enforce_eager_reaches_the_worker(tmp_path):
    for argv, eager in (([], False), (["--enforce-eager"], True)):
        config = engine_config(parse("--model", str(tmp_path), *argv), "local")
        assert config.worker_config().runner.enforce_eager is eager
        assert EngineConfig.from_kwargs(model="m", enforce_eager=eager).worker_config().runner.enforce_eager is eager


def test_every_setting_is_a_kwarg_and_a_flag_with_help_and_default():
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    text = parser.format_help()
    flags = {opt for action in parser._actions for opt in action.option_strings}
    for f in engine_settings():
        assert f.metadata["help"], f.name
        if f.metadata["cli"]:
            flag = "--" + f.name.replace("_", "-")
            assert flag in flags, flag
    # every name is a keyword argument: the flat view of a config builds the same config
    kernels = KernelOptions(pdl=False)
    config = EngineConfig.from_kwargs(model="m", max_num_seqs=8, tensor_parallel_size=2, kernels=kernels)
    flat = config.to_kwargs()
    assert set(flat) == {f.name for f in engine_settings()}
    assert EngineConfig.from_kwargs(**flat) == config
    assert "(default: 64)" in text and "(default: 0.9)" in text
    assert {"--tp", "--ep"} <= flags


def test_flags_give_the_same_tree_as_kwargs(tmp_path):
    argv = ["--model", str(tmp_path), "--tp", "2", "--ep", "--max-num-seqs", "8", "--block-size", "32",
            "--dtype", "float32", "--no-async-scheduling", "--no-enable-chunked-prefill", "--max-model-len", "512",
            "--gpu-memory-utilization", "0.5", "--max-waiting-requests", "3",
            "--cuda-graph-max-batch", "64", "--dp", "2", "--routing", "prefix_aware"]  # fmt: skip
    from_flags = engine_config(parse(*argv), "ray")
    from_kwargs = EngineConfig.from_kwargs(
        model=str(tmp_path), tensor_parallel_size=2, enable_expert_parallel=True, max_num_seqs=8, block_size=32,
        dtype="float32", async_scheduling=False, enable_chunked_prefill=False, max_model_len=512,
        gpu_memory_utilization=0.5, max_waiting_requests=3, cuda_graph_max_batch=64, executor="ray",
        data_parallel_size=2, routing="prefix_aware",
    )  # fmt: skip
    assert from_flags == from_kwargs
    # flags not given keep the fields' defaults (the namespace holds only what was given)
    assert engine_kwargs(parse("--model", "x")) == {"model": "x"}


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"max_num_seqs": 0}, "max_num_seqs"),
        ({"max_num_seqs": "8"}, "max_num_seqs"),
        ({"tensor_parallel_size": 0}, "tensor_parallel_size"),
        ({"enable_expert_parallel": "yes"}, "enable_expert_parallel"),
        ({"dtype": "int8"}, "dtype"),
        ({"device": "tpu"}, "device"),
        ({"load_format": "gguf"}, "load_format"),
        ({"gpu_memory_utilization": 1.5}, "gpu_memory_utilization"),
        ({"gpu_memory_utilization": float("nan")}, "gpu_memory_utilization"),
        ({"num_kv_blocks": 1}, "num_kv_blocks"),
        ({"block_size": -4}, "block_size"),
        ({"max_model_len": 1}, "max_model_len"),
        ({"max_waiting_requests": 0}, "max_waiting_requests"),
        ({"executor": "slurm"}, "executor"),
        ({"executor": "local", "tensor_parallel_size": 2}, "executor"),
        ({"data_parallel_size": 0}, "data_parallel_size"),
        ({"routing": "random"}, "routing"),
        ({"replica_down_after_s": 0.1}, "replica_down_after_s"),
        ({"executor": "local", "data_parallel_size": 2}, "executor"),
        ({"kernels": "fast"}, "kernels"),
        ({"max_num_sequences": 8}, "max_num_sequences"),
    ],
)
def test_wrong_settings_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=f"^{field}:"):
        EngineConfig.from_kwargs(**kwargs)


def test_wrong_values_name_the_field_from_every_door(tmp_path):
    from deltaserve import LLM

    with pytest.raises(ValueError, match="^max_num_seqs:"):
        engine_config(parse("--model", str(tmp_path), "--max-num-seqs", "0"), "local")
    with pytest.raises(ValueError, match="^max_num_seqs:"):
        LLM(str(tmp_path), max_num_seqs=0)  # before anything loads
    with pytest.raises(ValueError, match="^max_num_sequences:"):
        LLM(str(tmp_path), max_num_sequences=8)
    with pytest.raises(ValueError, match="^data_parallel_size: LLM runs one engine"):
        LLM(str(tmp_path), data_parallel_size=2)
    with pytest.raises(ValueError, match="^max_num_seqs:"):
        EngineConfig().replace(max_num_seqs=-1)
    with pytest.raises(ValueError, match="^max_num_sequences:"):
        EngineConfig().replace(max_num_sequences=1)
    with pytest.raises(ValueError, match="^max_num_seqs: must be an integer, got 'aaaaa"):
        EngineConfig.from_kwargs(max_num_seqs="a" * 200)  # the value is cut short


def test_kernel_options_are_read_once_when_the_config_is_built(monkeypatch):
    monkeypatch.setenv("DELTASERVE_PDL", "0")
    monkeypatch.setenv("DELTASERVE_FUSED_GDN_MAX_SEQS", "3")
    config = EngineConfig.from_kwargs(model="m")
    monkeypatch.setenv("DELTASERVE_PDL", "1")
    kernels = config.worker_config().runner.kernels
    assert (kernels.pdl, kernels.fused_gdn_max_seqs) == (False, 3)
    given = KernelOptions(row_gemv=False)
    assert EngineConfig.from_kwargs(kernels=given).runner.kernels is given
    monkeypatch.setenv("DELTASERVE_FUSED_GDN_MAX_SEQS", "-1")
    with pytest.raises(ValueError, match="fused_gdn_max_seqs"):
        EngineConfig.from_kwargs()


def test_replace_keeps_the_rest():
    config = EngineConfig.from_kwargs(model="m", max_num_seqs=8, enforce_eager=True)
    changed = config.replace(max_model_len=100)
    assert changed.scheduler.max_model_len == 100
    assert (changed.scheduler.max_num_seqs, changed.runner, changed.load) == (8, config.runner, config.load)
