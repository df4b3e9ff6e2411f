"""Building an engine: the model's config, the executor the settings ask for, and the EngineCore over it."""

from __future__ import annotations

from deltaserve.cluster.config import EngineConfig
from deltaserve.cluster.core.engine import EngineCore
from deltaserve.cluster.executors import make_executor
from deltaserve.cluster.executors.base import Executor
from deltaserve.layers.config import ModelConfig


def build_engine(
    config: EngineConfig,
    *,
    model_config: ModelConfig | None = None,
    executor: Executor | None = None,
    output_mode: str = "cumulative",
) -> EngineCore:
    """An EngineCore for `config`; `model_config` defaults to the checkpoint's, `executor` to the one
    `config.executor` asks for."""
    if model_config is None:
        if config.load.model is None:
            raise ValueError("model: a model directory is required")
        model_config = ModelConfig.from_pretrained(config.load.model)
    if executor is None:
        executor = make_executor(config, model_config)
    return EngineCore(config, model_config, executor, output_mode=output_mode)
