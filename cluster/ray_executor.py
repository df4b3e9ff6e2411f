"""RayExecutor: a group of worker actors, one per TP rank, kept on one node by a placement group.

Each pass's plan is encoded once (msgpack) and the same bytes go to every worker. Transports, in
order of preference: `shm` (a shared-memory ring polled by a thread in each worker, when the driver
runs on the workers' node: tens of microseconds a round trip), `compiled` (a Ray compiled graph),
`calls` (plain actor calls). A worker that dies fails the pass with `WorkerFailure`; `restart()`
replaces the whole group.
"""

from __future__ import annotations

import logging
import os
import time

from deltaserve.layers.config import ModelConfig
from deltaserve.layers.parallel import ParallelLayout, validate_layout
from deltaserve.workers.state_pool import PoolSizes

from .engine import EngineConfig, WorkerFailure, runner_config
from .plan import PassPlan, RunnerOutput
from .shm_channel import ChannelClosed, ShmBroadcast, WaitPolicy, process_alive
from .wire import decode_output, encode_plan

log = logging.getLogger(__name__)


class RayExecutor:
    TRANSPORTS = ("auto", "shm", "compiled", "calls")

    def __init__(self, config: EngineConfig, model_config: ModelConfig, transport: str = "auto"):
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
        if transport not in self.TRANSPORTS:
            raise ValueError(f"transport: must be one of {', '.join(self.TRANSPORTS)}; got {transport!r}")
        self.requested_transport = transport
        self.transport = "calls"  # what the running group uses (set by _start)
        self.workers = []
        self.placement_group = None
        self._dag = None
        self._plans: ShmBroadcast | None = None
        self._replies: list[ShmBroadcast] = []
        self._worker_pids: list[int] = []
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
        self.transport = self._connect()
        elapsed = time.perf_counter() - started
        log.info("worker group of %d ready in %.1fs (plans by %s)", self.world_size, elapsed, self.transport)

    def _connect(self) -> str:
        """Pick and set up the plan transport; returns its name."""
        import ray

        wanted = self.requested_transport
        if wanted in ("auto", "shm"):
            here = ray.get_runtime_context().get_node_id()
            same_node = all(n == here for n in ray.get([w.node_id.remote() for w in self.workers]))
            if same_node:
                self._open_channels()
                return "shm"
            if wanted == "shm":
                raise ValueError("transport: 'shm' needs the driver on the workers' node")
        if wanted in ("auto", "compiled"):
            self._dag = self._compile()
            if self._dag is not None:
                return "compiled"
        return "calls"

    def _open_channels(self) -> None:
        import ray

        # on a GPU host keep polling between passes (a core per process) to wake in microseconds
        wait = WaitPolicy(spin_s=0.0, yield_s=1.0) if self.use_gpu else WaitPolicy()
        self._plans = ShmBroadcast.create(self.world_size, num_slots=4, slot_bytes=1 << 20, wait=wait)
        self._replies = [
            ShmBroadcast.create(1, num_slots=4, slot_bytes=256 << 10, reader=0, wait=wait) for _ in self.workers
        ]
        self._worker_pids = ray.get(
            [
                w.start_channels.remote(self._plans.handle, self._replies[r].handle, os.getpid(), wait)
                for r, w in enumerate(self.workers)
            ]
        )

    def _workers_alive(self) -> bool:
        return all(process_alive(pid) for pid in self._worker_pids)

    def _close_channels(self) -> None:
        # the plan ring first: the worker loops drain it and exit
        for channel in [self._plans, *self._replies]:
            if channel is not None:
                channel.close()
        self._plans, self._replies, self._worker_pids = None, [], []

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

        self._close_channels()
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
        if self._plans is not None:
            output = decode_output(self._execute_shm(blob, plan.pass_id))
        else:
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

    def _execute_shm(self, blob: bytes, pass_id: int) -> bytes:
        """Broadcast the plan on the ring, collect every rank's reply; rank 0's carries the output."""
        try:
            self._plans.write(blob, alive=self._workers_alive)
            frames = [channel.read(alive=self._workers_alive) for channel in self._replies]
        except (ChannelClosed, TimeoutError) as e:
            raise WorkerFailure(f"a worker failed during pass {pass_id}: {e}") from e
        for rank, frame in enumerate(frames):
            if frame[:1] != b"\0":
                error = frame[1:].decode(errors="replace")[-4000:]
                raise WorkerFailure(f"worker rank {rank} failed during pass {pass_id}:\n{error}")
        return frames[0][1:]

    def control_overhead_s(self, last: int | None = None) -> float:
        """Median of (plan ready -> tokens back) minus rank 0's own execute time, over recent passes."""
        import statistics

        times = self.pass_times[-last:] if last else self.pass_times
        return statistics.median(wall - forward for wall, forward in times) if times else 0.0


def _cluster_address() -> str | None:
    import os

    return os.environ.get("RAY_ADDRESS")
