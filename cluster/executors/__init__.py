"""Executors: where pass plans run. `local` (the model in this process) and `ray` (a worker group of
Ray actors, plans over a shared-memory ring or a compiled graph); `make_executor` picks one."""

from __future__ import annotations

from deltaserve.cluster.config import EngineConfig
from deltaserve.layers.config import ModelConfig

from .base import Executor


def runs_in_process(config: EngineConfig) -> bool:
    """Whether the model runs in the engine's own process ("auto": for one rank) rather than on Ray workers."""
    single = config.parallel.tensor_parallel_size == 1 and not config.parallel.enable_expert_parallel
    return config.executor == "local" or (config.executor == "auto" and single)


def make_executor(config: EngineConfig, model_config: ModelConfig) -> Executor:
    """The executor `config.executor` asks for ("auto": in-process for one rank, else Ray)."""
    if runs_in_process(config):
        from .local import LocalExecutor  # imports torch and the model: only when used

        return LocalExecutor(config, model_config)
    from .ray import RayExecutor

    return RayExecutor(config, model_config)
