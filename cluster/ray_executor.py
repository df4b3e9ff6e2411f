"""RayExecutor: a group of worker actors, one per TP rank, kept on one node by a placement group.

Each pass's plan is encoded once (msgpack) and the same bytes go to every worker, through a Ray
compiled graph when available (shared-memory channels: a fraction of a plain actor call's
overhead) or plain actor calls. A worker that dies fails the pass with `WorkerFailure`; `restart()`
replaces the whole group.
"""

from __future__ import annotations

import logging
import time

from deltaserve.layers.config import ModelConfig
from deltaserve.layers.parallel import ParallelLayout, validate_layout
from deltaserve.workers.state_pool import PoolSizes

from .engine import EngineConfig, WorkerFailure, runner_config
from .plan import PassPlan, RunnerOutput
from .wire import decode_output, encode_plan

log = logging.getLogger(__name__)


class RayExecutor:
    def __init__(self, config: EngineConfig, model_config: ModelConfig, use_compiled_graph: bool | None = None):
        import ray

        # every split checked here, before any actor starts or any weight loads
        validate_layout(model_config, ParallelLayout(0, config.tensor_parallel_size, config.enable_expert_parallel))
        if not ray.is_initialized():
            # RAY_ADDRESS (a Ray job, or set by the user) joins that cluster; otherwise a local one
            ray.init(address=_cluster_address() or "local", log_to_driver=True)
        self.config = config
        self.model_config = model_config
        self.world_size = config.tensor_parallel_size
        self.use_gpu = config.device.startswith("cuda")
        self.use_compiled_graph = use_compiled_graph if use_compiled_graph is not None else True
        self.workers = []
        self.placement_group = None
        self._dag = None
        self.pool_sizes: PoolSizes | None = None
        # per pass: (seconds from plan ready to tokens decoded on the driver, rank 0's own execute time)
        self.pass_times: list[tuple[float, float]] = []
        self._start()

    # ---- lifecycle -----------------------------------------------------------------------------
    def _start(self) -> None:
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from deltaserve.workers.worker import Worker

        started = time.perf_counter()
        bundle = {"GPU": 1, "CPU": 1} if self.use_gpu else {"CPU": 1}
        # STRICT_PACK keeps the whole TP group on one node (NCCL over NVLink, not the network)
        self.placement_group = placement_group([bundle] * self.world_size, strategy="STRICT_PACK")
        ray.get(self.placement_group.ready(), timeout=300)
        actor_cls = ray.remote(num_cpus=1, num_gpus=1 if self.use_gpu else 0, max_restarts=0)(Worker)
        self.workers = [
            actor_cls.options(
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    self.placement_group, placement_group_bundle_index=i
                ),
            ).remote(i, self.world_size)
            for i in range(self.world_size)
        ]
        master = ray.get(self.workers[0].address.remote())
        rconfig = runner_config(self.config)
        sizes = ray.get(
            [
                w.init.remote(rconfig, self.model_config, self.config.enable_expert_parallel, master)
                for w in self.workers
            ]
        )
        # every rank must hold the same pools: the smallest wins
        final = PoolSizes(
            num_blocks=min(s.num_blocks for s in sizes),
            block_size=sizes[0].block_size,
            num_slots=min(s.num_slots for s in sizes),
        )
        if self.pool_sizes is not None:
            final = self.pool_sizes  # a restart keeps the sizes the engine's allocators use
        ray.get([w.allocate.remote(final) for w in self.workers])
        self.pool_sizes = final
        self._dag = self._compile() if self.use_compiled_graph else None
        log.info(
            "worker group of %d ready in %.1fs (compiled graph: %s)",
            self.world_size,
            time.perf_counter() - started,
            self._dag is not None,
        )

    def _compile(self):
        try:
            from ray.dag import InputNode, MultiOutputNode

            with InputNode() as plan:
                dag = MultiOutputNode([w.execute.bind(plan) for w in self.workers])
            return dag.experimental_compile()
        except Exception as e:  # older Ray, or channels unavailable: plain calls still work
            log.warning("Ray compiled graph unavailable (%s); using plain actor calls", e)
            return None

    def shutdown(self) -> None:
        import ray

        if self._dag is not None:
            try:
                self._dag.teardown()
            except Exception as e:
                log.debug("compiled graph teardown: %s", e)
            self._dag = None
        for w in self.workers:
            try:
                ray.kill(w)
            except Exception as e:
                log.debug("kill worker: %s", e)
        self.workers = []
        if self.placement_group is not None:
            try:
                ray.util.remove_placement_group(self.placement_group)
            except Exception as e:
                log.debug("remove placement group: %s", e)
            self.placement_group = None

    def restart(self) -> None:
        """Replace the whole worker group (after a failure)."""
        log.warning("restarting the worker group")
        self.shutdown()
        self._start()

    # ---- one pass ----------------------------------------------------------------------------
    def execute(self, plan: PassPlan) -> RunnerOutput:
        import ray
        from ray.exceptions import RayError

        started = time.perf_counter()
        blob = encode_plan(plan)
        try:
            if self._dag is not None:
                results = ray.get(self._dag.execute(blob))
            else:
                results = ray.get([w.execute.remote(blob) for w in self.workers])
        except RayError as e:
            raise WorkerFailure(f"a worker failed during pass {plan.pass_id}: {type(e).__name__}: {e}") from e
        output = decode_output(results[0])
        if len(self.pass_times) < 100_000:
            self.pass_times.append((time.perf_counter() - started, output.forward_time_s))
        return output

    def control_overhead_s(self, last: int | None = None) -> float:
        """Median of (plan ready -> tokens back) minus rank 0's own execute time, over recent passes."""
        import statistics

        times = self.pass_times[-last:] if last else self.pass_times
        return statistics.median(wall - forward for wall, forward in times) if times else 0.0


def _cluster_address() -> str | None:
    import os

    return os.environ.get("RAY_ADDRESS")
