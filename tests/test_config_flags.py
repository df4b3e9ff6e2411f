"""Engine flags reach the runner (the CUDA-graph switch was once dropped on the way)."""

from __future__ import annotations

from deltaserve.cli import build_parser
from deltaserve.cluster.config import EngineConfig, runner_config
from deltaserve.cluster.entrypoints.cli import engine_config


def test_cuda_graph_flag_reaches_the_runner():
    for enabled in (True, False):
        config = EngineConfig(model="m", enable_cuda_graphs=enabled)
        assert runner_config(config).enable_cuda_graphs is enabled


def test_cli_enforce_eager_turns_graphs_off(tmp_path):
    for argv, enabled in (
        (["serve", "--model", str(tmp_path)], True),
        (["serve", "--model", str(tmp_path), "--enforce-eager"], False),
    ):
        args = build_parser().parse_args(argv)
        assert engine_config(args, "local").enable_cuda_graphs is enabled
