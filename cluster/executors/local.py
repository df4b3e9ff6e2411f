"""LocalExecutor: the whole model in this process (TP = 1)."""

from __future__ import annotations

from deltaserve.cluster.config import EngineConfig
from deltaserve.layers.config import ModelConfig
from deltaserve.workers.plan import PassPlan, RunnerOutput
from deltaserve.workers.runner import ModelRunner, PassOutput


class LocalExecutor:
    """The whole model in this process (TP = 1)."""

    transport = "local"

    def __init__(self, config: EngineConfig, model_config: ModelConfig):
        self.runner = ModelRunner(config.worker_config(), model_config)
        self.runner.allocate(self.runner.sizes)
        self.pool_sizes = self.runner.sizes

    @property
    def supports_async(self) -> bool:
        return True

    def execute(self, plan: PassPlan) -> RunnerOutput:
        return self.runner.execute(plan)

    def execute_async(self, plan: PassPlan) -> PassOutput:
        """Launch the pass; the handle's `result()` waits for its RunnerOutput."""
        return self.runner.execute_async(plan)

    def restart(self) -> None:
        # an in-process runner cannot die separately from the engine; the passes in flight are void
        self.runner.drop_in_flight()

    def shutdown(self) -> None:
        self.runner = None
